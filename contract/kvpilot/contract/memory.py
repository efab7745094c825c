"""Memory arithmetic shared by the operator's planner and the runtime's KV-cache sizing.

DESIGN.md §3.3. Pure functions on plain numbers, no torch, so the operator can import it.

    weights  = parameters x bytes_per_param(q)        bf16 2, int8 1, int4 0.5 + group scale/zero
               (a pre-quantised checkpoint: its quantised modules as stored, the rest at 16 bits)
    kv_cache = 2 x layers x kv_heads x head_dim x kv_bytes x tokens x concurrent_sequences
    per GPU  = (weights + kv_cache) / tensor_parallel + overhead
    fits     = per GPU <= gpu_memory x gpu_memory_utilization
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3
BLOCK_SIZE = 16  # tokens per KV-cache block, runtime and planner alike

QUANTIZATIONS = ("bf16", "int8", "int4")
INT4_GROUP_SIZE = 128
SCALE_BYTES = 2  # one bf16 scale per output channel (int8), a scale and a zero per group (int4)

# Bytes per parameter of the stored weights. int4 packs two values per byte and adds a 16-bit
# scale and a 16-bit zero per group of 128 (the int4 kernels' layout), so 0.5 + 4/128.
_BYTES_PER_PARAM = {
    "none": 2.0,  # unquantised, at the checkpoint's 16-bit dtype
    "bf16": 2.0,
    "fp16": 2.0,
    "fp32": 4.0,
    "int8": 1.0,
    "int4": 0.5 + 2 * SCALE_BYTES / INT4_GROUP_SIZE,
}
_KV_BYTES = {"auto": 2, "fp16": 2, "bf16": 2, "fp8": 1, "fp32": 4}

# The runtime loads a draft model (speculative decoding) unquantised, at the serving dtype.
DRAFT_QUANTIZATION = "bf16"

# Fixed cost per GPU process that is neither weights nor KV cache: CUDA context, allocator
# fragmentation, cuBLAS workspaces and CUDA graphs. Activations scale with the weights.
OVERHEAD_BASE_BYTES = 1 * GIB
OVERHEAD_ACTIVATION_FRACTION = 0.05


@dataclass(frozen=True)
class CheckpointWeights:
    """A pre-quantised checkpoint's weights as the runtime holds them (checkpoint_weights.py
    reads them from config.json's quantization_config): its quantised linear modules at their
    stored bits with the engine's group scales and zeros, everything else (embeddings, norms,
    modules the quantiser left out) at 16 bits. The checkpoint fixes the level."""

    level: str  # the --quantization it runs with: int4, int8, or none (fp8, dequantised at load)
    description: str  # e.g. "awq int4 (awq-gemm, group 128)"
    kind: str  # its method and stored format (checkpoint_quant.CHECKPOINT_KINDS), e.g. awq-int4
    quantized_parameters: int
    quantized_bytes: float
    # The tensor-parallel degrees the runtime splits it into: a rank's share of each
    # row-parallel module's input whole groups (checkpoint_quant.check_prequantized_parallel)
    tensor_parallel_sizes: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class ModelFacts:
    """The architecture numbers the arithmetic needs (from a spec, a catalog, or config.json)."""

    parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int = 0
    # The projections' widths, which LoRA slots are sized by; 0: not known (lora_dims estimates)
    hidden_size: int = 0
    intermediate_size: int = 0
    attention_heads: int = 0
    # None: a 16-bit checkpoint, which the runtime quantises itself to the planned level
    checkpoint: CheckpointWeights | None = None

    def __post_init__(self) -> None:
        for name in ("parameters", "layers", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model fact {name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU for one replica, and whether they fit the usable share of a GPU."""

    weights_bytes: float
    kv_cache_bytes: float
    overhead_bytes: float
    usable_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    def describe(self) -> str:
        """E.g. '17.9 GiB per GPU (weights 3.8 + KV 12.0 + overhead 2.1) > 14.4 GiB usable'."""
        relation = "<=" if self.fits else ">"
        return (
            f"{gib(self.total_bytes):.1f} GiB per GPU (weights {gib(self.weights_bytes):.1f}"
            f" + KV {gib(self.kv_cache_bytes):.1f} + overhead {gib(self.overhead_bytes):.1f})"
            f" {relation} {gib(self.usable_bytes):.1f} GiB usable"
        )


def gib(num_bytes: float) -> float:
    return num_bytes / GIB


