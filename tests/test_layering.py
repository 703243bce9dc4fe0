"""The process boundaries the code promises: a gateway without torch, imports that run one way.

The import contracts themselves live in pyproject.toml ([tool.importlinter]) and run in
`make lint`; this test runs them too, so that `pytest` alone catches a broken layer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The gateway's whole start-up path up to serving: flags, model config, tokenizer, the ASGI app.
GATEWAY_STARTUP = """
import sys
import gateway.process.server
from gateway.api.app import Gateway, build_app
from gateway.requests.protocol import ChatMessage
from gateway.requests.text import TextCodec

args = gateway.process.server.build_parser().parse_args(["--bootstrap", "127.0.0.1:1"])
config = gateway.process.server.build_config(args, sys.argv[1])
codec = TextCodec.load(sys.argv[1])
codec.chat_prompt([ChatMessage("user", "hi")])
build_app(Gateway(config, codec))
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("torch modules:", heavy[:5])
sys.exit(1 if heavy else 0)
"""


def test_gateway_process_does_not_import_torch(default_model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", GATEWAY_STARTUP, str(default_model_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_hold() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint_imports is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:]


def test_light_tokenizer_loader_matches_autotokenizer(default_model_dir: Path) -> None:
    """load_tokenizer skips AutoTokenizer (and its torch import) for a tokenizer.json: it must
    give the same ids, text and chat prompts."""
    from transformers import AutoTokenizer

    from engine.tokenizer import load_tokenizer

    light = load_tokenizer(str(default_model_dir))
    auto = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert type(light) is type(auto)
    for text in ["Hello world", "  spaces\tand\nlines ", "émoji 🙂 中文", "<|im_start|>user"]:
        ids = auto.encode(text)
        assert light.encode(text) == ids
        assert light.decode(ids, skip_special_tokens=True) == auto.decode(
            ids, skip_special_tokens=True
        )
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and now?"},
    ]
    assert light.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert light.eos_token_id == auto.eos_token_id and len(light) == len(auto)
