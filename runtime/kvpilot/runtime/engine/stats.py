"""What the engine reports about itself between steps: read by the metrics collector at scrape
time and by the step listeners, without importing the engine (and torch) to do so."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a running sequence was preempted (the `reason` label of kvpilot_preemptions_by_reason):
# the KV pool had no block for a running sequence's next tokens, or a waiting request of a
# better priority needed its seat, blocks or step budget (--scheduling-policy priority).
PREEMPTED_FOR_KV_CACHE = "kv_cache"
PREEMPTED_FOR_PRIORITY = "priority"
PREEMPTION_REASONS = (PREEMPTED_FOR_KV_CACHE, PREEMPTED_FOR_PRIORITY)


@dataclass
class SpecDecodeCounts:
    """Speculative decoding so far, as vLLM counts it: steps in which a sequence proposed,
    the tokens proposed, and those the model accepted (cumulative)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # used blocks / total, 0..1
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int  # cumulative, every reason
    num_step_tokens: int = 0  # tokens the last step ran through the model (prefill + decode)
    # speculative decoding, cumulative (SpecDecodeCounts)
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    # LoRA, as vLLM's vllm:lora_requests_info reports it: the adapters of the running and of the
    # waiting sequences (names, sorted), and --max-loras (0: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # adapters written into a LoRA slot, and those of them written over another resident
    # adapter (engine/lora_slots.py), cumulative
    lora_loads: int = 0
    lora_evictions: int = 0
    # the adapters registered (loaded, servable), sorted: kvpilot_lora_adapter_loaded
    loaded_lora_adapters: tuple[str, ...] = ()
    kv_offload: KvOffloadCounts | None = None  # None: no KV tiers (--kv-offloading-size)
    # cumulative, by reason (PREEMPTION_REASONS); they add up to num_preemptions
    preemptions_by_reason: tuple[tuple[str, int], ...] = ()

    @classmethod
    def idle(cls) -> EngineStats:
        """The figures of a server whose engine is not loaded yet: nothing queued, no pool."""
        return cls(0, 0, 0, 0, 0.0, 0, 0, 0)


KV_OFFLOAD_TIERS = ("host", "disk")
# pool_to_host and host_to_pool are vLLM's GPU_to_CPU and CPU_to_GPU (metrics name both)
KV_OFFLOAD_TRANSFERS = ("pool_to_host", "host_to_pool", "host_to_disk", "disk_to_host")


@dataclass
class KvOffloadCounts:
    """The KV tiers so far (engine/kv_offload.py), cumulative but for `blocks`: per tier the
    block lookups (`queries`), those it answered (`hits`) and the blocks it holds now; per
    transfer the bytes copied and the seconds the copies took. The step thread writes all but
    the host_to_disk figures, which the disk tier's writer thread writes."""

    queries: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_OFFLOAD_TIERS, 0))
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_OFFLOAD_TIERS, 0))
    blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_OFFLOAD_TIERS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_OFFLOAD_TRANSFERS, 0))
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(KV_OFFLOAD_TRANSFERS, 0.0)
    )
    # Prompt tokens looked up in the tiers after the pool missed them, and those served
    # (vLLM's external_prefix_cache_queries and _hits)
    queried_tokens: int = 0
    hit_tokens: int = 0
    # Blocks each configured tier can hold (no key: the tier is off), set once at start
    capacity: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> KvOffloadCounts:
        return KvOffloadCounts(
            dict(self.queries), dict(self.hits), dict(self.blocks), dict(self.bytes),
            dict(self.seconds), self.queried_tokens, self.hit_tokens, dict(self.capacity),
        )  # fmt: skip