def bytes_per_param(quantization: str) -> float:
    if quantization not in _BYTES_PER_PARAM:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected one of {sorted(_BYTES_PER_PARAM)}"
        )
    return _BYTES_PER_PARAM[quantization]


def kv_dtype_bytes(kv_cache_dtype: str) -> int:
    if kv_cache_dtype not in _KV_BYTES:
        raise ValueError(
            f"unknown kvCacheDtype {kv_cache_dtype!r}; expected one of {sorted(_KV_BYTES)}"
        )
    return _KV_BYTES[kv_cache_dtype]


def weight_bytes(parameters: int, quantization: str) -> float:
    return parameters * bytes_per_param(quantization)


def model_weight_bytes(model: ModelFacts, quantization: str) -> float:
    """The model's weights at `quantization`; a pre-quantised checkpoint at its own level only,
    its quantised modules as stored and the rest at 16 bits."""
    checkpoint = model.checkpoint
    if checkpoint is None:
        return weight_bytes(model.parameters, quantization)
    if quantization != checkpoint.level:
        raise ValueError(
            f"a pre-quantised checkpoint ({checkpoint.description}) runs at its own level"
            f" {checkpoint.level}, not {quantization}"
        )
    rest = model.parameters - checkpoint.quantized_parameters
    return checkpoint.quantized_bytes + weight_bytes(rest, "bf16")


def kv_bytes_per_token(model: ModelFacts, kv_bytes: int) -> int:
    """Key and value vectors of one token across all layers: 2 x layers x kv_heads x head_dim."""
    return 2 * model.layers * model.kv_heads * model.head_dim * kv_bytes


def kv_cache_bytes(model: ModelFacts, kv_bytes: int, tokens: int, sequences: int) -> int:
    return kv_bytes_per_token(model, kv_bytes) * tokens * sequences


def overhead_bytes(weights_per_gpu: float) -> float:
    return OVERHEAD_BASE_BYTES + OVERHEAD_ACTIVATION_FRACTION * weights_per_gpu


# A Llama-family decoder layer holds ~12 h^2 parameters (attention 4 h^2, MLP 3 x h x 8/3 h), and
# its MLP is ~3.5 h wide (Llama 3); used only when a model's config.json widths are not known.
PARAMS_PER_LAYER_PER_HIDDEN_SQUARED = 12
MLP_WIDTH_PER_HIDDEN = 3.5


def lora_dims(model: ModelFacts) -> tuple[int, int, int, int]:
    """(hidden, query width, key/value width, MLP width) of the model's projections; estimated
    from the parameter count (embeddings included: an overestimate) where not known."""
    hidden = model.hidden_size or math.isqrt(
        model.parameters // (PARAMS_PER_LAYER_PER_HIDDEN_SQUARED * model.layers)
    )
    query = model.attention_heads * model.head_dim if model.attention_heads else hidden
    inter = model.intermediate_size or math.ceil(MLP_WIDTH_PER_HIDDEN * hidden)
    return hidden, query, model.kv_heads * model.head_dim, inter


def lora_slot_bytes(model: ModelFacts, num_slots: int, max_rank: int, dtype_bytes: int = 2) -> int:
    """What the runtime allocates for `num_slots` adapters of rank up to `max_rank` (--max-loras,
    --max-lora-rank) in every layer, for all seven projections whether an adapter targets them
    or not: per fused projection of k sub-modules A [in, k x R] (one shared input) and B R x out
    (each sub-module's own [R, out_j], no block-diagonal zeros; layers/lora.py), so per layer
    R x (7 h + 2 q + 2 kv + 3 i) values: qkv R(3h + q + 2kv), o R(q + h), gate_up 2R(h + i),
    down R(i + h)."""
    hidden, query, kv, inter = lora_dims(model)
    per_rank = 7 * hidden + 2 * query + 2 * kv + 3 * inter
    return num_slots * max_rank * per_rank * model.layers * dtype_bytes


def draft_kv_share(model: ModelFacts, draft: ModelFacts | None, kv_bytes: int) -> float:
    """What a draft model's KV cache adds to each block of the served model's: the draft has as
    many blocks (it reads the same block tables), each this share of a served block's bytes."""
    if draft is None:
        return 0.0
    return kv_bytes_per_token(draft, kv_bytes) / kv_bytes_per_token(model, kv_bytes)


