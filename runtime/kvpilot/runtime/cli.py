"""`kvpilot-runtime`: what pods run (serve, fetch) and the quantisation-quality tool (eval);
its subcommands are listed in kvpilot.subcommands."""

from __future__ import annotations

import sys

from kvpilot.subcommands import kvpilot_runtime as main

if __name__ == "__main__":
    sys.exit(main())
