"""A small real HTTP process for pod-runner tests: readiness, /metrics, crash, drain on SIGTERM.

Usage: probe_app.py --port N --host IP. On SIGTERM it writes $TERM_MARKER (when set) and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/crash":
            os._exit(3)
        if self.path == "/metrics":
            body = b"# TYPE probe_app_info gauge\nprobe_app_info 1\n"
        else:
            body = f"{os.environ.get('POD_NAME', '?')} {os.getpid()}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)

    def on_term(*_: object) -> None:
        marker = os.environ.get("TERM_MARKER")
        if marker:
            with open(marker, "a") as out:
                out.write(f"{os.getpid()}\n")
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, on_term)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
