"""The checks that make a spec unservable for what its sources hold: a pre-quantised spec.model
under the quality gate (it leaves no 16-bit baseline), and spec.model.variants[] not read or of
another architecture than spec.model. Each raises ValueError saying why; `desire` reports it as
an invalid spec (or retries, where a source was not read).
"""

from __future__ import annotations

from pydantic.alias_generators import to_camel

from kvpilot.contract.memory import ModelFacts
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.operator import api
from kvpilot.operator.reconcile.pass_types import Observed


def check_prequantized(spec: api.ModelDeploymentSpec, facts: ModelFacts) -> None:
    """The quality gate measures every loss against spec.model unquantised: a pre-quantised
    spec.model leaves it no 16-bit baseline (nor a level of its own to measure), so the spec is
    refused with the arrangement that works: the 16-bit checkpoint as spec.model, the
    pre-quantised one as a variant (measured against it, and served where it wins)."""
    if facts.checkpoint is None or spec.quantization.evaluation is None:
        return
    method = facts.checkpoint.description.split()[0]  # e.g. awq: a DNS label, a variant's name
    # A file:// or pvc:// one (planned from spec.model.configMapRef) cannot be a variant as it is
    is_local = not parse_model_uri(spec.model.uri).is_fetched
    uri = f"s3://BUCKET/{method}" if is_local else spec.model.uri
    upload = " uploaded to S3 (a variant is read from hf:// or s3://)" if is_local else ""
    raise ValueError(
        f"spec.quantization.evaluation needs a 16-bit spec.model as its baseline, and"
        f" spec.model ({spec.model.uri}) is pre-quantised ({facts.checkpoint.description}):"
        f" put the model's 16-bit checkpoint in spec.model.uri and this one{upload} under"
        f" spec.model.variants (e.g. {{name: {method}, uri: {uri}}}),"
        " or remove spec.quantization.evaluation to serve it unmeasured"
    )


# What makes two checkpoints one model: the shapes the KV cache and the served API depend on.
_ARCHITECTURE = ("layers", "kv_heads", "head_dim", "vocab_size", "hidden_size", "attention_heads")


def variants(
    spec: api.ModelDeploymentSpec, facts: ModelFacts, observed: Observed
) -> tuple[tuple[str, ModelFacts], ...]:
    """spec.model.variants[] with the facts read from each; ValueError when one was not read
    (its reason) or is another architecture than spec.model (the fields that differ)."""
    found: list[tuple[str, ModelFacts]] = []
    for variant in spec.model.variants:
        read = observed.variant_facts.get(variant.name)
        if not isinstance(read, ModelFacts):
            raise ValueError(f"spec.model.variants[{variant.name}]: {read or 'not read yet'}")
        differ = [
            f"{to_camel(n)} {getattr(read, n)} vs {getattr(facts, n)}"
            for n in _ARCHITECTURE
            if getattr(facts, n) and getattr(read, n) != getattr(facts, n)
        ]
        if differ:
            raise ValueError(
                f"spec.model.variants[{variant.name}] ({variant.uri}) is not spec.model's"
                f" architecture: {', '.join(differ)}; a variant is the same model published"
                " another way"
            )
        found.append((variant.name, read))
    return tuple(found)
