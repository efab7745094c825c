"""The engine's one frozen configuration, built at the edge (CLI flags or a test).

Each field's metadata carries its command-line help (and choices), so `kvpilot-runtime serve`'s
parser is derived from these fields (contract/serve_config.py) and a field cannot exist without a
flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract.checkpoint_quant import CHECKPOINT_KINDS
from kvpilot.contract.speculative_config import SpeculativeConfig
from kvpilot.contract.speculative_config import parse_config as parse_speculative_config

QUANTIZATION_CHOICES = ("none", "bf16", "int8", "int4")
INT8_KERNEL_CHOICES = ("auto", "w8a16", "w8a8")  # layers/quant.py says what each runs
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp8")
KV_OFFLOADING_BACKEND_CHOICES = ("native",)  # vLLM's flag; its lmcache backend is not built in
# runtime/engine/waiting_queue.py: vLLM's two policies, lower `priority` first under priority
SCHEDULING_POLICY_CHOICES = ("fcfs", "priority")
ATTENTION_BACKEND_CHOICES = (
    "auto",
    "paged",
    "flashinfer",
    "sdpa",
)  # layers/attention.py says what each runs


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, **extra: Any) -> Any:
    """A config field that is also a command-line flag (`--field-name`); `extra` goes to the
    flag's metadata (`group` for mutually exclusive flags, `negate` for a `--no-…` switch)."""
    return field(default=default, metadata={"help": help, "choices": choices, **extra})


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata={"help": "local path to an HF-format checkpoint directory"})
    served_name: str | None = option(None, "model id clients send (default: the model's name)")
    quantization: str = option("none", "weight quantisation", QUANTIZATION_CHOICES)
    expect_checkpoint: str | None = option(
        None,
        "refuse to start unless the checkpoint's weights are stored this way (16-bit: no "
        "quantization_config in config.json); the operator passes it where it planned from a "
        "config.json it was given rather than read at the source (spec.model.configMapRef)",
        CHECKPOINT_KINDS,
    )
    int8_kernel: str = option(
        "auto",
        "the int8 level's matmul: w8a8 quantises each activation row to int8 too (torch._int_mm,"
        " CPU), w8a16 keeps bf16 activations (aten._weight_int8pack_mm); auto: w8a8 on CPUs with"
        " int8 dot products (VNNI, AMX), w8a16 elsewhere",
        INT8_KERNEL_CHOICES,
    )
    dtype: str = option(
        "auto",
        "auto: config.json dtype on CUDA; on CPU bfloat16 for a 16-bit checkpoint where the CPU "
        "has bf16 units (AVX512-BF16, AMX), float32 otherwise",
        DTYPE_CHOICES,
    )
    device: str = option("auto", "auto, cpu, cuda, cuda:N (auto: cuda if available)")
    max_model_len: int | None = option(None, "default: the model's max_position_embeddings")
    max_num_seqs: int = option(64, "sequences in the running batch")
    max_num_batched_tokens: int = option(2048, "token budget of one engine step")
    scheduling_policy: str = option(
        "fcfs",
        "fcfs: first come, first served (a request's priority must be 0); priority: by the "
        "request's `priority` (lower first), then arrival, and a waiting request preempts "
        "running ones of a worse priority when the batch, the KV pool or the step is full",
        SCHEDULING_POLICY_CHOICES,
    )
    gpu_memory_utilization: float = option(
        0.9,
        "fraction of the device's memory for weights + KV cache (on CPU: of the memory this "
        "process may use, its cgroup limit or MemAvailable; the pool stays within what "
        "max_num_seqs sequences of max_model_len tokens can fill)",
        group="memory",
    )
    kv_cache_memory: int | None = option(
        None, "KV-cache pool size in bytes (overrides --gpu-memory-utilization)", group="memory"
    )
    enable_prefix_caching: bool = option(
        True, "reuse KV blocks of shared prompt prefixes", negate="--no-prefix-caching"
    )
    seed: int = option(0, "sampling seed")
    tensor_parallel_size: int = option(1, "ranks, one process each (gloo on CPU, NCCL on CUDA)")
    kv_cache_dtype: str = option(
        "auto", "auto: the model dtype; fp8: float8_e4m3fn with a scale", KV_CACHE_DTYPE_CHOICES
    )
    attention_backend: str = option(
        "auto",
        "attention: paged reads each sequence's blocks in place from the KV cache (a C++ "
        "kernel built once per machine, CPU, decodes); flashinfer reads them in place through "
        "FlashInfer's kernels (CUDA, flashinfer-python installed); sdpa copies them out, then "
        "runs torch SDPA; auto: paged on CPU, flashinfer on CUDA, where it can run and the KV "
        "cache is in the model dtype, sdpa elsewhere",
        ATTENTION_BACKEND_CHOICES,
    )
    enforce_eager: bool = option(
        False,
        "run every decode step eagerly (vLLM's flag); without it, on one CUDA GPU, decode steps "
        "of up to --max-num-seqs rows replay CUDA graphs captured at start-up per batch-size "
        "bucket (1, 2, 4, 8, 16, 24, ...); on CPU and under tensor parallelism decode is eager",
        affirm="--enforce-eager",
    )
    speculative_config: str | None = option(
        None,
        'speculative decoding as JSON, as vLLM takes it: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4} (prompt lookup) or {"method": '
        '"draft_model", "model": DIR, "num_speculative_tokens": 4} (a small model with the same '
        "tokenizer); requests without a grammar or a seed propose",
    )
    enable_lora: bool = option(
        False,
        "serve LoRA adapters (PEFT format) on top of the model: requests name one as their "
        "model; --lora-modules at start, /v1/load_lora_adapter at run time",
        affirm="--enable-lora",
    )
    max_loras: int = option(1, "LoRA adapters resident for batching: one step runs up to this many")
    max_lora_rank: int = option(16, "largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(
        None,
        "LoRA adapters kept in host memory, least recently used evicted (reloaded from disk on "
        "demand); default: --max-loras",
    )

    kv_offloading_size: float | None = option(
        None,
        "GiB of host memory for KV blocks evicted from the pool (vLLM's flag): a later prefix "
        "hit copies them back instead of recomputing them; default: no host tier",
    )
    kv_offloading_backend: str = option(
        "native",
        "how KV blocks are offloaded (vLLM's flag): native only",
        KV_OFFLOADING_BACKEND_CHOICES,
    )
    kv_offloading_disk_path: str | None = option(
        None,
        "directory for KV blocks the host tier evicts, one file each; a restart with the same "
        "directory starts with them (needs --kv-offloading-size and --kv-offloading-disk-size)",
    )
    kv_offloading_disk_size: float | None = option(
        None, "GiB of block files the disk tier keeps (with --kv-offloading-disk-path)"
    )

    def __post_init__(self) -> None:
        _check_choice("quantization", self.quantization, QUANTIZATION_CHOICES)
        _check_choice("int8_kernel", self.int8_kernel, INT8_KERNEL_CHOICES)
        if self.expect_checkpoint is not None:
            _check_choice("expect_checkpoint", self.expect_checkpoint, CHECKPOINT_KINDS)
        _check_choice("dtype", self.dtype, DTYPE_CHOICES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKEND_CHOICES)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICY_CHOICES)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.device not in DEVICE_CHOICES and not self.device.startswith("cuda:"):
            raise ValueError(
                f"device must be one of {DEVICE_CHOICES} or cuda:N, got {self.device!r}"
            )
        if not self.model:
            raise ValueError("model must be a path to a model directory, got ''")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        self._check_lora()
        spec = self.speculative()  # a bad --speculative-config fails here, before anything loads
        self._check_kv_offloading(spec)

    def _check_kv_offloading(self, spec: SpeculativeConfig | None) -> None:
        _check_choice(
            "kv_offloading_backend", self.kv_offloading_backend, KV_OFFLOADING_BACKEND_CHOICES
        )
        for name in ("kv_offloading_size", "kv_offloading_disk_size"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 GiB, got {value}")
        has_path = self.kv_offloading_disk_path is not None
        if has_path != (self.kv_offloading_disk_size is not None):
            raise ValueError(
                "--kv-offloading-disk-path and --kv-offloading-disk-size go together: give both"
            )
        if self.kv_offloading_size is None:
            if has_path:
                raise ValueError(
                    "the disk tier keeps what the host tier evicts: give --kv-offloading-size too"
                )
            return
        reason = _kv_offloading_conflict(self, spec)
        if reason is not None:
            raise ValueError(f"--kv-offloading-size does not work with {reason}; drop one of them")

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in host memory: --max-cpu-loras, or --max-loras when not given."""
        return self.max_cpu_loras or self.max_loras

    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed; None when speculative decoding is off."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)


def _kv_offloading_conflict(config: EngineConfig, spec: SpeculativeConfig | None) -> str | None:
    """What the KV tiers cannot serve yet, if the config asks for it."""
    if not config.enable_prefix_caching:
        return "--no-prefix-caching (the tiers hold prefix-cache blocks)"
    if config.tensor_parallel_size > 1:
        return "--tensor-parallel-size > 1 (the other ranks' KV shards are not copied)"
    if spec is not None and spec.model is not None:
        return "a draft model (its own KV cache is not copied)"
    return None


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
