"""`kvpilot bench` against a scripted SSE server (known timings) and against the real runtime."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from kvpilot.runtime.bench import main as bench_main
from kvpilot.runtime.bench.cli import benchmark, parse_args
from kvpilot.runtime.bench.tokens import LocalTokenCounter
from tests.support.server_process import MODEL, TINY, RuntimeServer, free_port

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

FIRST_TOKEN_S = 0.08  # the scripted server's timings, what the bench must measure
TOKEN_GAP_S = 0.02
NUM_TOKENS = 5


class ScriptedOpenAI(BaseHTTPRequestHandler):
    """Streams NUM_TOKENS chunks like OpenAI: TTFT and token gaps fixed by sleeping."""

    protocol_version = "HTTP/1.1"
    requests: ClassVar[list[dict]] = []
    keys: ClassVar[list[str]] = []  # each POST's Authorization header

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:  # /v1/models
        self.send_json(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).requests.append(body)
        type(self).keys.append(self.headers.get("authorization", ""))
        if body.get("max_tokens") == 13:  # the bench's error path
            self.send_json(429, {"error": {"message": "busy", "type": "RateLimitError"}})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        chat = self.path.endswith("/chat/completions")
        time.sleep(FIRST_TOKEN_S)  # the scripted server's latency, not a test wait
        for i in range(NUM_TOKENS):
            if i:
                time.sleep(TOKEN_GAP_S)
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            self.event({"choices": [choice]})
        usage = {"prompt_tokens": 3, "completion_tokens": NUM_TOKENS, "total_tokens": 8}
        self.event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def event(self, payload: dict) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def scripted() -> Iterator[str]:
    ScriptedOpenAI.requests, ScriptedOpenAI.keys = [], []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_bench_measures_scripted_latencies(scripted: str, tmp_path: Path) -> None:
    config = parse_args([
        "--base-url", scripted, "--num-prompts", "12", "--concurrency", "4", "--input-len", "7",
        "--tokenizer", str(TINY),
        "--output-len", "5", "--goodput", "ttft:1000", "tpot:1", "--price-per-gpu-hour", "3.6",
        "--result-json", str(tmp_path / "out.json"), "--plot-dir", str(tmp_path), "--no-progress",
    ])  # fmt: skip
    summary, document = benchmark(config)
    assert summary.completed == 12 and summary.failed == 0
    assert ScriptedOpenAI.requests[0]["model"] == "scripted"  # found through /v1/models
    assert ScriptedOpenAI.requests[0]["stream_options"] == {"include_usage": True}
    assert LocalTokenCounter(TINY).count(ScriptedOpenAI.requests[0]["prompt"], True) == 7
    assert FIRST_TOKEN_S * 1000 <= summary.ttft_ms.median < FIRST_TOKEN_S * 1000 + 150
    assert TOKEN_GAP_S * 1000 <= summary.itl_ms.median < TOKEN_GAP_S * 1000 + 50
    assert TOKEN_GAP_S * 1000 <= summary.tpot_ms.mean < TOKEN_GAP_S * 1000 + 50
    assert summary.total_output_tokens == 12 * NUM_TOKENS and summary.total_input_tokens == 36
    assert summary.request_goodput == 0.0  # no request makes a 1 ms TPOT
    assert summary.cost_per_1k_requests == pytest.approx(
        3.6 * summary.duration_s / 3600 / 12 * 1000
    )
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["summary"]["completed"] == 12 == document["summary"]["completed"]
    for png in ("latency_cdf.png", "throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_open_loop_chat_from_jsonl(scripted: str, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
             {"prompt": "fails", "max_tokens": 13}]  # fmt: skip
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    started = time.perf_counter()
    config = parse_args([
        "--base-url", scripted, "--model", "scripted", "--api", "chat", "--dataset", str(dataset),
        "--num-prompts", "6", "--request-rate", "50", "--burstiness", "2", "--no-progress",
    ])  # fmt: skip
    summary, _ = benchmark(config)
    assert time.perf_counter() - started >= FIRST_TOKEN_S
    assert (summary.completed, summary.failed) == (3, 3)
    assert list(summary.errors.values()) == [3] and "HTTP 429" in next(iter(summary.errors))
    assert ScriptedOpenAI.requests[0]["messages"] == [{"role": "user", "content": "hi"}]


def test_bench_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--goodput", "latency:5"]) == 2
    assert "goodput SLO" in capsys.readouterr().err
    assert bench_main(["--num-prompts", "0"]) == 2


def test_bench_says_which_url_it_cannot_reach(capsys: pytest.CaptureFixture[str]) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert bench_main(["--base-url", nowhere, "--num-prompts", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(
        f"kvpilot bench: cannot reach {nowhere}/v1/models: [Errno 111] Connection refused (is "
        "the server up? --base-url says where it is)"
    )


def test_bench_against_the_runtime_agrees_with_its_histogram(
    server: RuntimeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def ttft() -> tuple[float, float]:
        m = server.metrics()
        return (m["kvpilot_time_to_first_token_seconds_sum"],
                m["kvpilot_time_to_first_token_seconds_count"])  # fmt: skip

    before = ttft()
    out = tmp_path / "bench.json"
    code = bench_main([
        "--base-url", server.url, "--num-prompts", "16", "--concurrency", "4", "--input-len", "32",
        "--tokenizer", str(TINY), "--output-len", "8", "--ignore-eos", "--result-json", str(out),
        "--plot-dir", str(tmp_path), "--no-progress", "--price-per-gpu-hour", "2",
    ])  # fmt: skip
    assert code == 0
    assert "Successful requests" in capsys.readouterr().out
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 16 and summary["total_output_tokens"] == 16 * 8
    after = ttft()
    assert after[1] - before[1] == 16
    server_ms = (after[0] - before[0]) / 16 * 1000
    bench_ms = summary["ttft_ms"]["mean"]
    # the client sees the server's TTFT plus HTTP and tokenisation: a little more, never less
    assert server_ms <= bench_ms + 1.0
    assert bench_ms - server_ms < 50 + 0.5 * bench_ms, (bench_ms, server_ms)
    assert (tmp_path / "latency_cdf.png").exists() and (tmp_path / "throughput.png").exists()


def test_models_endpoint_is_what_bench_discovers(server: RuntimeServer) -> None:
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == MODEL


def bench_prompt_lens(server: RuntimeServer, tmp_path: Path, *flags: str) -> list[int]:
    """Each request's prompt tokens as the runtime's usage reported them."""
    out = tmp_path / "lens.json"
    code = bench_main([
        "--base-url", server.url, "--num-prompts", "6", "--concurrency", "3", "--input-len", "64",
        "--output-len", "2", "--result-json", str(out), "--save-detailed", "--no-progress", *flags,
    ])  # fmt: skip
    assert code == 0
    return [r["prompt_len"] for r in json.loads(out.read_text())["requests"]]


def test_input_len_is_tokens_with_a_local_tokenizer(server: RuntimeServer, tmp_path: Path) -> None:
    assert bench_prompt_lens(server, tmp_path, "--tokenizer", str(TINY)) == [64] * 6


def test_input_len_is_tokens_through_the_servers_tokenize(
    server: RuntimeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --tokenizer the prompts are counted by POST /tokenize (vLLM's shape). A runtime
    that does not answer it yet makes the bench stop and say how to count instead."""
    probe = {"model": MODEL, "prompt": "hello", "add_special_tokens": True}
    answer = httpx.post(f"{server.url}/tokenize", json=probe, timeout=10)
    if answer.status_code == 200:
        assert set(answer.json()) >= {"count", "max_model_len", "tokens"}
        assert bench_prompt_lens(server, tmp_path) == [64] * 6
        return
    assert answer.status_code == 404
    code = bench_main(["--base-url", server.url, "--num-prompts", "1", "--no-progress"])
    assert code == 2
    assert "cannot count tokens; pass --tokenizer" in capsys.readouterr().err


