"""A static gateway (and one with budgets from its config file) never imports the Kubernetes
client: it was most of the start-up CPU of a gateway that does not watch a cluster."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_cli_does_not_import_the_kubernetes_client() -> None:
    probe = (
        "import sys, kvpilot.gateway.cli as cli; "
        "args = cli.parse_args(['--config', 'routes.yaml']); "
        "assert args.discovery == 'static'; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
