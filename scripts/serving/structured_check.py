"""Structured output against a running gateway: every schema of scripts/structured_schemas.py,
streamed and not, through `response_format: json_schema`; prints how many answers are valid.

    python -m scripts.serving.structured_check --base-url http://127.0.0.1:8000

Exits 1 when any answer is not a document valid under its schema (or did not end with `stop`).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from scripts.structured_schemas import SCHEMAS, SchemaCase, check


def ask(
    client: Any, model: str, case: SchemaCase, stream: bool, max_tokens: int
) -> tuple[str, str]:
    """(text, finish_reason) of a greedy answer in `case`'s schema."""
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": case.prompt + " Answer in JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
        },
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    text, finish = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key, max_retries=0)
    model = client.models.list().data[0].id
    jobs = [(case, stream) for case in SCHEMAS for stream in (False, True)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        answers = list(pool.map(lambda j: ask(client, model, j[0], j[1], args.max_tokens), jobs))
    valid = 0
    for (case, stream), (text, finish) in zip(jobs, answers, strict=True):
        problem = check(case.schema, text) or (None if finish == "stop" else f"ended {finish}")
        valid += problem is None
        if problem:
            print(f"INVALID {case.name} stream={stream}: {problem}: {text!r}")
    print(
        f"{valid}/{len(jobs)} valid ({len(SCHEMAS)} schemas, streamed and not) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0 if valid == len(jobs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
