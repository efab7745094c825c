"""One streamed request against an OpenAI-compatible endpoint, timed as vLLM's benchmark does."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from .stats import RequestResult
from .workload import BenchRequest


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    chat: bool = False
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False  # vLLM extension; OpenAI's own API rejects it, so off by default
    priority: int | None = None  # vLLM's `priority` (lower first); None: not sent

    def url(self) -> str:
        root = self.base_url.rstrip("/")
        root = root if root.endswith("/v1") else f"{root}/v1"
        return f"{root}/chat/completions" if self.chat else f"{root}/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body["messages" if self.chat else "prompt"] = request.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.priority is not None:
            body["priority"] = self.priority
        return body


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


class _Timer:
    """Accumulates chunk arrival times into a RequestResult."""

    def __init__(self, result: RequestResult, t0: float):
        self.result, self.t0, self.last = result, t0, t0
        self.num_chunks = 0

    def on_text(self, now: float) -> None:
        if self.num_chunks == 0:
            self.result.ttft = now - self.t0
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    def on_usage(self, usage: dict[str, Any]) -> None:
        self.result.output_len = int(usage.get("completion_tokens") or 0)
        self.result.prompt_len = int(usage.get("prompt_tokens") or self.result.prompt_len)


async def send(
    client: httpx.AsyncClient, endpoint: Endpoint, request: BenchRequest, bench_start: float
) -> RequestResult:
    t0 = time.perf_counter()
    result = RequestResult(success=False, start=t0 - bench_start, prompt_len=request.prompt_len)
    timer = _Timer(result, t0)
    try:
        async with client.stream(
            "POST", endpoint.url(), json=endpoint.payload(request), headers=endpoint.headers()
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            await _read_events(response, timer, endpoint.chat)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - t0
    if timer.num_chunks == 0:
        result.error = "stream ended without any text"
        return result
    result.output_len = result.output_len or timer.num_chunks  # servers without usage: ~1/chunk
    result.success = True
    return result


async def _read_events(response: httpx.Response, timer: _Timer, chat: bool) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"server error in stream: {chunk['error']}")
        if chunk_text(chunk, chat):
            timer.on_text(time.perf_counter())
        if chunk.get("usage"):
            timer.on_usage(chunk["usage"])
    raise ValueError("stream closed before data: [DONE]")
