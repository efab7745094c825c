"""Writes benchmark results into docs/benchmarks.md, one section per benchmark.

Each benchmark owns the text between `<!-- BEGIN name -->` and `<!-- END name -->`, so running one
benchmark rewrites its own figures and leaves the others alone. Every section states the command
that produced it and the machine it ran on, as DESIGN.md §5 asks.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

# KVPILOT_BENCH_DOC redirects every section to another file (bench/gpu_check.sh writes a copy
# under its output folder, so a run on a lent machine leaves the tree alone).
DOC = Path(
    os.environ.get(
        "KVPILOT_BENCH_DOC", Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    )
)
HEADER = (
    "# kvpilot benchmarks\n\n"
    "Written by `make bench` (bench/); each section names the command that made it. Figures are\n"
    "ratios measured side by side in one run on the machine named in the section.\n"
)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        cpu = model
    except (OSError, StopIteration):
        pass
    gpu = gpu_name()
    return f"{os.cpu_count()} CPU cores ({cpu}){', ' + gpu if gpu else ', no GPU'}"


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def command_line(module: str, argv: list[str] | None) -> str:
    """How a benchmark was run, for its section: `python -m MODULE ARGS`."""
    return " ".join(["python -m", module, *(sys.argv[1:] if argv is None else argv)])


def write_section(name: str, title: str, command: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the section `name` in docs/benchmarks.md."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"<!-- BEGIN {name} -->\n## {title}\n\n"
        f"Command: `{command}`  \nMachine: {machine()}  \nRun: {stamp}\n\n{body.strip()}\n"
        f"<!-- END {name} -->"
    )
    text = doc.read_text() if doc.exists() else HEADER
    pattern = re.compile(
        rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S
    )
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else f"{text}\n{section}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
