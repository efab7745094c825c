"""Runtime server under oversized input: /health latency and a running stream's token gaps while
50 MB bodies and over-long prompts are sent and refused.

    .venv/bin/python -m bench.server_input_safety [--rounds 3]

A real `kvpilot-runtime serve` on the tiny model (max_model_len 512, the default 16 MiB body
limit). One thread probes /health back to back, another keeps a streamed completion running;
meanwhile each kind of bad input is sent `--rounds` times. Reported: /health latency and the
stream's largest gap between chunks, idle and during each kind. tests/server/
test_server_input_safety.py asserts the same scenario with generous bounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import select
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.report import markdown_table, write_section
from bench.server_common import runtime_server
from kvpilot.runtime.models.tokenizer_files import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-llama"
MB = 1_000_000
PIECE = 1 << 20  # bytes per write (and per chunk of a chunked body)


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict
    num_sent: int  # body bytes written before the server answered


def _request_head(path: str, size: int, chunked: bool) -> bytes:
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    return (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\n{length}\r\n\r\n"
    ).encode()


def _json_prompt_pieces(size: int, model: str) -> Iterator[bytes]:
    """A `size`-byte JSON completion body whose prompt is one long text, piece by piece."""
    head, tail = f'{{"model": "{model}", "prompt": "'.encode(), b'"}'
    filler = size - len(head) - len(tail)
    yield head
    while filler > 0:
        yield b"word " * (min(PIECE, filler) // 5) + b"x" * (min(PIECE, filler) % 5)
        filler -= PIECE
    yield tail


def upload(url: str, path: str, size: int, chunked: bool, model: str = "tiny") -> Answer:
    """POST a `size`-byte body over a raw socket, stopping as soon as the server answers.

    An HTTP client library writes the whole body before reading; this shows that the server
    refuses a large body without reading it (Content-Length) or after reading only its limit.
    """
    host, port = url.removeprefix("http://").split(":")
    num_sent = 0
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(_request_head(path, size, chunked))
        for piece in _json_prompt_pieces(size, model):
            if select.select([sock], [], [], 0)[0]:
                break  # the server has answered already
            data = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                break
            num_sent += len(piece)
        else:
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        status, body = _read_response(sock)
    return Answer(status, body, num_sent)


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while True:
        try:
            more = sock.recv(65536)
        except ConnectionResetError:
            break
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


@dataclass
class Probe:
    """Calls `fn` back to back in a thread; `samples` are (start, seconds) per call."""

    fn: Callable[[], None]
    samples: list[tuple[float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                self.fn()
            except Exception as exc:  # recorded: the caller asserts there are none
                self.errors.append(repr(exc))
            self.samples.append((start, time.perf_counter() - start))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=120)

    def between(self, t0: float, t1: float) -> list[float]:
        return [s for start, s in self.samples if t0 <= start <= t1]


def health_probe(url: str) -> Probe:
    client = httpx.Client(timeout=30)

    def check() -> None:
        response = client.get(f"{url}/health")
        if response.status_code != 200:
            raise RuntimeError(f"/health answered {response.status_code}")

    return Probe(check)


class StreamWatch:
    """Streams completions back to back (ignore_eos) in a thread, noting when each chunk arrives."""

    def __init__(self, url: str, model: str = "tiny", max_tokens: int = 400):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.gaps: list[tuple[float, float]] = []  # (arrival, seconds since the previous chunk)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "The list", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                try:
                    self._one_stream(client, body)
                except Exception as exc:  # recorded: the caller asserts there are none
                    self.errors.append(repr(exc))

    def _one_stream(self, client: httpx.Client, body: dict) -> None:
        last = None
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: {"):
                    if last is not None:
                        self.gaps.append((now, now - last))
                    last = now
                if self.stop.is_set():
                    return

    def between(self, t0: float, t1: float) -> list[float]:
        return [gap for at, gap in self.gaps if t0 <= at <= t1]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def oversized_requests(url: str, max_model_len_chars: int) -> dict[str, Callable[[], int]]:
    """Each kind of input the server must refuse quickly; each returns the HTTP status.

    Bodies are encoded here, ahead of time: encoding 8 MB of JSON in the caller's process would
    hold its GIL and delay its own probe threads, which is not the server's latency.
    """
    long_text = "word " * (max_model_len_chars // 5 + 1000)
    huge_text = "word " * (8 * MB // 5)
    chat = [{"role": "user", "content": huge_text}]
    bodies: dict[str, tuple[str, dict[str, object]]] = {
        "8 MB prompt (under the body limit)": ("/v1/completions", {"prompt": huge_text}),
        "8 MB chat message": ("/v1/chat/completions", {"messages": chat}),
        "prompt just over the character bound": ("/v1/completions", {"prompt": long_text}),
    }
    requests: dict[str, Callable[[], int]] = {
        "50 MB body, Content-Length": lambda: upload(url, "/v1/completions", 50 * MB, False).status,
        "50 MB body, chunked": lambda: upload(url, "/v1/completions", 50 * MB, True).status,
    }
    for name, (path, body) in bodies.items():
        content = json.dumps({"model": "tiny", **body}).encode()
        requests[name] = functools.partial(_post, f"{url}{path}", content)
    return requests


def token_id_flood(url: str) -> Callable[[], int]:
    """The costliest body to parse under the limit: ~16 MB of token ids (JSON integers parse
    ~10x slower per byte than text; the server parses it off the event loop,
    server/body_parsing.py)."""
    ids = [1234] * (16 * 2**20 // 6 - 10)
    content = json.dumps({"model": "tiny", "prompt": ids}).encode()
    return functools.partial(_post, f"{url}/v1/completions", content)


def _post(url: str, content: bytes) -> int:
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=content, headers=headers, timeout=120).status_code


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.1f}"


def measure(url: str, rounds: int) -> list[list[object]]:
    max_model_len = httpx.post(f"{url}/tokenize", json={"prompt": "a"}).json()["max_model_len"]
    max_chars = max_model_len * Tokenizer(TINY).max_chars_per_token
    health, stream = health_probe(url), StreamWatch(url)
    rows: list[list[object]] = []
    try:
        time.sleep(3)  # idle baseline: the stream runs, nothing else
        t1 = time.perf_counter()
        rows.append(_row("none (baseline)", "-", "-", health.between(0, t1), stream.between(0, t1)))
        kinds = oversized_requests(url, max_chars)
        kinds["16 MB of token ids (just under the body limit)"] = token_id_flood(url)
        for name, send in kinds.items():
            t0 = time.perf_counter()
            statuses, seconds = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                statuses.append(send())
                seconds.append(time.perf_counter() - start)
            t1 = time.perf_counter()
            answer = "/".join(sorted({str(s) for s in statuses}))
            took = f"{statistics.median(seconds):.2f}"
            rows.append(_row(name, answer, took, health.between(t0, t1), stream.between(t0, t1)))
    finally:
        health.close()
        stream.close()
    if health.errors or stream.errors:
        raise RuntimeError(f"probe errors: {health.errors[:3]} {stream.errors[:3]}")
    return rows


def _row(name: str, status: str, took: str, probes: list[float], gaps: list[float]) -> list:
    return [name, status, took, len(probes), _ms(probes, 0.5), _ms(probes, 0.99),
            _ms(probes, 1.0), _ms(gaps, 0.5), _ms(gaps, 1.0)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    limits = ("--max-model-len", "512", "--max-num-seqs", "8")
    with runtime_server(TINY, *limits) as served:
        url, pid = served
        rss_ready = peak_rss_mib(pid)
        rows = measure(url, args.rounds)
        rss_after = peak_rss_mib(pid)
    header = ["input sent", "answer", "answer s (median)", "/health probes",
              "/health p50 ms", "p99 ms", "max ms", "stream gap p50 ms", "max ms"]  # fmt: skip
    body = (
        "While each kind of oversized input is sent and refused, a thread probes `/health` back "
        "to back and a streamed completion keeps running (tiny model, max_model_len 512, body "
        "limit 16 MiB; the client's bodies are encoded before timing). For comparison, issue 13 "
        "measured the code before this change (not re-run here): a 2 MB prompt blocked `/health` "
        "~5 s and a 50 MB one over 90 s, the prompt being tokenised on the event loop before any "
        "length check. On a shared CPU the baseline row is the noise floor.\n\n"
        + markdown_table(header, rows)
        + f"\n\nServer peak RSS (VmHWM): {rss_ready:.0f} MiB once ready, {rss_after:.0f} MiB "
        "after all of the above. The token-id row is the worst case the body limit allows: "
        "its JSON is decoded and validated off the event loop in pieces that let /health run "
        "(server/body_parsing.py, server/token_ids.py); before that change this row's /health max "
        "was ~590 ms. A deployment with short contexts can lower `--max-request-body-bytes` too."
    )
    print(body)
    command = f"python -m bench.server_input_safety --rounds {args.rounds}"
    write_section("server_input_safety", "Runtime server: oversized input", command, body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
