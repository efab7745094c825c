"""A pre-quantised checkpoint's `quantization_config` (config.json), read and checked at start.

Supported: `quant_method: compressed-tensors` (what llm-compressor writes) with, per config group,
- fp8 weights (`type: float`, 8 bits, `float-quantized` or `naive-quantized`): e4m3 values with
  a per-tensor or per-channel `weight_scale`; fp8 input activations (dynamic or static) are
  accepted and run weight-only (bf16/fp32 activations), as the CPU has no fp8 matmul;
- int4 weights (`pack-quantized`): group scales (group size 32, 64 or 128) or one per channel,
  symmetric or asymmetric (`weight_zero_point`), repacked into the engine's int4 format;
- int8 weights (`pack-quantized` or `naive-quantized`): symmetric, one scale per channel, the
  engine's int8 format as it is.
GPTQ (`quant_method: gptq`, 4 bits, group size 32/64/128 or -1, with or without desc_act,
`checkpoint_format` gptq or gptq_v2) and AWQ (`quant_method: awq`, 4 bits, group size 32/64/128,
with or without zero points, `version: gemm`) run as int4 too; a module without `qweight` (left
out by the quantiser) is read as a 16-bit matrix. A quantised lm_head (GPTQ/AWQ `lm_head: true`,
GPTQModel's `dynamic.lm_head` entry giving its bits and group size; compressed-tensors with
lm_head targeted and not in `ignore`) is served as stored, as vLLM does, where the model keeps an
lm_head of its own: with `tie_word_embeddings: true` the checkpoint would hold the embedding's
matrix twice, differently, which is refused (the quantisers untie first: llm-compressor does it
itself, GPTQModel refuses a tied one). Anything else (3-bit or 8-bit GPTQ, act-order in
compressed-tensors, quantised activations on an int scheme, a KV-cache scheme, sparsity,
transforms, GPTQ's per-module `dynamic` overrides but the lm_head's) is refused with the field
and value named, never served with its scales ignored.
Pure and torch-free (the operator plans with it, too: contract/checkpoint_weights.py); the
runtime's layers/prequant.py reads the tensors a scheme describes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("compressed-tensors", "gptq", "awq")
PACKED_INT4_METHODS = ("gptq", "awq")  # modules stored as qweight/qzeros/scales (packed_int4.py)
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_FORMATS = {4: ("pack-quantized",), 8: ("pack-quantized", "naive-quantized")}
INT4_GROUP_SIZES = (32, 64, 128)  # what the engine's int4 kernels take (tinygemm and its CPU twin)
GPTQ_GROUP_SIZES = (*INT4_GROUP_SIZES, -1)  # -1: one group per row, repeated per group of 128
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point minus one; v2 as it is
AWQ_VERSIONS = ("gemm",)
# The module kinds compressed-tensors' targets name; every matrix this engine quantises is one.
LINEAR_TARGETS = ("Linear",)
FIELD = "quantization_config"
LM_HEAD = "lm_head"  # the module (and, for GPTQ/AWQ, the field) of the output projection
# How a checkpoint's weights are stored, as --expect-checkpoint names it (checkpoint_kind): the
# operator plans a file:// or pvc:// model from a config.json the user gives it
# (spec.model.configMapRef), and its pods refuse a checkpoint of another kind at start.
SIXTEEN_BIT = "16-bit"
CHECKPOINT_KINDS = (
    SIXTEEN_BIT,
    "compressed-tensors-int4",
    "compressed-tensors-int8",
    "compressed-tensors-fp8",
    "gptq-int4",
    "awq-int4",
)


@dataclass(frozen=True)
class WeightScheme:
    """How one module's weights are stored. `group_size` None: one scale per output channel
    (or per tensor, `strategy == "tensor"`, fp8 only)."""

    type: str  # "float" (fp8 e4m3) or "int"
    num_bits: int
    strategy: str  # tensor, channel or group
    group_size: int | None
    symmetric: bool
    format: str  # compressed-tensors' format, or gptq, gptq_v2, awq-gemm
    desc_act: bool = False  # GPTQ act-order: input features in groups given by g_idx

    @property
    def level(self) -> str:
        """The engine level it runs as: int4, int8, or none (fp8 dequantised at load)."""
        return "none" if self.type == "float" else f"int{self.num_bits}"

    def describe(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.num_bits}"
        grouping = f"group {self.group_size}" if self.strategy == "group" else self.strategy
        zeros = "" if self.symmetric else ", asymmetric"
        order = ", desc_act" if self.desc_act else ""
        return f"{kind} ({self.format}, {grouping}{zeros}{order})"


Group = tuple[tuple[str, ...], WeightScheme]  # (targets, scheme)


@dataclass(frozen=True)
class CheckpointQuant:
    method: str
    groups: tuple[Group, ...]  # in order: a module takes the first group that targets it
    ignore: tuple[str, ...]

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of a linear module (e.g. `model.layers.0.mlp.up_proj`); None: unquantised
        (ignored, or no group targets it)."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t in LINEAR_TARGETS or _matches(t, module) for t in targets):
                return scheme
        return None

    @property
    def level(self) -> str:
        """The engine level of the quantised layers (one for the whole checkpoint)."""
        return self.groups[0][1].level

    @property
    def kind(self) -> str:
        """The method and the stored format of its quantised modules, e.g. `awq-int4` or
        `compressed-tensors-fp8` (one of CHECKPOINT_KINDS)."""
        scheme = self.groups[0][1]
        stored = "fp8" if scheme.type == "float" else f"int{scheme.num_bits}"
        return f"{self.method}-{stored}"

    def describe(self) -> str:
        schemes = sorted({scheme.describe() for _, scheme in self.groups})
        return f"{self.method} {', '.join(schemes)}"


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' target/ignore syntax: `re:<regex>` (matched from the start) or a
    module name (or its last components)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def parse_quantization_config(config: dict[str, Any]) -> CheckpointQuant | None:
    """config.json's `quantization_config`, checked; None for a 16-bit checkpoint. Raises
    ValueError naming the field and value it does not support, and what is supported."""
    qc = config.get(FIELD)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{FIELD} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ValueError(_unsupported("quant_method", method, SUPPORTED_METHODS))
    if method == "gptq":
        return _check_tied_head(config, _packed_int4(method, _parse_gptq(qc), qc))
    if method == "awq":
        _check_skips_only(qc.get("dynamic"))
        return _check_tied_head(config, _packed_int4(method, _parse_awq(qc), qc))
    _check_empty(qc, ("kv_cache_scheme", "sparsity_config", "transform_config"))
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(_unsupported("quantization_status", status, ("compressed",)))
    raw_groups = qc.get("config_groups") or {}
    if not isinstance(raw_groups, dict) or not raw_groups:
        raise ValueError(f"{FIELD}.config_groups is empty: nothing says how weights are stored")
    groups = tuple(
        _parse_group(f"config_groups.{name}", group, qc.get("format"))
        for name, group in raw_groups.items()
    )
    levels = {scheme.level for _, scheme in groups}
    if len(levels) > 1:
        raise ValueError(
            f"{FIELD}.config_groups mixes levels {sorted(levels)}; one level per checkpoint "
            "is supported"
        )
    quant = CheckpointQuant(str(method), groups, tuple(qc.get("ignore") or ()))
    return _check_tied_head(config, quant)


def _check_tied_head(config: dict[str, Any], quant: CheckpointQuant) -> CheckpointQuant:
    """A tied model's lm_head is its embedding: a checkpoint that quantises the lm_head of one
    holds that matrix twice (the embedding 16-bit, the lm_head packed), and which one the logits
    use is not said: transformers 5 fails to load such a compressed-tensors checkpoint, vLLM's
    tied Llama skips the `lm_head.*` tensors, and llm-compressor unties a tied model before it
    quantises its lm_head. So it is refused, naming the field that quantises the lm_head."""
    if not config.get("tie_word_embeddings", False) or quant.scheme_for(LM_HEAD) is None:
        return quant
    if quant.method in PACKED_INT4_METHODS:
        field, leave_out = f"{FIELD}.lm_head: true", "lm_head: false"
    else:
        ignored = json.dumps(list(quant.ignore))
        field, leave_out = f"{FIELD}.ignore: {ignored} quantises lm_head", "lm_head in ignore"
    raise ValueError(
        f"{field} with tie_word_embeddings: true is not supported: the checkpoint's lm_head "
        "would be a second, quantised copy of the embedding; untie the model before quantising "
        "(tie_word_embeddings: false and an lm_head of its own, as llm-compressor does) or leave "
        f"the lm_head out ({leave_out})"
    )


def _parse_group(
    where: str, group: dict[str, Any], default_format: str | None
) -> tuple[tuple[str, ...], WeightScheme]:
    _check_empty(group, ("output_activations",), where)
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{FIELD}.{where}.weights is missing: only weight schemes are supported")
    fmt = group.get("format") or default_format
    scheme = _parse_weights(f"{where}.weights", weights, str(fmt))
    activations = group.get("input_activations")
    if activations is not None and scheme.type != "float":
        raise ValueError(
            f"{FIELD}.{where}.input_activations: quantised activations with int weights are "
            "not supported (weight-only int schemes are: W4A16, W8A16)"
        )
    if activations is not None and activations.get("type") != "float":
        value = activations.get("type")
        raise ValueError(_unsupported(f"{where}.input_activations.type", value, ("float",)))
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise ValueError(f"{FIELD}.{where}.targets is empty: the group quantises no module")
    return targets, scheme


def _parse_weights(where: str, weights: dict[str, Any], fmt: str) -> WeightScheme:
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    symmetric = bool(weights.get("symmetric", True))
    if weights.get("actorder") is not None:
        raise ValueError(_unsupported(f"{where}.actorder", weights["actorder"], (None,)))
    if weights.get("dynamic"):
        raise ValueError(_unsupported(f"{where}.dynamic", weights["dynamic"], (False,)))
    if kind == "float":
        if bits != 8:
            raise ValueError(_unsupported(f"{where}.num_bits", bits, (8,)))
        _check_choice(where.rsplit(".", 1)[0] + ".format", fmt, FLOAT_FORMATS)
        _check_choice(f"{where}.strategy", strategy, ("tensor", "channel"))
        if not symmetric:
            raise ValueError(_unsupported(f"{where}.symmetric", False, (True,)))
        return WeightScheme("float", 8, str(strategy), None, True, fmt)
    if kind != "int":
        raise ValueError(_unsupported(f"{where}.type", kind, ("int", "float")))
    if bits not in INT_FORMATS:
        raise ValueError(_unsupported(f"{where}.num_bits", bits, tuple(INT_FORMATS)))
    _check_choice(where.rsplit(".", 1)[0] + ".format", fmt, INT_FORMATS[bits])
    if bits == 8:  # the engine's int8 format: symmetric, one scale per output channel
        _check_choice(f"{where}.strategy", strategy, ("channel",))
        if not symmetric:
            raise ValueError(_unsupported(f"{where}.symmetric", False, (True,)))
        return WeightScheme("int", 8, "channel", None, True, fmt)
    _check_choice(f"{where}.strategy", strategy, ("group", "channel"))
    if strategy == "group" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(_unsupported(f"{where}.group_size", group_size, INT4_GROUP_SIZES))
    size = group_size if strategy == "group" else None
    return WeightScheme("int", 4, str(strategy), size, symmetric, fmt)


def _packed_int4(method: str, scheme: WeightScheme, qc: dict[str, Any]) -> CheckpointQuant:
    """GPTQ and AWQ: one scheme for every decoder linear module that has a `qweight`; the
    others (`modules_to_not_convert`, GPTQModel's `-:` dynamic skips) were written as 16-bit
    `weight` tensors, which layers/packed_int4.py reads as such: the tensors say which is which.
    The lm_head is the config's to say (`lm_head`, as vLLM reads it): false ignores it; true
    quantises it as the rest, or as GPTQ's `dynamic.lm_head` says (_parse_gptq_head)."""
    lm_head = qc.get("lm_head", False)
    if not isinstance(lm_head, bool):
        raise ValueError(_unsupported("lm_head", lm_head, (True, False)))
    head = _parse_gptq_head(qc) if lm_head and method == "gptq" else None
    groups: tuple[Group, ...] = ((LINEAR_TARGETS, scheme),)
    if head is not None:  # first: scheme_for takes the first group that targets a module
        groups = (((LM_HEAD,), head), *groups)
    return CheckpointQuant(method, groups, () if lm_head else (LM_HEAD,))


def _parse_gptq(qc: dict[str, Any], where: str = "") -> WeightScheme:
    """AutoGPTQ's / GPTQModel's / transformers' GPTQConfig as config.json holds it. `where`:
    the prefix of a per-module override's fields (`dynamic.lm_head.`)."""
    _check_choice(f"{where}bits", qc.get("bits"), (4,))
    group_size = qc.get("group_size", 128)
    _check_choice(f"{where}group_size", group_size, GPTQ_GROUP_SIZES)
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    _check_choice("checkpoint_format", fmt, GPTQ_FORMATS)
    _check_choice("pack_dtype", qc.get("pack_dtype", "int32"), ("int32",))
    _check_skips_only(qc.get("dynamic"), allowed=(LM_HEAD,))
    size = None if group_size == -1 else int(group_size)
    strategy = "channel" if size is None else "group"
    symmetric, desc_act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    return WeightScheme("int", 4, strategy, size, symmetric, str(fmt), desc_act)


# What a GPTQModel `dynamic` override may set: how the module is stored, and `mse`, a setting of
# the quantiser's search that leaves no trace in the tensors.
GPTQ_OVERRIDES = ("bits", "group_size", "sym", "desc_act", "mse")


def _parse_gptq_head(qc: dict[str, Any]) -> WeightScheme | None:
    """GPTQModel quantises the lm_head as its `dynamic.lm_head` entry says, the rest of the
    config filling what it leaves out; its default entry is 8 bits in groups of 32, which no
    kernel here reads packed (refused, naming the field), so a 4-bit lm_head is asked for:
    `dynamic={"lm_head": {"bits": 4, "group_size": 128}}`. None: no entry."""
    override = (qc.get("dynamic") or {}).get(LM_HEAD)
    if override is None:
        return None
    where = f"dynamic.{LM_HEAD}"
    if not isinstance(override, dict):
        raise ValueError(_unsupported(where, override, ("an object",)))
    if unknown := sorted(set(override) - set(GPTQ_OVERRIDES)):
        raise ValueError(_unsupported(f"{where}.{unknown[0]}", override[unknown[0]], ("absent",)))
    return _parse_gptq({**qc, **override, "dynamic": None}, f"{where}.")


def _check_skips_only(dynamic: Any, allowed: tuple[str, ...] = ()) -> None:
    """GPTQModel's `dynamic`: `-:<regex>` entries leave modules unquantised (their tensors say
    so); `+:`/plain entries change bits or group size per module, which is not supported but
    for the `allowed` modules' (GPTQ's lm_head: _parse_gptq_head reads it)."""
    for pattern in dynamic or {}:
        if not str(pattern).startswith("-:") and pattern not in allowed:
            raise ValueError(_unsupported(f"dynamic.{pattern}", dynamic[pattern], ("-:<regex>",)))


def _parse_awq(qc: dict[str, Any]) -> WeightScheme:
    """AutoAWQ's / transformers' AwqConfig: `bits` (or `w_bit`), `group_size` (`q_group_size`)."""
    _check_choice("bits", qc.get("bits") or qc.get("w_bit"), (4,))
    group_size = qc.get("group_size") or qc.get("q_group_size")
    _check_choice("group_size", group_size, INT4_GROUP_SIZES)
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    _check_choice("version", version, AWQ_VERSIONS)
    # zero_point false (symmetric) still stores `qzeros` (each 8) in the GEMM layout: both read.
    symmetric = not qc.get("zero_point", True)
    return WeightScheme("int", 4, "group", int(str(group_size)), symmetric, "awq-gemm")


def _check_empty(section: dict[str, Any], names: tuple[str, ...], where: str = "") -> None:
    for name in names:
        if section.get(name):
            field = f"{where}.{name}" if where else name
            raise ValueError(_unsupported(field, section[name], ("null", "{}")))


def _check_choice(field: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(_unsupported(field, value, choices))


def _unsupported(field: str, value: Any, supported: tuple[Any, ...]) -> str:
    shown = ", ".join("null" if s is None else str(s) for s in supported)
    return (
        f"{FIELD}.{field}: {_json(value)} is not supported; supported: {shown} "
        "(see docs/architecture.md, pre-quantised checkpoints)"
    )


def _json(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value).replace("None", "null")


def resolve_quantization(flag: str, checkpoint: CheckpointQuant | None) -> str:
    """The level the engine applies itself, to the layers the checkpoint leaves unquantised.
    As vLLM does, the checkpoint's method wins: `--quantization none` (the default) or its own
    level keeps them in the compute dtype; any other level conflicts and is refused."""
    if checkpoint is None:
        return flag
    if flag in ("none", checkpoint.level):
        return "none"
    raise ValueError(
        f"--quantization {flag} conflicts with the checkpoint's {FIELD} "
        f"({checkpoint.describe()}): a pre-quantised checkpoint runs as it was quantised; "
        f"drop the flag (or pass --quantization {checkpoint.level})"
    )


# The modules tensor parallelism splits by their input features (the runtime's
# engine/parallel.py): a rank's share of a pre-quantised one's input must be whole groups.
ROW_PARALLEL_MODULES = ("o_proj", "down_proj")


def check_prequantized_parallel(
    quant: CheckpointQuant | None,
    tensor_parallel_size: int,
    row_parallel_inputs: Mapping[str, int] | None = None,
) -> None:
    """A pre-quantised checkpoint under tensor parallelism: each rank reads its share of the
    packed tensors as it does of 16-bit ones (engine/parallel.py), q/k/v and gate/up by their
    outputs, o_proj and down_proj (row-parallel) by their inputs, so a rank's share of those
    inputs must be whole groups of the checkpoint's. `row_parallel_inputs`: each row-parallel
    module (e.g. `model.layers.0.mlp.down_proj`) and its input features; None: not known yet
    (only the scheme is checked). GPTQ's act-order is refused: its groups are spread over the
    whole input, so a share of it holds part of every group."""
    if quant is None or tensor_parallel_size == 1:
        return
    prefix = f"--tensor-parallel-size {tensor_parallel_size} with a pre-quantised checkpoint"
    if any(scheme.desc_act for _, scheme in quant.groups):
        raise ValueError(
            f"{prefix} ({quant.describe()}) is not supported: act-order (desc_act) spreads each "
            "group over the whole input, which row-parallel o_proj and down_proj split; run it "
            "with --tensor-parallel-size 1, or use a checkpoint quantised without desc_act"
        )
    for module, in_features in (row_parallel_inputs or {}).items():
        scheme = quant.scheme_for(module)
        group = None if scheme is None else scheme.group_size
        share = in_features // tensor_parallel_size
        if group is not None and (in_features % tensor_parallel_size or share % group):
            raise ValueError(
                f"{prefix}: {module} has {in_features} input features, {share} a rank, not "
                f"whole groups of {group} ({quant.describe()}); choose a "
                "--tensor-parallel-size that splits them into whole groups, or 1"
            )


def checkpoint_kind(quant: CheckpointQuant | None) -> str:
    """One of CHECKPOINT_KINDS: `16-bit` for a checkpoint without a quantization_config."""
    return SIXTEEN_BIT if quant is None else quant.kind


def check_expected_checkpoint(expected: str | None, quant: CheckpointQuant | None) -> None:
    """--expect-checkpoint against the checkpoint loaded: a pod planned for one kind (from the
    config.json the operator was given) must not serve another, e.g. quantise a 16-bit
    checkpoint to int4 itself where a calibrated AWQ one was planned. None: not checked."""
    found = checkpoint_kind(quant)
    if expected is None or expected == found:
        return
    what = f"{FIELD} {quant.describe()}" if quant is not None else f"no {FIELD}"
    raise ValueError(
        f"--expect-checkpoint {expected}: the checkpoint at --model is {found} ({what} in its"
        " config.json); it was planned from another config.json than its own (the operator"
        " plans a file:// or pvc:// model from spec.model.configMapRef's ConfigMap): put this"
        " checkpoint's config.json in that ConfigMap, or point spec.model.uri at the checkpoint"
        " it describes"
    )
