"""The disk KV tier across a restart: a runtime started again on the same directory serves a
prefix from the files the first one wrote (the official openai client, real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from kvpilot.contract.memory import BLOCK_SIZE
from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes

GIB = 1 << 30
BLOCK_BYTES = 4 * 2 * 2 * 32 * BLOCK_SIZE * 4  # tiny-llama, float32 KV: layers x K,V x heads x dim
DOCS = [list(range(100 + 97 * d, 100 + 97 * d + 90)) for d in range(6)]  # 5 full blocks each


def tier_args(directory: Path) -> list[str]:
    """A pool of 8 blocks and a host tier of 2: the documents' blocks end up in files."""
    return [
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
        "--kv-cache-memory", str(8 * BLOCK_BYTES),
        "--kv-offloading-size", str(2 * BLOCK_BYTES / GIB),
        "--kv-offloading-disk-path", str(directory),
        "--kv-offloading-disk-size", str(256 * BLOCK_BYTES / GIB),
    ]  # fmt: skip


def greedy(server: RuntimeServer, prompt: list[int]) -> list[str]:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=0
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return logprobs.tokens


def test_a_restarted_runtime_serves_a_prefix_from_its_disk_tier(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    first = RuntimeServer(tier_args(directory), tmp_path / "first.log")
    try:
        answers = [greedy(first, [*doc, 5, 6, 7]) for doc in DOCS]
    finally:
        assert first.stop() == 0  # writes the host tier's blocks and the queue to disk
    second = RuntimeServer(tier_args(directory), tmp_path / "second.log")
    try:
        # indexed at start: the blocks the first run's pool let go (at least 4 documents')
        started = second.metrics()
        assert started["kvpilot_kv_offload_blocks[('tier', 'disk')]"] >= 20
        assert started["kvpilot_kv_offload_capacity_blocks[('tier', 'host')]"] == 2
        assert started["kvpilot_kv_offload_capacity_blocks[('tier', 'disk')]"] == 256
        assert greedy(second, [*DOCS[0], 5, 6, 7]) == answers[0]
        metrics = second.metrics()
        assert metrics["kvpilot_kv_offload_hits_total[('tier', 'disk')]"] == 5
        assert metrics["vllm:external_prefix_cache_hits_total"] == 5 * BLOCK_SIZE
        assert metrics["vllm:prefix_cache_hits_total"] == 0  # nothing came from the pool
        assert metrics["kvpilot_kv_offload_bytes_total[('transfer_type', 'disk_to_host')]"] > 0
        assert metrics["vllm:kv_offload_total_bytes_total[('transfer_type', 'CPU_to_GPU')]"] > 0
    finally:
        assert second.stop() == 0
