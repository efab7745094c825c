"""KV tiers below the pool (engine/kv_offload.py) on the tiny model: greedy tokens are the same
with and without them while blocks really round-trip through host memory and disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.stats import KvOffloadCounts

pytestmark = pytest.mark.slow  # loads the model

GIB = 1 << 30
MAX_MODEL_LEN = 128  # the smallest pool the engine takes: 8 blocks
POOL_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
# tiny-llama's KV per token: 4 layers x K,V x 2 heads x 32 dims
KV_ELEMENTS_PER_BLOCK = 4 * 2 * 2 * 32 * BLOCK_SIZE
ITEMSIZE = {"auto": 4, "fp8": 1}  # the tests pin float32


def documents(num_docs: int, start: int = 100) -> list[list[int]]:
    """Distinct 90-token documents (5 full blocks each); token ids stay in the vocabulary."""
    return [list(range(start + 97 * d, start + 97 * d + 90)) for d in range(num_docs)]


def multi_turn_prompts() -> list[list[int]]:
    """Two questions about each of 6 documents, all the first questions first: 30 blocks of
    prefixes over a pool of 8, so each document is evicted before its second question."""
    docs = documents(6)
    return [[*doc, 5, 6, 7, question] for question in (11, 12) for doc in docs]


def run_one_by_one(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6), str(index))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
        outputs.append(tokens)
    return outputs


def pool_kwargs(kv_cache_dtype: str, num_blocks: int = POOL_BLOCKS) -> dict[str, Any]:
    block_bytes = KV_ELEMENTS_PER_BLOCK * ITEMSIZE[kv_cache_dtype]
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory": num_blocks * block_bytes,
    }


def gib(num_blocks: int, kv_cache_dtype: str) -> float:
    return num_blocks * KV_ELEMENTS_PER_BLOCK * ITEMSIZE[kv_cache_dtype] / GIB


def offload_counts(engine: Engine) -> KvOffloadCounts:
    counts = engine.stats().kv_offload
    assert counts is not None
    return counts


@pytest.fixture(scope="module")
def without_tiers(make_engine: Callable[..., Engine]) -> dict[str, list[list[int]]]:
    """The tokens without tiers. float32 KV: the small pool, which recomputes each evicted
    document. fp8 KV: a pool that holds every document, so that second questions hit the pool:
    a prefill attends to its own chunk's keys before they are stored in fp8 and to cached
    ones after, so with fp8 a cache hit and a recompute differ slightly (a pool hit as much as
    a tier hit), and the tier must match the pool hit."""
    return {
        "auto": run_one_by_one(make_engine(**pool_kwargs("auto")), multi_turn_prompts()),
        "fp8": run_one_by_one(make_engine(**pool_kwargs("fp8", 64)), multi_turn_prompts()),
    }


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_tokens_are_the_same_with_a_host_tier(
    make_engine: Callable[..., Engine],
    without_tiers: dict[str, list[list[int]]],
    kv_cache_dtype: str,
) -> None:
    engine = make_engine(**pool_kwargs(kv_cache_dtype), kv_offloading_size=gib(64, kv_cache_dtype))
    assert run_one_by_one(engine, multi_turn_prompts()) == without_tiers[kv_cache_dtype]
    counts = offload_counts(engine)
    # every second question finds its document's 5 blocks in the host tier
    assert counts.hits["host"] >= 6 * 5
    assert counts.hit_tokens >= 6 * 5 * BLOCK_SIZE
    block_bytes = KV_ELEMENTS_PER_BLOCK * ITEMSIZE[kv_cache_dtype]
    assert counts.bytes["host_to_pool"] == counts.hits["host"] * block_bytes
    assert counts.bytes["pool_to_host"] >= 6 * 5 * block_bytes
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing leaked


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_blocks_round_trip_through_the_disk_tier(
    make_engine: Callable[..., Engine],
    without_tiers: dict[str, list[list[int]]],
    kv_cache_dtype: str,
    tmp_path: Path,
) -> None:
    """A host tier of 2 blocks: the documents' blocks go on to disk and come back from it."""
    engine = make_engine(
        **pool_kwargs(kv_cache_dtype),
        kv_offloading_size=gib(2, kv_cache_dtype),
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=gib(256, kv_cache_dtype),
    )
    try:
        assert run_one_by_one(engine, multi_turn_prompts()) == without_tiers[kv_cache_dtype]
        counts = offload_counts(engine)
        assert counts.hits["disk"] >= 6 * 4
        assert counts.bytes["host_to_disk"] > 0 and counts.bytes["disk_to_host"] > 0
        assert len(list(tmp_path.glob("*.kvblock"))) == counts.blocks["disk"] > 0
    finally:
        engine.shutdown()


def test_a_workload_without_reuse_stops_copying_once_the_host_tier_is_full(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(**pool_kwargs("auto"), kv_offloading_size=gib(4, "auto"))
    prompts = [[*doc, 5] for doc in documents(8, start=1000)]  # 40 distinct blocks
    run_one_by_one(engine, prompts)
    counts = offload_counts(engine)
    block_bytes = KV_ELEMENTS_PER_BLOCK * 4
    assert counts.bytes["pool_to_host"] == 4 * block_bytes  # the room, then nothing
    assert counts.hits["host"] == 0 and counts.blocks["host"] == 4


def test_a_waiting_request_counts_its_tier_lookups_once_when_admitted(
    make_engine: Callable[..., Engine],
) -> None:
    """The second document cannot get its 6 blocks while the first one decodes (a pool of 8),
    so the scheduler looks its prefix up again each step; the tiers count it once, when it is
    admitted, as the token counters (external_prefix_cache_*) are counted."""
    engine = make_engine(**pool_kwargs("auto"), kv_offloading_size=gib(64, "auto"))
    first, second = documents(2, start=2000)
    engine.add_request(first, SamplingParams(temperature=0.0, max_tokens=24), "first")
    engine.add_request(second, SamplingParams(temperature=0.0, max_tokens=4), "second")
    num_steps_waited = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps_waited += engine.stats().num_waiting > 0
    assert num_steps_waited >= 10  # the second was looked up at each of these steps
    counts = offload_counts(engine)
    # each document's first block missed the host tier: one look-up each
    assert (counts.queries["host"], counts.hits["host"]) == (2, 0)
    assert counts.queried_tokens == 2 * 90


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_offloading_size": 0.0}, "kv_offloading_size must be > 0 GiB"),
        ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "native"),
        (
            {"kv_offloading_size": 1.0, "kv_offloading_disk_path": "/tmp/x"},
            "--kv-offloading-disk-path and --kv-offloading-disk-size go together",
        ),
        (
            {"kv_offloading_disk_path": "/tmp/x", "kv_offloading_disk_size": 1.0},
            "give --kv-offloading-size too",
        ),
        (
            {"kv_offloading_size": 1.0, "enable_prefix_caching": False},
            "does not work with --no-prefix-caching",
        ),
        (
            {"kv_offloading_size": 1.0, "tensor_parallel_size": 2},
            "does not work with --tensor-parallel-size > 1",
        ),
    ],
)
def test_kv_offloading_flags_that_cannot_work_are_refused(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **kwargs)


def test_a_host_tier_too_small_for_one_block_is_refused(
    make_engine: Callable[..., Engine],
) -> None:
    with pytest.raises(ValueError, match="holds no KV block of 32768 bytes"):
        make_engine(**pool_kwargs("auto"), kv_offloading_size=1e-6)
