"""A scripted upstream for the gateway's tests, for what a real replica does not do on demand:
break off in the middle of an SSE event and reset the connection, or hold a request until the test
lets it go. A real HTTP/1.1 server on a real socket (a thread of the test process), so the real
gateway process talks to it as to a replica; each POST is answered by the test's `answer`, any
other request (the gateway's /metrics scrape) gets a 404.

    upstream = FakeUpstream(lambda conn, body: cut_mid_event(conn, b'data: {"id":"x","choi'))
    ... models: [{name: cut, backends: [upstream.url]}] ...
    upstream.close()
"""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

Answer = Callable[[socket.socket, bytes], None]  # the connection and the request's body


class FakeUpstream:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.bodies: queue.Queue[bytes] = queue.Queue()  # each POST's body, as it arrives
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head, body = read_request(conn)
            if not head.startswith(b"POST "):
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")  # fmt: skip
                return
            self.bodies.put(body)
            self.answer(conn, body)

    def close(self) -> None:
        self.listener.close()


def read_request(conn: socket.socket) -> tuple[bytes, bytes]:
    """The request's head (request line and headers) and its body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return data, b""
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        more = conn.recv(65536)
        if not more:
            break
        body += more
    return head, body


def cut_mid_event(conn: socket.socket, events: bytes) -> None:
    """Start an SSE answer, send `events` (ending mid-event) as one chunk, then reset the
    connection (RST, not a clean close): a replica that died while writing."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    conn.sendall(f"{len(events):x}\r\n".encode() + events + b"\r\n")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def json_answer(conn: socket.socket, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n".encode()
                 + b"Connection: close\r\n\r\n" + data)  # fmt: skip


def completion(model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A completions answer with its usage, as the runtime writes it."""
    return {
        "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": model,
        "choices": [{"index": 0, "text": " x" * completion_tokens, "finish_reason": "length",
                     "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip
