"""How much one replica serves: the batching capacity model of the simulator.

A replica runs continuous batching. Each engine step decodes one token for every running sequence
and takes `step_base_s + step_per_seq_s x batch` (memory-bound decode: reading the weights costs
the base, each sequence adds its KV reads). A request is admitted when a batch slot is free and the
KV cache has room for its whole context (prompt + output), which is what `kv_cache_usage` reports.
TTFT = time queued + prefill (prompt / prefill rate) + one decode step.

The defaults describe an 8B-class model in bf16 on one 48 GB GPU (about 6 GiB of KV cache at
128 KiB per token). They are assumptions, not measurements: the runtime benchmarks in
docs/benchmarks.md do not publish per-replica figures yet, so pass `--capacity FILE.json` with
measured ones when they exist.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CapacityModel:
    max_num_seqs: int = 64  # batch slots per replica
    kv_cache_tokens: int = 49_152  # tokens of KV cache per replica
    step_base_s: float = 0.030  # decode step time at batch size 0
    step_per_seq_s: float = 0.0006  # extra step time per running sequence
    prefill_tokens_per_s: float = 6_000.0
    cold_start_s: float = 60.0  # pod created -> ready (scheduling, load weights, warm-up)
    gpus_per_replica: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.kv_cache_tokens < 1 or self.gpus_per_replica < 1:
            raise ValueError("max_num_seqs, kv_cache_tokens and gpus_per_replica must be >= 1")
        if self.step_base_s <= 0 or self.step_per_seq_s < 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("step times must be > 0 (per-seq >= 0) and the prefill rate > 0")
        if self.cold_start_s < 0:
            raise ValueError(f"cold_start_s must be >= 0, got {self.cold_start_s}")

    def step_time(self, batch: int) -> float:
        return self.step_base_s + self.step_per_seq_s * batch

    def slots(self, mean_tokens_per_request: float) -> float:
        """Sequences a replica can hold at once for requests of this mean size."""
        if mean_tokens_per_request <= 0:
            raise ValueError("mean tokens per request must be > 0")
        return min(float(self.max_num_seqs), self.kv_cache_tokens / mean_tokens_per_request)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, path: Path) -> CapacityModel:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown capacity fields {unknown}; known: {sorted(known)}")
        return cls(**data)
