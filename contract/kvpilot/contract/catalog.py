"""Architecture facts of popular open models, so a spec can name `hf://org/model` and nothing else.

Figures are from each model's config.json (num_hidden_layers, num_key_value_heads, head_dim or
hidden_size / num_attention_heads, vocab_size, and hidden_size, intermediate_size and
num_attention_heads, which size LoRA slots) and its model card's parameter count. Instruct and
base variants share an architecture, so both names point at one entry.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvpilot.contract.memory import CheckpointWeights, ModelFacts


class GivenFacts(Protocol):
    """What a spec may state of its model (the ModelDeployment's `spec.model`)."""

    @property
    def uri(self) -> str: ...
    @property
    def parameters(self) -> int | None: ...
    @property
    def layers(self) -> int | None: ...
    @property
    def kv_heads(self) -> int | None: ...
    @property
    def head_dim(self) -> int | None: ...
    @property
    def vocab_size(self) -> int | None: ...


_LLAMA_31_8B = ModelFacts(
    parameters=8_030_261_248,
    layers=32,
    kv_heads=8,
    head_dim=128,
    vocab_size=128_256,
    hidden_size=4_096,
    intermediate_size=14_336,
    attention_heads=32,
)
_LLAMA_31_70B = ModelFacts(
    parameters=70_553_706_496,
    layers=80,
    kv_heads=8,
    head_dim=128,
    vocab_size=128_256,
    hidden_size=8_192,
    intermediate_size=28_672,
    attention_heads=64,
)
_LLAMA_31_405B = ModelFacts(
    parameters=405_853_388_800,
    layers=126,
    kv_heads=8,
    head_dim=128,
    vocab_size=128_256,
    hidden_size=16_384,
    intermediate_size=53_248,
    attention_heads=128,
)
_LLAMA_32_1B = ModelFacts(
    parameters=1_235_814_400,
    layers=16,
    kv_heads=8,
    head_dim=64,
    vocab_size=128_256,
    hidden_size=2_048,
    intermediate_size=8_192,
    attention_heads=32,
)
_LLAMA_32_3B = ModelFacts(
    parameters=3_212_749_824,
    layers=28,
    kv_heads=8,
    head_dim=128,
    vocab_size=128_256,
    hidden_size=3_072,
    intermediate_size=8_192,
    attention_heads=24,
)
_QWEN25_0_5B = ModelFacts(
    parameters=494_032_768,
    layers=24,
    kv_heads=2,
    head_dim=64,
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4_864,
    attention_heads=14,
)
_QWEN25_1_5B = ModelFacts(
    parameters=1_543_714_304,
    layers=28,
    kv_heads=2,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=1_536,
    intermediate_size=8_960,
    attention_heads=12,
)
_QWEN25_3B = ModelFacts(
    parameters=3_085_938_688,
    layers=36,
    kv_heads=2,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=2_048,
    intermediate_size=11_008,
    attention_heads=16,
)
_QWEN25_7B = ModelFacts(
    parameters=7_615_616_512,
    layers=28,
    kv_heads=4,
    head_dim=128,
    vocab_size=152_064,
    hidden_size=3_584,
    intermediate_size=18_944,
    attention_heads=28,
)
_QWEN25_14B = ModelFacts(
    parameters=14_770_033_664,
    layers=48,
    kv_heads=8,
    head_dim=128,
    vocab_size=152_064,
    hidden_size=5_120,
    intermediate_size=13_824,
    attention_heads=40,
)
_QWEN25_32B = ModelFacts(
    parameters=32_763_876_352,
    layers=64,
    kv_heads=8,
    head_dim=128,
    vocab_size=152_064,
    hidden_size=5_120,
    intermediate_size=27_648,
    attention_heads=40,
)
_QWEN25_72B = ModelFacts(
    parameters=72_706_203_648,
    layers=80,
    kv_heads=8,
    head_dim=128,
    vocab_size=152_064,
    hidden_size=8_192,
    intermediate_size=29_568,
    attention_heads=64,
)
# Qwen3 dense: head_dim 128 from config.json (not hidden_size / heads); 0.6B-4B tie embeddings.
_QWEN3_0_6B = ModelFacts(
    parameters=596_049_920,
    layers=28,
    kv_heads=8,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=1_024,
    intermediate_size=3_072,
    attention_heads=16,
)
_QWEN3_1_7B = ModelFacts(
    parameters=1_720_574_976,
    layers=28,
    kv_heads=8,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=2_048,
    intermediate_size=6_144,
    attention_heads=16,
)
_QWEN3_4B = ModelFacts(
    parameters=4_022_468_096,
    layers=36,
    kv_heads=8,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=2_560,
    intermediate_size=9_728,
    attention_heads=32,
)
_QWEN3_8B = ModelFacts(
    parameters=8_190_735_360,
    layers=36,
    kv_heads=8,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=4_096,
    intermediate_size=12_288,
    attention_heads=32,
)
_QWEN3_14B = ModelFacts(
    parameters=14_768_307_200,
    layers=40,
    kv_heads=8,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=5_120,
    intermediate_size=17_408,
    attention_heads=40,
)
_QWEN3_32B = ModelFacts(
    parameters=32_762_123_264,
    layers=64,
    kv_heads=8,
    head_dim=128,
    vocab_size=151_936,
    hidden_size=5_120,
    intermediate_size=25_600,
    attention_heads=64,
)
_MISTRAL_7B = ModelFacts(
    parameters=7_248_023_552,
    layers=32,
    kv_heads=8,
    head_dim=128,
    vocab_size=32_768,
    hidden_size=4_096,
    intermediate_size=14_336,
    attention_heads=32,
)
_MIXTRAL_8X7B = ModelFacts(
    parameters=46_702_792_704,
    layers=32,
    kv_heads=8,
    head_dim=128,
    vocab_size=32_000,
    hidden_size=4_096,
    intermediate_size=14_336,
    attention_heads=32,
)
_GEMMA2_9B = ModelFacts(
    parameters=9_241_705_984,
    layers=42,
    kv_heads=8,
    head_dim=256,
    vocab_size=256_000,
    hidden_size=3_584,
    intermediate_size=14_336,
    attention_heads=16,
)
_PHI3_MINI = ModelFacts(
    parameters=3_821_079_552,
    layers=32,
    kv_heads=32,
    head_dim=96,
    vocab_size=32_064,
    hidden_size=3_072,
    intermediate_size=8_192,
    attention_heads=32,
)
_TINYLLAMA = ModelFacts(
    parameters=1_100_048_384,
    layers=22,
    kv_heads=4,
    head_dim=64,
    vocab_size=32_000,
    hidden_size=2_048,
    intermediate_size=5_632,
    attention_heads=32,
)

CATALOG: dict[str, ModelFacts] = {
    "meta-llama/meta-llama-3-8b": _LLAMA_31_8B,
    "meta-llama/meta-llama-3-8b-instruct": _LLAMA_31_8B,
    "meta-llama/llama-3.1-8b": _LLAMA_31_8B,
    "meta-llama/llama-3.1-8b-instruct": _LLAMA_31_8B,
    "meta-llama/meta-llama-3-70b": _LLAMA_31_70B,
    "meta-llama/meta-llama-3-70b-instruct": _LLAMA_31_70B,
    "meta-llama/llama-3.1-70b": _LLAMA_31_70B,
    "meta-llama/llama-3.1-70b-instruct": _LLAMA_31_70B,
    "meta-llama/llama-3.3-70b-instruct": _LLAMA_31_70B,
    "meta-llama/llama-3.1-405b": _LLAMA_31_405B,
    "meta-llama/llama-3.1-405b-instruct": _LLAMA_31_405B,
    "meta-llama/llama-3.2-1b": _LLAMA_32_1B,
    "meta-llama/llama-3.2-1b-instruct": _LLAMA_32_1B,
    "meta-llama/llama-3.2-3b": _LLAMA_32_3B,
    "meta-llama/llama-3.2-3b-instruct": _LLAMA_32_3B,
    "qwen/qwen2.5-0.5b": _QWEN25_0_5B,
    "qwen/qwen2.5-0.5b-instruct": _QWEN25_0_5B,
    "qwen/qwen2.5-1.5b": _QWEN25_1_5B,
    "qwen/qwen2.5-1.5b-instruct": _QWEN25_1_5B,
    "qwen/qwen2.5-3b": _QWEN25_3B,
    "qwen/qwen2.5-3b-instruct": _QWEN25_3B,
    "qwen/qwen2.5-7b": _QWEN25_7B,
    "qwen/qwen2.5-7b-instruct": _QWEN25_7B,
    "qwen/qwen2.5-14b": _QWEN25_14B,
    "qwen/qwen2.5-14b-instruct": _QWEN25_14B,
    "qwen/qwen2.5-32b": _QWEN25_32B,
    "qwen/qwen2.5-32b-instruct": _QWEN25_32B,
    "qwen/qwen2.5-72b": _QWEN25_72B,
    "qwen/qwen2.5-72b-instruct": _QWEN25_72B,
    "qwen/qwen3-0.6b": _QWEN3_0_6B,
    "qwen/qwen3-0.6b-base": _QWEN3_0_6B,
    "qwen/qwen3-1.7b": _QWEN3_1_7B,
    "qwen/qwen3-1.7b-base": _QWEN3_1_7B,
    "qwen/qwen3-4b": _QWEN3_4B,
    "qwen/qwen3-4b-base": _QWEN3_4B,
    "qwen/qwen3-4b-instruct-2507": _QWEN3_4B,
    "qwen/qwen3-4b-thinking-2507": _QWEN3_4B,
    "qwen/qwen3-8b": _QWEN3_8B,
    "qwen/qwen3-8b-base": _QWEN3_8B,
    "qwen/qwen3-14b": _QWEN3_14B,
    "qwen/qwen3-14b-base": _QWEN3_14B,
    "qwen/qwen3-32b": _QWEN3_32B,
    "mistralai/mistral-7b-v0.3": _MISTRAL_7B,
    "mistralai/mistral-7b-instruct-v0.3": _MISTRAL_7B,
    "mistralai/mixtral-8x7b-v0.1": _MIXTRAL_8X7B,
    "mistralai/mixtral-8x7b-instruct-v0.1": _MIXTRAL_8X7B,
    "google/gemma-2-9b": _GEMMA2_9B,
    "google/gemma-2-9b-it": _GEMMA2_9B,
    "microsoft/phi-3-mini-4k-instruct": _PHI3_MINI,
    "tinyllama/tinyllama-1.1b-chat-v1.0": _TINYLLAMA,
}

_SPEC_FACTS = ("parameters", "layers", "kv_heads", "head_dim")


def catalog_key(uri: str) -> str | None:
    """`hf://Qwen/Qwen2.5-7B-Instruct@main` -> `qwen/qwen2.5-7b-instruct`; None for non-hf URIs."""
    if not uri.startswith("hf://"):
        return None
    return uri.removeprefix("hf://").split("@", 1)[0].strip("/").lower()


def lookup(uri: str) -> ModelFacts | None:
    key = catalog_key(uri)
    return CATALOG.get(key) if key else None


def facts_from_config(
    config: dict[str, Any], parameters: int, checkpoint: CheckpointWeights | None = None
) -> ModelFacts:
    """ModelFacts from an HF config.json; the parameter count comes from the weights' size (a
    pre-quantised checkpoint's, `checkpoint`, from its shapes: checkpoint_weights.py)."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return ModelFacts(
        parameters=parameters,
        layers=int(config["num_hidden_layers"]),
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(config.get("vocab_size", 0)),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config.get("intermediate_size", 0)),
        attention_heads=heads,
        checkpoint=checkpoint,
    )


def resolve(source: GivenFacts, read_from_source: ModelFacts | None = None) -> ModelFacts:
    """Facts from the spec (all four given), else the catalog, else what the operator read from
    the source's config.json; ValueError names what is missing. The spec's facts say nothing
    of how the checkpoint is quantised: a config.json read beside them says that."""
    given = {name: getattr(source, name) for name in _SPEC_FACTS}
    if all(value is not None for value in given.values()):
        checkpoint = read_from_source.checkpoint if read_from_source else None
        check_given_parameters(given["parameters"], checkpoint)
        return ModelFacts(**given, vocab_size=source.vocab_size or 0, checkpoint=checkpoint)
    found = lookup(source.uri) or read_from_source
    if found is not None:
        return found
    missing = ", ".join(_camel(name) for name, value in given.items() if value is None)
    raise ValueError(
        f"no architecture facts for {source.uri}: it is not in the built-in catalog, so set"
        f" spec.model {missing} (from the checkpoint's config.json)"
    )


def check_given_parameters(parameters: int, checkpoint: CheckpointWeights | None) -> None:
    """spec.model.parameters cannot be fewer than the checkpoint's quantised ones (the rest,
    planned at 16 bits, would weigh less than nothing)."""
    if checkpoint is not None and parameters < checkpoint.quantized_parameters:
        raise ValueError(
            f"spec.model.parameters {parameters} is fewer than the"
            f" {checkpoint.quantized_parameters} its checkpoint's quantised modules hold"
            f" ({checkpoint.description}): fix"
            " spec.model.parameters, or remove it and the other facts to use config.json's"
        )


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
