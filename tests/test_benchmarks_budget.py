"""benchmarks/ stays readable and small: one folder under a size budget, raw artefacts beside
the report they belong to and compressed when large, and an index (benchmarks/README.md) that
lists every report, whose table of today's figures names commands that exist."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
INDEX = BENCHMARKS / "README.md"

BUDGET_BYTES = 4 * 1024 * 1024
RAW_LIMIT_BYTES = 64 * 1024
# Uncompressed files over RAW_LIMIT_BYTES that code reads as they are.
READ_BY_CODE = {
    # tests/test_pd_planner.py decides this run's recorded windows again
    "serving-2026-11-27-two-phase-11/two_phase.json",
}
REMOVED = "† marks a command whose script is one of them"


def _files() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*") if p.is_file())


def _reports() -> set[str]:
    return {p.stem for p in BENCHMARKS.glob("*.md") if p != INDEX}


def _figures_rows() -> list[str]:
    text = INDEX.read_text()
    section = text.split("## Today's figures", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "[report]" in line]


def test_the_folder_holds_its_budget() -> None:
    total = sum(p.stat().st_size for p in _files())
    largest = sorted(_files(), key=lambda p: p.stat().st_size, reverse=True)[:5]
    names = ", ".join(f"{p.relative_to(BENCHMARKS)} ({p.stat().st_size:,} B)" for p in largest)
    assert total <= BUDGET_BYTES, (
        f"benchmarks/ holds {total:,} bytes, over its budget of {BUDGET_BYTES:,} (4 MiB). "
        "Gzip raw artefacts, drop those no report's table needs (git keeps them: the report "
        f"names the commit), or reduce superseded reports to stubs. Largest: {names}"
    )


def test_every_raw_artefact_lives_beside_its_report() -> None:
    reports = _reports()
    stray = []
    for path in _files():
        rel = path.relative_to(BENCHMARKS)
        if len(rel.parts) == 1:
            if path.suffix != ".md":
                stray.append(str(rel))
        elif rel.parts[0] not in reports:
            stray.append(str(rel))
    assert not stray, (
        "files in benchmarks/ that belong to no report: a raw artefact lives in the folder "
        f"benchmarks/<stem>/ of the report benchmarks/<stem>.md, and nowhere else: {stray}"
    )


def test_large_raw_artefacts_are_compressed() -> None:
    large = [
        f"{rel} ({path.stat().st_size:,} B)"
        for path in _files()
        if (rel := path.relative_to(BENCHMARKS).as_posix()).count("/")
        and path.suffix != ".gz"
        and path.stat().st_size > RAW_LIMIT_BYTES
        and rel not in READ_BY_CODE
    ]
    assert not large, (
        f"raw artefacts over {RAW_LIMIT_BYTES // 1024} KiB must be gzipped (NAME.gz), or listed "
        f"in READ_BY_CODE here if code reads them as they are: {large}"
    )


def test_the_index_lists_every_report_and_only_reports_that_exist() -> None:
    text = INDEX.read_text()
    linked = set(re.findall(r"\]\(([^)/]+)\.md\)", text))
    reports = _reports()
    missing = sorted(linked - reports)
    assert not missing, f"benchmarks/README.md links reports that do not exist: {missing}"
    unlisted = sorted(reports - linked)
    assert not unlisted, (
        "reports missing from benchmarks/README.md: add one line each under 'Reports' "
        f"(and a row of today's figures if one is today's latest): {unlisted}"
    )


def test_every_figure_names_a_machine_date_commit_and_command() -> None:
    rows = _figures_rows()
    assert 10 <= len(rows) <= 20, f"today's figures should be 10-20 rows, found {len(rows)}"
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        assert len(cells) == 6, f"a row is what | value | machine | date | commit | command: {row}"
        _, value, machine, date, commit, command = cells
        assert value and machine, row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"date as YYYY-MM-DD: {row}"
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), f"commit as a hash: {row}"
        assert command.startswith("`"), f"the command in backticks: {row}"


def _expand(path: str) -> list[str]:
    """`a/{1,2}/b` -> `a/1/b`, `a/2/b` (the shell's brace expansion, one level)."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _module_exists(module: str) -> bool:
    path = ROOT / module.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_the_commands_of_todays_figures_exist() -> None:
    """A figure's command runs today's code, or its row says the script was removed (†)."""
    assert REMOVED in INDEX.read_text()
    absent = []
    for row in _figures_rows():
        command = row.rstrip(" |").rsplit(" | ", 1)[1]
        files = list(re.findall(r"benchmarks/[\w./{},-]+", command))
        if "†" not in command:
            files += re.findall(r"python3? ((?:scripts|tests)/[\w/]+\.py)", command)
            files += re.findall(r"(tests/test_\w+\.py)", command)
            modules = re.findall(r"python3? -m ([\w.]+)", command)
            absent += [m for m in modules if m != "pytest" and not _module_exists(m)]
        absent += [f for pattern in files for f in _expand(pattern) if not (ROOT / f).exists()]
    assert not absent, (
        "commands in benchmarks/README.md's table of today's figures name files that do not "
        "exist: give today's command, or mark the row † if its script was removed (it is then "
        f"at commit 6b9c325): {absent}"
    )
