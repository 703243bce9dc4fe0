"""Rows of the report's tables from run folders: python3 summarize.py RUN... (from this folder)."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def pct(values, q):
    v = sorted(values)
    r = (len(v) - 1) * q / 100
    lo = int(r)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (r - lo)


for label in sys.argv[1:]:
    run = HERE / label
    doc = json.loads((run / "result.json").read_text())
    s = doc["summary"]
    requests = [r for r in doc["requests"] if r["chunks"]]
    ttft = [((r["chunks"][0] - r["sent"]) * 1000, r["turn"]) for r in requests]
    every = [t for t, _ in ttft]
    first = [t for t, turn in ttft if turn == 0]
    later = [t for t, turn in ttft if turn > 0]
    local = [
        line.split()[-1]
        for line in (run / "metrics.txt").read_text().splitlines()
        if line.startswith("pdserve_gateway_local_prefills_total")
    ]
    print(
        f"| {label} | {s['duration_s']:.0f} | {s['request_throughput']:.3f} "
        f"| {s['output_token_throughput']:.2f} | {pct(every, 50):.0f} | {pct(first, 50):.0f} "
        f"| {pct(later, 50):.0f} / {pct(later, 90):.0f} "
        f"| {doc['cache']['hit_rate']:.1%} / {doc['cache']['best_rate']:.1%} "
        f"| {float(local[0]) if local else 0:.0f} |"
    )
