"""Compare two lm-eval runs' per-sample loglikelihoods (`--log_samples` files) of one task:
the largest difference, how many documents pick the same answer, and each run's accuracy.

    python -m scripts.serving.loglik_compare HF_SAMPLES.jsonl GATEWAY_SAMPLES.jsonl

Used to check the gateway's `echo` + `logprobs` (lm-eval's `local-completions`) against
lm-eval's `hf` backend on the same model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _scores(path: Path) -> dict[int, tuple[list[float], float]]:
    """doc id -> (loglikelihood of each choice, acc)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["doc_id"]: ([float(x[0]) for x in r["filtered_resps"]], r["acc"]) for r in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("candidate", type=Path)
    args = parser.parse_args(argv)
    ref, cand = _scores(args.reference), _scores(args.candidate)
    if set(ref) != set(cand):
        print(f"different documents: {sorted(set(ref) ^ set(cand))[:10]}")
        return 1
    diff = max(abs(a - b) for d in ref for a, b in zip(ref[d][0], cand[d][0], strict=True))
    same = sum(ref[d][0].index(max(ref[d][0])) == cand[d][0].index(max(cand[d][0])) for d in ref)
    acc_ref = sum(ref[d][1] for d in ref) / len(ref)
    acc_cand = sum(cand[d][1] for d in cand) / len(cand)
    print(f"{len(ref)} documents; max |loglikelihood difference| {diff:.3g}")
    print(f"same answer picked: {same}/{len(ref)}; acc {acc_ref:.4f} vs {acc_cand:.4f}")
    return 0 if same == len(ref) else 1


if __name__ == "__main__":
    raise SystemExit(main())
