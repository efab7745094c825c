"""kvpilot's two command lines with subcommands, and their one dispatcher: `kvpilot` (the
user's tools) and `kvpilot-runtime` (what pods run, and the quantisation-quality tool).

Each subcommand's module is imported only when it runs, so `--help` and a typo answer at once
and each subcommand needs only its own dependencies (no torch for `kvpilot bench`).
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with a main(argv) -> int | None, one line of help)
Subcommands = dict[str, tuple[str, str]]

KVPILOT: Subcommands = {
    "bench": ("kvpilot.runtime.bench", "load-test any OpenAI-compatible endpoint"),
    "simulate": (
        "kvpilot.operator.autoscaling.simulator",
        "compare autoscaling policies on request traces",
    ),
}
KVPILOT_RUNTIME: Subcommands = {
    "serve": ("kvpilot.runtime.server.serve", "serve the OpenAI-compatible API over the engine"),
    "eval": ("kvpilot.runtime.evaluate", "perplexity per quantisation level and relative loss"),
    "fetch": ("kvpilot.contract.fetch", "copy a model (hf://, s3://, file://) into a directory"),
}


def usage(program: str, subcommands: Subcommands) -> str:
    width = max(map(len, subcommands)) + 2
    lines = [f"usage: {program} {{{','.join(subcommands)}}} [options]", ""]
    lines += [f"  {name:<{width}} {text}" for name, (_, text) in subcommands.items()]
    return "\n".join(lines)


def dispatch(program: str, subcommands: Subcommands, argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage(program, subcommands))
        return 0
    if args[0] not in subcommands:
        print(
            f"{program}: unknown command {args[0]!r}\n\n{usage(program, subcommands)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(subcommands[args[0]][0])
    return int(module.main(args[1:]) or 0)


def kvpilot(argv: list[str] | None = None) -> int:
    return dispatch("kvpilot", KVPILOT, argv)


def kvpilot_runtime(argv: list[str] | None = None) -> int:
    return dispatch("kvpilot-runtime", KVPILOT_RUNTIME, argv)
