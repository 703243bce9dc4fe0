"""The gateway's CPU per burst with nothing else in flight (no one-token requests to subtract).

    PYTHONPATH=. python benchmarks/serving-2026-11-26-hostile-clients-3/cpu_per_burst.py \
        --model out/probe/tiny-chat --chars 600000 --bursts 5

Starts a pd-cluster as the hostile probe does, then sends `--bursts` bursts of 8 prompts of
`--chars` characters from 8 sender processes at nice 19, one after the other, and prints the
median CPU per burst of the gateway's event-loop thread, its other threads and its children
(`scripts.serving.hostile_probe.cpu_seconds`), and the gateway's minor page faults per burst.
"""

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from scripts.serving import hostile_probe as hp


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--chars", type=int, default=3_900_000)
    parser.add_argument("--bursts", type=int, default=10)
    args = parser.parse_args()
    log = Path(tempfile.gettempdir()) / "cpu-per-burst-cluster.log"
    with hp.cluster(args.model, log) as probe:
        body = {"model": probe.model, **hp._text(args.chars)}
        content = json.dumps(body, separators=(",", ":")).encode()
        url = probe.url + "/v1/completions"
        spent, faults = [], []
        with ProcessPoolExecutor(
            8, initializer=hp._start_sender, initargs=(url, content, 19)
        ) as pool:
            list(pool.map(abs, range(32)))  # every sender started
            for _ in range(args.bursts):
                before, faults_before = (
                    hp.cpu_seconds(probe.gateway_pid),
                    minor_faults(probe.gateway_pid),
                )
                for status in [
                    f.result() for f in [pool.submit(hp._post_status, url) for _ in range(8)]
                ]:
                    assert 400 <= status < 500, status
                after = hp.cpu_seconds(probe.gateway_pid)
                spent.append([(b - a) * 1000 for a, b in zip(before, after, strict=True)])
                faults.append(minor_faults(probe.gateway_pid) - faults_before)
                time.sleep(0.5)
    loop, threads, children = (statistics.median(s[i] for s in spent) for i in range(3))
    print(
        f"{args.bursts} bursts of 8 x {args.chars} chars: gateway CPU per burst (median) "
        f"event loop {loop:.1f} ms, other threads {threads:.1f} ms, children {children:.1f} ms; "
        f"minor faults {statistics.median(faults):.0f}"
    )


if __name__ == "__main__":
    main()