def test_tenants_send_their_own_key_priority_and_shape_and_start_late(
    scripted: str, tmp_path: Path
) -> None:
    out = tmp_path / "tenants.json"
    code = bench_main([
        "--base-url", scripted, "--tokenizer", str(TINY), "--no-progress", "--save-detailed",
        "--result-json", str(out),
        "--tenant", "name=early,key=sk-early,concurrency=2,num-prompts=4,input-len=5,priority=3",
        "--tenant", "name=late,key=sk-late,rate=100,num-prompts=2,input-len=9,delay=0.3",
    ])  # fmt: skip
    assert code == 0
    sent = {(r.get("priority", "absent"), r["max_tokens"]) for r in ScriptedOpenAI.requests}
    assert sent == {(3, 64), ("absent", 64)}
    assert ScriptedOpenAI.keys.count("Bearer sk-early") == 4
    assert ScriptedOpenAI.keys.count("Bearer sk-late") == 2
    document = json.loads(out.read_text())
    late = document["requests"][4:]  # tenants in order (prompt_len is the server's usage, 3)
    assert len(late) == 2 and min(r["start"] for r in late) >= 0.3
    assert min(r["start"] for r in document["requests"][:4]) < 0.3  # not delayed
    tenants = document["tenants"]
    assert tenants["early"]["tokens"] == 4 * (3 + NUM_TOKENS)  # the scripted usage: 3 + 5
    assert tenants["early"]["token_share"] == pytest.approx(4 / 6)
