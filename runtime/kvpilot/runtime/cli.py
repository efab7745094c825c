"""`kvpilot-runtime`: what pods run (serve, fetch) and the quantisation-quality tool (eval)."""

from __future__ import annotations

import sys

from kvpilot.subcommands import dispatch

SUBCOMMANDS = {
    "serve": ("kvpilot.runtime.server", "serve the OpenAI-compatible API over the engine"),
    "eval": ("kvpilot.runtime.evaluate", "perplexity per quantisation level and relative loss"),
    "fetch": ("kvpilot.runtime.fetch", "copy a model (hf://, s3://, file://) into a directory"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("kvpilot-runtime", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
