"""Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3 dense): GQA, RMSNorm, SwiGLU,
rotary, paged KV. Qwen3 differs only by RMS-normalising each q and k head before RoPE.

Weights are taken from the checkpoint's tensor names; q/k/v and gate/up are fused into one matrix
each so a layer does three matmuls fewer, then stored in the requested weight format. Under tensor
parallelism (engine/parallel.py) each rank builds the same model from its shard of every tensor,
with `cfg` holding its share of the heads, and sums o_proj's and down_proj's partial outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from kvpilot.runtime.engine.parallel import TPGroup, shard_config
from kvpilot.runtime.layers.attention import AttentionMetadata, paged_attention
from kvpilot.runtime.layers.kv_cache import PagedCache
from kvpilot.runtime.layers.lora import LayerLora, LoraBatch, LoraWeights
from kvpilot.runtime.layers.packed_int4 import OutputPermutedWeight, PermutedWeight
from kvpilot.runtime.layers.prequant import (
    Matrix,
    concat,
    read_matrix,
    split_input_order,
    store,
)
from kvpilot.runtime.layers.quant import Weight, make_weight
from kvpilot.runtime.layers.rotary import (
    apply_rotary,
    cos_sin_table,
    inv_frequencies,
    signed_sin,
)
from kvpilot.runtime.models.loader import ModelConfig

GetTensor = Callable[[str], torch.Tensor]
FindTensor = Callable[[str], torch.Tensor | None]  # None: not in the checkpoint
KVCache = list[tuple[PagedCache, PagedCache]]  # per layer: k, v [num_blocks, BS, H_kv, D]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers does it: normalise in float32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Linear:
    def __init__(self, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.weight, self.bias, self.dtype = weight, bias, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(x, self.bias)


def qk_norm_weight(cfg: ModelConfig, attn: str, get: GetTensor) -> torch.Tensor:
    """Qwen3's q_norm and k_norm weights ([D] each, shared by the heads) as one row per q head
    then per KV head, [H + H_kv, D], so the fused q/k tensor is normalised in one pass. `cfg`
    is this rank's: under tensor parallelism each rank repeats them for its own heads."""
    q_norm, k_norm = get(f"{attn}.q_norm.weight"), get(f"{attn}.k_norm.weight")
    return torch.cat([q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)])


