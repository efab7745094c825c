"""Tensor parallelism (Megatron style, as vLLM does it): which weights split how, and the one
collective the model needs.

q/k/v and gate/up are column-parallel: each rank holds a slice of their output features, i.e. its
own attention heads (KV heads included, so each rank's KV pool holds only its heads) and its own
slice of the MLP's intermediate features. o_proj and down_proj are row-parallel: each rank holds
the matching slice of their input features, so each rank's product is a partial sum and one
all-reduce per projection makes the full hidden state again. Norms and rotary tables are tiny and
replicated.

Embeddings and lm_head stay replicated: a vocab-parallel embedding and lm_head would cost one more
all-reduce (embedding) and an all-gather of the logits every step, for a matrix that is a small
share of a Llama's weights; replicated, rank 0 samples from logits it computed alone and the
workers never touch the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpilot.contract.checkpoint_quant import ROW_PARALLEL_MODULES
from kvpilot.runtime.models.loader import ModelConfig

# How long a rank waits for the others at start-up and in a collective before giving up: long
# enough for a slow load, short enough that a wedged rank does not hang the server for good.
TIMEOUT = timedelta(minutes=5)

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ROW_PARALLEL_MODULES


def check_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """ValueError unless every rank gets whole attention heads, KV heads and MLP features."""
    counts = {
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
    }
    bad = {name: n for name, n in counts.items() if n % tensor_parallel_size}
    if bad:
        described = ", ".join(f"{name} {n}" for name, n in counts.items())
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} must divide {' and '.join(bad)}; "
            f"the model has {described}"
        )


def shard_config(cfg: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The model as one rank sees it: its share of the heads and of the MLP features."""
    check_tensor_parallel(cfg, tensor_parallel_size)
    return replace(
        cfg,
        num_heads=cfg.num_heads // tensor_parallel_size,
        num_kv_heads=cfg.num_kv_heads // tensor_parallel_size,
        intermediate_size=cfg.intermediate_size // tensor_parallel_size,
    )


# A pre-quantised checkpoint's tensors by how they lie (layers/prequant.py, packed_int4.py):
# compressed-tensors' (and 16-bit, fp8 and int8) output features first, [out, in or groups]
# (weight_zero_point packs eight outputs a word: [out / 8, groups]); GPTQ's and AWQ's input
# features (or groups) first, [in or in / 8 or groups, out or out / 8].
_OUTPUT_MAJOR = ("weight", "weight_packed", "weight_scale", "weight_zero_point")
_INPUT_MAJOR = ("qweight", "qzeros", "scales")
# Scales shared along the dimension a shard would cut (a per-channel scale [out, 1] of a
# row-parallel module, GPTQ's group -1 [1, out], a per-tensor scale): every rank takes it whole.
_SHAREABLE = ("weight_scale", "weight_zero_point", "qzeros", "scales")


def row_parallel_inputs(cfg: ModelConfig) -> dict[str, int]:
    """Each row-parallel module of the model and its input features (whole, not a share)."""
    inputs: dict[str, int] = {}
    for layer in range(cfg.num_layers):
        inputs[f"model.layers.{layer}.self_attn.o_proj"] = cfg.num_heads * cfg.head_dim
        inputs[f"model.layers.{layer}.mlp.down_proj"] = cfg.intermediate_size
    return inputs


def shard_dim(name: str) -> int | None:
    """The dimension a checkpoint tensor splits along, or None when every rank holds all of it:
    a column-parallel module's output features, a row-parallel one's input features (or
    groups of them), in whichever dimension the tensor keeps them."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    if module in _COLUMN_PARALLEL:
        if kind in (*_OUTPUT_MAJOR, "bias"):
            return 0
        return 1 if kind in _INPUT_MAJOR else None  # g_idx: every rank sees the whole input
    if module in _ROW_PARALLEL:  # a row-parallel bias would be added once, after the all-reduce
        if kind in _OUTPUT_MAJOR:
            return 1
        return 0 if kind in (*_INPUT_MAJOR, "g_idx") else None
    return None


def _shard_shape(name: str, shape: torch.Tensor, size: int) -> torch.Tensor:
    """compressed-tensors' weight_shape [out, in] of this rank's share of the matrix."""
    dim = shard_dim(name.rsplit(".", 1)[0] + ".weight")
    if dim is None:
        return shape
    shared = shape.clone()
    shared[dim] = shape[dim] // size
    return shared


def lora_shard_dim(module: str) -> tuple[int | None, int | None]:
    """The dimensions an adapter's A [r, in] and B [out, r] split along for `module`, as its
    base weight splits: a column-parallel module's B on its output features (A whole: every rank
    sees the whole input); a row-parallel module's A on its input features (B whole: each rank's
    x_r @ A_r @ B is a partial sum of the delta, added to the base's partial product before the
    all-reduce sums both)."""
    if module in _COLUMN_PARALLEL:
        return None, 0
    if module in _ROW_PARALLEL:
        return 1, None
    return None, None


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks."""

    rank: int = 0
    size: int = 1

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor (a copy, so the full one can be freed)."""
        kind = name.rsplit(".", 1)[-1]
        if self.size > 1 and kind == "weight_shape":  # compressed-tensors' [out, in]
            return _shard_shape(name, tensor, self.size)
        dim = shard_dim(name)
        if self.size == 1 or dim is None:
            return tensor
        if kind in _SHAREABLE and (tensor.dim() <= dim or tensor.shape[dim] == 1):
            return tensor
        if tensor.shape[dim] % self.size:
            raise ValueError(
                f"tensor {name!r} of shape {tuple(tensor.shape)} does not split into "
                f"tensor_parallel_size {self.size} parts along dim {dim}"
            )
        part = tensor.chunk(self.size, dim=dim)[self.rank].contiguous()
        # A rank's share of a row-parallel input is whole groups (check_prequantized_parallel),
        # numbered from its first: GPTQ's g_idx counts them from the checkpoint's first.
        return part - part.min() if kind == "g_idx" else part

    def shard_lora(
        self, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's A [r, in] and B [out, r] for `module` (views)."""
        if self.size == 1:
            return a, b
        a_dim, b_dim = lora_shard_dim(module)
        if a_dim is not None:
            a = a.chunk(self.size, dim=a_dim)[self.rank]
        if b_dim is not None:
            b = b.chunk(self.size, dim=b_dim)[self.rank]
        return a, b

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results in place (every rank calls it with the same shape)."""
        if self.size > 1 and x.numel() > 0:
            dist.all_reduce(x)
        return x


def init_process_group(group: TPGroup, init_method: str, device: torch.device) -> None:
    """Join the ranks: NCCL between GPUs, gloo between CPU processes."""
    if dist.is_initialized():
        raise ValueError(
            "a tensor-parallel engine already runs in this process; shut it down first"
        )
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL works on the current device: cuda:rank
        backend = "nccl"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=group.rank,
        world_size=group.size,
        timeout=TIMEOUT,
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: torch.device, rank: int, tensor_parallel_size: int) -> torch.device:
    """Rank r computes on cuda:(first + r), where `device` names the first GPU; on CPU every rank
    shares the host."""
    if device.type != "cuda":
        return device
    first = device.index or 0
    if first + tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} from {device} needs "
            f"{first + tensor_parallel_size} GPUs, {torch.cuda.device_count()} visible"
        )
    return torch.device("cuda", first + rank)
