"""The GPU suite's entry point on a CPU (`python -m scripts.gpu`): every sub-command imports and
answers --help, and `all` writes its summary table (the checks themselves need a GPU host)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.gpu.__main__ import COMMANDS_HELP, main


@pytest.mark.parametrize("command", [None, *COMMANDS_HELP])
def test_every_sub_command_answers_help(command: str | None, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as done:
        main(["--help"] if command is None else [command, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith(
        f"usage: python -m scripts.gpu{'' if command is None else ' ' + command}"
    )
    if command is None:
        assert all(name in usage for name in COMMANDS_HELP)


def test_all_writes_a_summary_of_what_ran(tmp_path: Path) -> None:
    code = main(["all", "--out", str(tmp_path), "--skip", "engine,serve"])
    summary = (tmp_path / "summary.md").read_text()
    assert "| engine | skipped |" in summary and "| serve | skipped |" in summary
    assert "| tp | not run: fewer than two GPUs visible |" in summary
    assert code == 0
