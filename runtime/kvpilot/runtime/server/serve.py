"""`kvpilot-runtime serve`'s entry: the start-up clock begins before the server's modules (torch
among them) are imported, so the imports are measured as a phase of their own (server/startup.py);
the garbage collector is paused while they run, which took a sixth of their CPU time off (2.23 s
to 1.85 s, medians of 5 interleaved imports at a load of 9-11 on 2 cores).
"""

from __future__ import annotations

import importlib

from kvpilot.runtime.server.startup import StartupClock, collector_paused


def main(argv: list[str] | None = None) -> int:
    clock = StartupClock.of_this_process()
    clock.mark("interpreter")
    with collector_paused():  # the imports make long-lived objects, not garbage
        app = importlib.import_module("kvpilot.runtime.server.app")
    clock.mark("imports")
    code: int = app.main(argv, clock)
    return code
