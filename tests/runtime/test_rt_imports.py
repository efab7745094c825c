"""The runtime's server never imports torch's compiler stack (torch._dynamo) at start-up: it was
5.4 s of a 7.8 s import on 2 cores, pulled in by llguidance.torch, which compiles a function at
import time (grammar_mask uses llguidance's numpy helpers instead)."""

from __future__ import annotations

import subprocess
import sys


def test_the_server_does_not_import_torch_dynamo() -> None:
    probe = (
        "import sys, kvpilot.runtime.server.app, kvpilot.runtime.engine.engine; "
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"