def estimate(
    model: ModelFacts,
    quantization: str,
    kv_bytes: int,
    tokens: int,
    sequences: int,
    tensor_parallel: int,
    gpu_memory_bytes: float,
    gpu_memory_utilization: float,
    draft: ModelFacts | None = None,
    lora_bytes: float = 0.0,
) -> MemoryEstimate:
    """Per-GPU memory of one replica holding `sequences` sequences of `tokens` tokens each;
    with a draft model (speculative decoding), its weights unquantised and its KV cache too, all
    on GPU 0 (rank 0 runs the draft whole), which this estimates: the fullest GPU. `lora_bytes`
    (lora_slot_bytes) count as weights, as the runtime counts them when it sizes its KV pool."""
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    weights = model_weight_bytes(model, quantization) / tensor_parallel + lora_bytes
    kv = kv_cache_bytes(model, kv_bytes, tokens, sequences) / tensor_parallel
    if draft is not None:
        weights += weight_bytes(draft.parameters, DRAFT_QUANTIZATION)
        kv *= 1 + tensor_parallel * draft_kv_share(model, draft, kv_bytes)
    return MemoryEstimate(
        weights_bytes=weights,
        kv_cache_bytes=kv,
        overhead_bytes=overhead_bytes(weights),
        usable_bytes=gpu_memory_bytes * gpu_memory_utilization,
    )


def max_concurrency(
    model: ModelFacts,
    kv_bytes: int,
    tokens: int,
    kv_budget_bytes: float,
    tensor_parallel: int = 1,
    draft: ModelFacts | None = None,
) -> int:
    """How many sequences of `tokens` tokens fit in a per-GPU KV budget (block-rounded), a
    draft model's whole KV cache beside GPU 0's share of the served model's."""
    blocks_per_seq = math.ceil(tokens / BLOCK_SIZE)
    share = tensor_parallel * draft_kv_share(model, draft, kv_bytes)
    budget = kv_budget_bytes * tensor_parallel / (1 + share)
    return num_kv_blocks(model, kv_bytes, budget) // blocks_per_seq


def num_kv_blocks(model: ModelFacts, kv_bytes: int, kv_budget_bytes: float) -> int:
    """Blocks of BLOCK_SIZE tokens that fit in a KV budget; the runtime sizes its pool with this."""
    if kv_budget_bytes < 0:
        raise ValueError(f"KV-cache budget must be >= 0 bytes, got {kv_budget_bytes}")
    return int(kv_budget_bytes // (kv_bytes_per_token(model, kv_bytes) * BLOCK_SIZE))


def kv_budget_bytes(
    gpu_memory_bytes: float, gpu_memory_utilization: float, weights_per_gpu: float
) -> float:
    """What is left for the KV cache once weights and overhead are placed on a GPU."""
    usable = gpu_memory_bytes * gpu_memory_utilization
    return max(0.0, usable - weights_per_gpu - overhead_bytes(weights_per_gpu))


def kv_cache_memory_error(
    requested: float, capacity: float, weights: float, where: str
) -> str | None:
    """Why a --kv-cache-memory of `requested` bytes can never be allocated beside `weights` in
    `capacity` bytes (`where`: a GPU's memory, or what a host process may use), or None. Only
    what cannot fit is refused: the overhead the automatic budget reserves (activations, the
    CUDA context) is the user's call once they size the pool themselves."""
    room = capacity - weights
    if requested <= room:
        return None
    return (
        f"--kv-cache-memory {gib(requested):.2f} GiB cannot fit: {where} is "
        f"{gib(capacity):.2f} GiB, {gib(weights):.2f} GiB of it the weights; pass at most "
        f"{gib(max(room, 0.0)):.2f} GiB ({int(max(room, 0.0))} bytes), or leave it out to size "
        "the pool from --gpu-memory-utilization"
    )


def host_kv_budget_bytes(
    usable_memory_bytes: float, memory_utilization: float, weights_bytes: float, demand_bytes: float
) -> float:
    """The KV budget on a CPU host: as on a GPU (`kv_budget_bytes` of the memory the process
    may use: its cgroup limit or the host's available memory), but no more than `demand_bytes`,
    what max_num_seqs sequences of max_model_len tokens can fill. A GPU's memory is the
    replica's alone; a host's unused memory serves the page cache and other processes."""
    budget = kv_budget_bytes(usable_memory_bytes, memory_utilization, weights_bytes)
    return min(budget, demand_bytes)
