"""The KV tiers' metrics (server/kv_offload_metrics.py) as /metrics exposes them: vLLM's names
and label values where vLLM has the figure, kvpilot's for every tier, bounded labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.engine.stats import (
    KV_OFFLOAD_TIERS,
    KV_OFFLOAD_TRANSFERS,
    EngineStats,
    KvOffloadCounts,
)
from kvpilot.runtime.server.metrics import ServerMetrics


def samples(stats: EngineStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = ServerMetrics("tiny", lambda: stats).render().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_without_tiers_no_kv_offload_metric_is_exposed() -> None:
    names = {name for name, _ in samples(EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0))}
    assert not [n for n in names if "offload" in n or "external_prefix" in n]


def test_each_tier_and_transfer_under_kvpilot_and_vllm_names() -> None:
    counts = KvOffloadCounts(queried_tokens=320, hit_tokens=160, capacity={"host": 64})
    counts.hits["disk"], counts.queries["disk"], counts.blocks["host"] = 3, 7, 9
    counts.bytes.update(pool_to_host=100, host_to_pool=200, host_to_disk=300, disk_to_host=400)
    counts.seconds["host_to_pool"] = 0.5
    got = samples(EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, kv_offload=counts))
    for prefix in ("kvpilot_", "vllm:"):
        assert got[(f"{prefix}external_prefix_cache_queries_total", ())] == 320
        assert got[(f"{prefix}external_prefix_cache_hits_total", ())] == 160
    assert got[("kvpilot_kv_offload_hits_total", (("tier", "disk"),))] == 3
    assert got[("kvpilot_kv_offload_queries_total", (("tier", "disk"),))] == 7
    assert got[("kvpilot_kv_offload_blocks", (("tier", "host"),))] == 9
    capacity = {labels: v for (name, labels), v in got.items() if "capacity" in name}
    assert capacity == {(("tier", "host"),): 64}  # no disk tier configured: no disk sample
    assert got[("kvpilot_kv_offload_bytes_total", (("transfer_type", "disk_to_host"),))] == 400
    vllm_bytes = {
        labels: value for (name, labels), value in got.items()
        if name == "vllm:kv_offload_total_bytes_total"
    }  # fmt: skip
    assert vllm_bytes == {
        (("transfer_type", "GPU_to_CPU"),): 100,
        (("transfer_type", "CPU_to_GPU"),): 200,
    }
    assert got[("vllm:kv_offload_total_time_total", (("transfer_type", "CPU_to_GPU"),))] == 0.5
    tiers = {
        dict(labels)["tier"] for name, labels in got if name.startswith("kvpilot_kv_offload_hits")
    }
    transfers = {
        dict(labels)["transfer_type"] for name, labels in got
        if name.startswith("kvpilot_kv_offload_bytes")
    }  # fmt: skip
    assert tiers == set(KV_OFFLOAD_TIERS) and transfers == set(KV_OFFLOAD_TRANSFERS)
