"""The KV tiers' metrics (engine/kv_offload.py), read from the engine's stats at scrape time.

vLLM's names where vLLM has the figure: `vllm:external_prefix_cache_queries` / `_hits` (prompt
tokens looked up in, and served from, the tiers below the pool) and `vllm:kv_offload_total_bytes`
/ `vllm:kv_offload_total_time` for the copies between the pool and host memory, labelled as vLLM
labels them (transfer_type GPU_to_CPU, CPU_to_GPU: the pool is vLLM's "GPU" medium, on a CPU
too). kvpilot's own names cover every tier and transfer with bounded labels: `tier` is host or
disk, `transfer_type` one of stats.KV_OFFLOAD_TRANSFERS.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpilot.runtime.engine.stats import KvOffloadCounts

LABEL = "model_name"
VLLM_TRANSFERS = {"pool_to_host": "GPU_to_CPU", "host_to_pool": "CPU_to_GPU"}


def kv_offload_families(
    model_name: str, counts: KvOffloadCounts
) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    for prefix in ("kvpilot_", "vllm:"):
        queries = CounterMetricFamily(
            f"{prefix}external_prefix_cache_queries",
            "Prompt tokens looked up in the KV tiers below the pool (after a pool miss).",
            labels=[LABEL],
        )
        queries.add_metric([model_name], counts.queried_tokens)
        hits = CounterMetricFamily(
            f"{prefix}external_prefix_cache_hits",
            "Prompt tokens served from the KV tiers below the pool.",
            labels=[LABEL],
        )
        hits.add_metric([model_name], counts.hit_tokens)
        yield from (queries, hits)
    yield from _per_tier(model_name, counts)
    yield from _transfers(model_name, counts)


def _per_tier(
    model_name: str, counts: KvOffloadCounts
) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    families: list[tuple[CounterMetricFamily | GaugeMetricFamily, dict[str, int]]] = [
        (CounterMetricFamily("kvpilot_kv_offload_queries",
                             "Block lookups per KV tier (once per admitted request).",
                             labels=[LABEL, "tier"]), counts.queries),
        (CounterMetricFamily("kvpilot_kv_offload_hits", "Block lookups a KV tier answered.",
                             labels=[LABEL, "tier"]), counts.hits),
        (GaugeMetricFamily("kvpilot_kv_offload_blocks", "Blocks a KV tier holds.",
                           labels=[LABEL, "tier"]), counts.blocks),
        (GaugeMetricFamily("kvpilot_kv_offload_capacity_blocks",
                           "Blocks a configured KV tier can hold (no sample: the tier is off).",
                           labels=[LABEL, "tier"]), counts.capacity),
    ]  # fmt: skip
    for family, values in families:
        for tier, value in values.items():
            family.add_metric([model_name, tier], value)
        yield family


def _transfers(model_name: str, counts: KvOffloadCounts) -> Iterable[CounterMetricFamily]:
    labels = [LABEL, "transfer_type"]
    moved = CounterMetricFamily(
        "kvpilot_kv_offload_bytes", "KV bytes copied between tiers.", labels=labels
    )
    took = CounterMetricFamily(
        "kvpilot_kv_offload_seconds", "Time the KV copies between tiers took.", labels=labels
    )
    vllm_moved = CounterMetricFamily(
        "vllm:kv_offload_total_bytes",
        "KV bytes copied between the pool and host memory.",
        labels=labels,
    )
    vllm_took = CounterMetricFamily(
        "vllm:kv_offload_total_time", "Seconds the pool <-> host KV copies took.", labels=labels
    )
    for transfer, value in counts.bytes.items():
        moved.add_metric([model_name, transfer], value)
        took.add_metric([model_name, transfer], counts.seconds[transfer])
        if transfer in VLLM_TRANSFERS:
            vllm_moved.add_metric([model_name, VLLM_TRANSFERS[transfer]], value)
            vllm_took.add_metric([model_name, VLLM_TRANSFERS[transfer]], counts.seconds[transfer])
    yield from (moved, took, vllm_moved, vllm_took)
