"""`pdserve-eplb`: an expert placement from recorded expert distributions.

    pdserve-eplb DUMP [DUMP ...] --ep-size R --slots-per-rank S [--out PLACEMENT.json]

Reads one or more dumps of one model (a node's `--expert-distribution-out` file, or
`pdserve-admin expert-distribution dump`; several are added up, e.g. a prefill and a decode
node's), places each MoE layer's experts over R EP ranks of S slots each (S x R - E slots hold
copies of the hottest experts; balance.py), writes the placement for `--expert-placement`, and
prints per layer and over the model the max / mean rank load under the default contiguous
placement (before) and under the new one (after). The same dumps give the same placement.
Exit codes: 0 done, 2 a file or flag that cannot be used (the message says which).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.eplb.balance import BalanceReport, compare, rebalance
from engine.eplb.distribution import ExpertDistribution, merge
from engine.eplb.files import EPLBFileError
from engine.eplb.placement import ExpertPlacement


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve-eplb", description=__doc__.splitlines()[0])
    parser.add_argument("dumps", nargs="+", type=Path, metavar="DUMP",
                        help="expert distribution files (JSON) of one model")  # fmt: skip
    parser.add_argument("--ep-size", type=int, required=True, help="expert-parallel ranks")
    parser.add_argument(
        "--slots-per-rank",
        type=int,
        required=True,
        help="expert slots on each rank, redundant copies included (E / ep-size + r)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the placement here")
    return parser


def run(
    dumps: Sequence[Path], ep_size: int, slots_per_rank: int, out: Path | None
) -> BalanceReport:
    """Place, print the report, write the placement to `out`; EPLBFileError on bad input."""
    dist = merge([ExpertDistribution.read(path) for path in dumps])
    placement = rebalance(dist, ep_size, slots_per_rank)
    before = ExpertPlacement.contiguous(dist.layer_ids, dist.num_experts, ep_size, dist.model)
    report = compare(dist, before, placement)
    print(describe(dist, len(dumps)))
    print(table(report, placement))
    if out is not None:
        placement.write(out)
        print(f"placement written to {out} (serve it with --expert-placement {out})")
    return report


def describe(dist: ExpertDistribution, files: int) -> str:
    skew = ", ".join(
        f"{layer}: {s:.2f}" for layer, s in zip(dist.layer_ids, dist.skew(), strict=True)
    )
    return (
        f"expert distribution of {dist.model} ({files} file{'s' * (files > 1)}): "
        f"{dist.num_layers} MoE layers x {dist.num_experts} experts, top-{dist.top_k}, "
        f"{dist.tokens} tokens over {dist.seconds:.1f} s\n"
        f"expert skew, max / mean tokens over the experts, per layer: {skew}"
    )


def table(report: BalanceReport, placement: ExpertPlacement) -> str:
    lines = [
        f"EP {placement.ep_size} ranks x {placement.slots_per_rank} slots "
        f"({placement.num_redundant} redundant a layer): max / mean rank load",
        f"{'layer':>7} {'before':>7} {'after':>7}  replicated experts",
    ]
    for layer in report.layers:
        copies = " ".join(str(e) for e in layer.replicated) or "-"
        lines.append(f"{layer.layer:>7} {layer.before:>7.3f} {layer.after:>7.3f}  {copies}")
    lines.append(f"{'model':>7} {report.before:>7.3f} {report.after:>7.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args.dumps, args.ep_size, args.slots_per_rank, args.out)
    except EPLBFileError as exc:
        print(f"pdserve-eplb: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
