"""`python -m hack.podrunner --kubeconfig PATH --log-dir DIR` — started by hack/devcluster."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from kubernetes import config

from hack.podrunner.runner import PodRunner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.podrunner")
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--log-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    api = config.new_client_from_config(config_file=str(args.kubeconfig))
    # The runtime's console scripts live beside this interpreter (the project's venv).
    runner = PodRunner(api, args.log_dir, [Path(sys.executable).parent])
    print("podrunner: running pods of nodes labelled kvpilot.dev/local-execution=true", flush=True)
    runner.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
