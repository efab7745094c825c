"""`kvpilot`: the user's command line (load generator and autoscaling simulator); its
subcommands are listed in kvpilot.subcommands."""

from __future__ import annotations

import sys

from kvpilot.subcommands import kvpilot as main

if __name__ == "__main__":
    sys.exit(main())
