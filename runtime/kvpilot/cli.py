"""`kvpilot`: the user's command line (load generator and autoscaling simulator)."""

from __future__ import annotations

import sys

from kvpilot.subcommands import dispatch

SUBCOMMANDS = {
    "bench": ("kvpilot.runtime.bench", "load-test any OpenAI-compatible endpoint"),
    "simulate": ("kvpilot.operator.simulator", "compare autoscaling policies on request traces"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("kvpilot", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