class DecoderLayer:
    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        get: GetTensor,
        read: Callable[..., Matrix],  # (module names, output rows) -> their fused matrix
        store: Callable[..., Linear],  # (matrix, bias) -> stored for the step
        group: TPGroup,
    ):
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        names = [f"{attn}.{p}_proj" for p in "qkv"]
        bias = torch.cat([get(f"{n}.bias") for n in names]) if cfg.has_qkv_bias else None
        self.qkv = store(read(names), bias)
        self.o = store(read([f"{attn}.o_proj"]))
        down, self.mlp_order = split_input_order(read([f"{mlp}.down_proj"]))
        gate_up = read([f"{mlp}.gate_proj", f"{mlp}.up_proj"], self.mlp_order)
        self.gate_up, self.down = store(gate_up), store(down)
        self.qk_norm = qk_norm_weight(cfg, attn, get) if cfg.has_qk_norm else None
        self.input_norm = get(f"{prefix}.input_layernorm.weight")
        self.post_attn_norm = get(f"{prefix}.post_attention_layernorm.weight")
        self.cfg, self.group = cfg, group
        self.lora: LayerLora | None = None  # set by LlamaModel.enable_lora

    def restore_checkpoint_order(self) -> None:
        """Adapters are trained on the checkpoint's order of the MLP's intermediate features:
        a folded act-order MLP (mlp_order) gathers back to it, one gather on each side per
        step, as it did unfolded (PermutedWeight) plus one."""
        if self.mlp_order is None:
            return
        order = self.mlp_order.to(self.input_norm.device)
        inverse = torch.argsort(order)
        outputs = torch.cat([inverse, inverse + inverse.numel()])  # gate's, then up's
        self.gate_up.weight = OutputPermutedWeight(self.gate_up.weight, outputs)
        self.down.weight = PermutedWeight(self.down.weight, order)
        self.mlp_order = None

    def project(
        self, group: str, linear: Linear, x: torch.Tensor, lora: LoraBatch | None
    ) -> torch.Tensor:
        """A fused projection of x [T, in] -> [T, out], with each row's adapter delta if any."""
        out = linear(x)
        if lora is None or self.lora is None:
            return out
        return self.lora.add(group, x, out, lora)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[PagedCache, PagedCache],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], or [R, hidden] for the R `output_rows` only.

        Every row's keys and values are cached; past attention, rows are independent, so the
        output projection and MLP run only where an output is wanted. `lora`: each row's
        adapter (layers/lora.py), None when no row has one."""
        cfg = self.cfg
        kv_size = cfg.num_kv_heads * cfg.head_dim
        normed = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qk, v = self.project("qkv", self.qkv, normed, lora).split(
            [cfg.num_heads * cfg.head_dim + kv_size, kv_size], dim=-1
        )
        # q and k rotate in one pass: [T, H + H_kv, D]
        qk = qk.unflatten(-1, (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim))
        if self.qk_norm is not None:  # Qwen3: each head normalised before it rotates
            qk = rms_norm(qk, self.qk_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        attn = paged_attention(q, k, v, cache[0], cache[1], meta, cfg.head_dim**-0.5)
        if output_rows is not None:
            x, attn = x[output_rows], attn[output_rows]
            lora = None if lora is None else lora.output  # planned for the same rows
        x = x + self.group.all_reduce(self.project("o", self.o, attn.flatten(1), lora))
        normed = rms_norm(x, self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = self.project("gate_up", self.gate_up, normed, lora).chunk(2, dim=-1)
        return x + self.group.all_reduce(
            self.project("down", self.down, F.silu(gate).mul_(up), lora)
        )


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        get_full: FindTensor,
        quantization: str,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None = None,
        int8_kernel: str = "w8a16",
    ) -> None:
        """`cfg` is the whole model's; the model keeps this rank's share of it (engine/parallel.py).
        `int8_kernel`: the int8 level's matmul, resolved (quant.resolve_int8_kernel)."""
        group = group or TPGroup()

        def find(name: str) -> torch.Tensor | None:  # shard first, then quantise
            tensor = get_full(name)
            return None if tensor is None else group.shard(name, tensor)

        def get(name: str) -> torch.Tensor:
            tensor = find(name)
            if tensor is None:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return tensor

        def read(modules: list[str], rows: torch.Tensor | None = None) -> Matrix:
            """The linear modules' matrices fused along the output dimension, each module's
            outputs in the order `rows` if given (prequant.split_input_order)."""
            quant = cfg.checkpoint_quant
            return concat([read_matrix(find, m, quant, rows) for m in modules])

        def store_linear(matrix: Matrix, bias: torch.Tensor | None = None) -> Linear:
            stored = store(matrix, quantization, dtype, device, int8_kernel=int8_kernel)
            return Linear(stored, bias, dtype)

        def get_dense(name: str) -> torch.Tensor:
            return get(name).to(device=device, dtype=dtype)

        self.cfg, self.dtype = shard_config(cfg, group.size), dtype
        self.group_size, self.group = group.size, group
        self.layers = [
            DecoderLayer(self.cfg, f"model.layers.{i}", get_dense, read, store_linear, group)
            for i in range(cfg.num_layers)
        ]
        embed = get("model.embed_tokens.weight").to(device)
        self.embed = make_weight(embed, quantization, dtype, True, int8_kernel)  # tied: lm_head
        tied = cfg.tie_word_embeddings
        if tied:
            self.lm_head = self.embed
        else:
            self.lm_head = store_linear(read(["lm_head"])).weight
        self.norm = get_dense("model.norm.weight")
        inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = cos_sin_table(inv_freq, cfg.max_position_embeddings)
        self.cos = cos.to(device, dtype)  # [max_pos, D]
        self.sin_signed = signed_sin(sin).to(device, dtype)  # [max_pos, D], see apply_rotary
        self.device = device
        self.lora: LoraWeights | None = None  # enable_lora

    def enable_lora(self, num_slots: int, max_rank: int) -> LoraWeights:
        """Room for `num_slots` adapters of rank up to `max_rank` in every layer (all zeros:
        an empty slot adds nothing); under tensor parallelism, this rank's shard of each."""
        self.lora = LoraWeights(self.cfg, num_slots, max_rank, self.dtype, self.device, self.group)
        for layer, layer_lora in zip(self.layers, self.lora.layers, strict=True):
            layer.lora = layer_lora
            layer.restore_checkpoint_order()
        return self.lora

    def weight_bytes(self) -> int:
        """Bytes the weights occupy as stored (quantised matrices, norms, biases)."""
        matrices = [self.embed] + ([] if self.lm_head is self.embed else [self.lm_head])
        linears = [
            lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        total = sum(m.num_bytes() for m in matrices) + sum(
            lin.weight.num_bytes() for lin in linears
        )
        small = [self.norm] + [
            t for layer in self.layers for t in (layer.input_norm, layer.post_attn_norm)
        ]
        small += [layer.qkv.bias for layer in self.layers if layer.qkv.bias is not None]
        small += [layer.qk_norm for layer in self.layers if layer.qk_norm is not None]
        return total + sum(t.numel() * t.element_size() for t in small)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden], or [R, hidden] for the
        R `output_rows` only: the last layer then skips its MLP for every other row (a prefill
        chunk needs logits for its last token alone). `lora`: each row's adapter, if any."""
        x = self.embed.rows(input_ids, self.dtype)
        cos, sin = self.cos[positions], self.sin_signed[positions]  # [T, D]
        *layers, last = zip(self.layers, kv_caches, strict=True)
        for layer, cache in layers:
            x = layer(x, cos, sin, cache, meta, lora=lora)
        x = last[0](x, cos, sin, last[1], meta, output_rows, lora)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> logits [S, vocab] in float32."""
        return self.lm_head.linear(hidden).float()
