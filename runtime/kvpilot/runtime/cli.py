"""`kvpilot-runtime`: what kvpilot pods run (serve) and the quantisation-quality tool (eval).

Subcommands import lazily so `--help` and a typo answer without loading torch.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": ("kvpilot.runtime.server", "serve the OpenAI-compatible API over the engine"),
    "eval": ("kvpilot.runtime.evaluate", "perplexity per quantisation level and relative loss"),
    "fetch": ("kvpilot.runtime.fetch", "copy a model (hf://, s3://, file://) into a directory"),
}


def usage() -> str:
    lines = ["usage: kvpilot-runtime {serve,eval,fetch} [options]", ""]
    lines += [f"  {name:<6} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] not in SUBCOMMANDS:
        print(f"kvpilot-runtime: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
