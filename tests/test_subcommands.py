"""The command-line dispatcher: help, unknown commands, and lazy dispatch to a module's main."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot import cli as user_cli
from kvpilot.runtime import cli as runtime_cli
from kvpilot.subcommands import KVPILOT, KVPILOT_RUNTIME, Subcommands, dispatch

TABLE = {"json": ("json.tool", "pretty-print JSON"), "zip": ("zipfile", "zip files")}


@pytest.mark.parametrize(
    ("argv", "code", "stream", "text"),
    [
        ([], 0, "out", "usage: prog {json,zip} [options]"),
        (["--help"], 0, "out", "  json   pretty-print JSON"),
        (["-h"], 0, "out", "  zip    zip files"),
        (["nope"], 2, "err", "prog: unknown command 'nope'"),
    ],
)
def test_dispatch_answers_help_and_typos(
    argv: list[str], code: int, stream: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dispatch("prog", TABLE, argv) == code
    captured = capsys.readouterr()
    assert text in (captured.out if stream == "out" else captured.err)


def test_dispatch_runs_the_subcommand_with_the_rest_of_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "echo_sub.py").write_text("def main(argv):\n    print(argv)\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert dispatch("prog", {"echo": ("echo_sub", "echo")}, ["echo", "-x", "y"]) == 3
    assert capsys.readouterr().out == "['-x', 'y']\n"


@pytest.mark.parametrize(
    ("program", "main", "table", "names"),
    [
        ("kvpilot", user_cli.main, KVPILOT, ["bench", "simulate"]),
        ("kvpilot-runtime", runtime_cli.main, KVPILOT_RUNTIME, ["serve", "eval", "fetch"]),
    ],
)
def test_each_command_line_lists_its_subcommands(
    program: str,
    main: Callable[[list[str]], int],
    table: Subcommands,
    names: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert list(table) == names
    assert main(["--help"]) == 0  # the entry point pyproject names answers with its own table
    assert capsys.readouterr().out.startswith(f"usage: {program} {{{','.join(names)}}}")
