"""`pdserve-generate`: one-shot or interactive generation with the offline API.

This is what `make run` serves until the servers exist: the real default model, on CPU.
"""

from __future__ import annotations

import argparse
import sys

from engine.llm import LLM
from engine.sampling import SamplingParams


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve-generate", description=__doc__)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    p.add_argument("--chat", action="append", default=[], help="a user message (repeatable)")
    p.add_argument("--prompt", action="append", default=[], help="a raw completion prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (processes)")
    p.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="MoE models: routed experts sharded this many ways over the --tp-size ranks",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
        llm = LLM(
            args.model,
            page_size=args.page_size,
            device=args.device,
            dtype=args.dtype,
            tp_size=args.tp_size,
            ep_size=args.ep_size,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _run(llm, args, params)
    finally:
        llm.shutdown()  # the other tensor-parallel ranks, if any
    return 0


def _run(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> None:
    if args.chat:
        for msg, out in zip(
            args.chat,
            llm.chat([[{"role": "user", "content": m}] for m in args.chat], params),
            strict=True,
        ):
            print(f"user: {msg}\nassistant: {out.text}\n")
    for prompt, out in zip(args.prompt, llm.generate(args.prompt, params), strict=True):
        print(f"{prompt}{out.text}\n")
    if not args.chat and not args.prompt:
        _interactive(llm, params)


def _interactive(llm: LLM, params: SamplingParams) -> None:
    print("pdserve chat on the offline engine; an empty line or Ctrl-D quits.")
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        answer = llm.chat([history], params)[0].text
        history.append({"role": "assistant", "content": answer})
        print(f"assistant> {answer}")


if __name__ == "__main__":
    sys.exit(main())
