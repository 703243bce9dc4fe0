"""Test-only entry point until the gateway exists: run bootstrap + one prefill + one decode node
on 127.0.0.1 and send prompts through the pair with a fresh bootstrap room each.

    .venv/bin/python scripts/pd_pair.py --backend nixl --chat "What is the capital of France?"
    .venv/bin/python scripts/pd_pair.py --prompt-ids 1,2,3 --max-new-tokens 8

Prints each answer, the room, TTFT and what the prefill node sent; node logs go to --log-dir.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_fetch import ensure_default_model
from proto import node_pb2
from tests.pd_cluster import pd_cluster


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl"])
    p.add_argument("--chat", action="append", default=[])
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args()
    model = Path(args.model) if args.model else ensure_default_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [[int(t) for t in ids.split(",")] for ids in args.prompt_ids]
    for content in args.chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        prompts.append([int(t) for t in ids])  # type: ignore[arg-type]
    if not prompts:
        p.error("give at least one --chat or --prompt-ids")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pd-pair-"))
    sampling = node_pb2.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    with pd_cluster(log_dir, model, args.backend) as cluster:
        for prompt, result in zip(prompts, cluster.generate_many(prompts, sampling), strict=True):
            finished = result.finished
            print(f"room {result.room}: {tokenizer.decode(result.token_ids)!r}")
            print(f"  finish {finished.finish_reason if finished else result.prefill_error}")
            print(f"  prompt {len(prompt)} tokens, TTFT {result.ttft_s * 1e3:.0f} ms")
            if result.prefill is not None:
                sent = result.prefill
                print(
                    f"  sent {sent.sent_pages} pages, {sent.sent_bytes} B, {sent.descriptors} desc"
                )
        cluster.check_no_leaks()
    print(f"logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
