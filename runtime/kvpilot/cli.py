"""`kvpilot`: the user's command line (load generator and autoscaling simulator).

Subcommands import lazily so each needs only its own dependencies.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "bench": ("kvpilot.runtime.bench", "load-test any OpenAI-compatible endpoint"),
    "simulate": ("kvpilot.operator.simulator", "compare autoscaling policies on request traces"),
}


def usage() -> str:
    lines = ["usage: kvpilot {bench,simulate} [options]", ""]
    lines += [f"  {name:<9} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] not in SUBCOMMANDS:
        print(f"kvpilot: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
