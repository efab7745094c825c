"""A file:// or pvc:// spec.model planned from the config.json its spec.model.configMapRef names,
as an hf:// one is planned from the config.json read at the source: the architecture, and a
pre-quantised checkpoint's own level and bytes; the pods refuse a checkpoint of another kind
(--expect-checkpoint, checked by the runtime's own parser against the checkpoint it loads).

Figures by hand as in test_planner_prequantized.py (Qwen2.5-7B, maxContextLength 8192 x
targetConcurrency 8 on an L4): AWQ, GPTQ and compressed-tensors int4 (group 128, lm_head left
out) all hold 28 layers' projections x (0.5 + 4/128) + the rest x 2 = 5.26 GiB; bf16 14.19 GiB.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from hack.devcluster.versions import KUBERNETES
from kvpilot.contract import checkpoint_quant, memory, serve_config
from kvpilot.contract.memory import ModelFacts
from kvpilot.operator import api, crdgen
from kvpilot.operator.planning import model_facts
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.planning.model_facts import facts_from_config_map
from kvpilot.operator.reconcile import desired_state
from tests.support.checkpoint_configs import (
    QWEN25_7B,
    QWEN25_7B_AWQ,
    QWEN25_7B_CT_INT4,
    QWEN25_7B_GPTQ,
    QWEN25_7B_LAYER,
    QWEN25_7B_PARAMETERS,
)
from tests.support.helm_chart import require
from tests.support.prequant_plans import CONFIG, L4

MD = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}
REF = api.ConfigMapKeyRef(name="qwen-config")
URI = "file:///models/qwen2.5-7b-instruct-awq"
QUANTIZED = 28 * QWEN25_7B_LAYER
INT4_WEIGHTS = QUANTIZED * (0.5 + 4 / 128) + (QWEN25_7B_PARAMETERS - QUANTIZED) * 2
BF16_WEIGHTS = QWEN25_7B_PARAMETERS * 2.0
STATED = {"parameters": QWEN25_7B_PARAMETERS, "layers": 28, "kvHeads": 4, "headDim": 128}


def config_map(config: dict[str, Any], key: str = "config.json") -> dict[str, str]:
    return {key: json.dumps(config)}


def read(config: dict[str, Any]) -> ModelFacts:
    return facts_from_config_map(config_map(config), REF, "ns")


# The ConfigMap's config.json -> the checkpoint's kind, level and weights as planned.
@pytest.mark.parametrize(
    ("config", "kind", "level", "weights"),
    [
        (QWEN25_7B, "16-bit", None, BF16_WEIGHTS),  # a local bf16 model: parameters by shapes
        (QWEN25_7B_AWQ, "awq-int4", "int4", INT4_WEIGHTS),
        (QWEN25_7B_GPTQ, "gptq-int4", "int4", INT4_WEIGHTS),
        (QWEN25_7B_CT_INT4, "compressed-tensors-int4", "int4", INT4_WEIGHTS),
    ],
    ids=["bf16", "awq", "gptq", "ct-int4"],
)
def test_a_config_map_is_planned_as_a_read_config_json(
    config: dict[str, Any], kind: str, level: str | None, weights: float
) -> None:
    facts = read(config)
    assert (facts.parameters, facts.layers, facts.kv_heads, facts.head_dim) == (
        QWEN25_7B_PARAMETERS,
        28,
        4,
        128,
    )
    checkpoint = facts.checkpoint
    assert (None if checkpoint is None else (checkpoint.kind, checkpoint.level)) == (
        None if level is None else (kind, level)
    )
    desired = desire(facts)
    assert desired.error is None
    (entry,) = desired.plan
    assert (entry.quantization, entry.fits) == (level or "bf16", True)
    assert entry.weights_gi_b == pytest.approx(weights / 2**30, abs=0.01)
    assert pod_flags(desired).expect_checkpoint == kind
    assert "16-bit checkpoint" not in desired.summary  # nothing left unread to say


def desire(
    read: desired_state.Read | None,
    allowed: tuple[str, ...] = ("bf16", "int8", "int4"),
    stated: dict[str, int] | None = None,
) -> desired_state.Desired:
    model = {"uri": URI, "configMapRef": {"name": REF.name}, **(stated or {})}
    spec = {"model": model, "serving": {"maxContextLength": 8192}}
    md = MD | {"spec": spec | {"quantization": {"allowed": list(allowed)}}}
    observed = desired_state.Observed(node_types=(L4,), source_facts=read)
    return desired_state.desire(md, CONFIG, observed)


def pod_flags(desired: desired_state.Desired) -> serve_config.ServeConfig:
    """The runtime's own reading of the pod's `serve` args."""
    (deployment,) = [c for c in desired.children if c["kind"] == "Deployment"]
    _, *args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return serve_config.ServeConfig(**vars(serve_config.build_parser().parse_args(args)))


# Planned from the ConfigMap (level allowed) x the checkpoint the pod finds at --model -> whether
# the runtime starts. The last rows are what --quantization alone lets through: planned as a
# 16-bit model at int4, an AWQ checkpoint would run (its own level) with other bytes, and planned
# as AWQ, a 16-bit checkpoint would be quantised to int4 by kvpilot at load.
@pytest.mark.parametrize(
    ("planned", "allowed", "loaded", "starts", "quantization_alone_refuses"),
    [
        (QWEN25_7B_AWQ, ("bf16", "int8", "int4"), QWEN25_7B_AWQ, True, False),
        (QWEN25_7B_GPTQ, ("int4",), QWEN25_7B_GPTQ, True, False),
        (QWEN25_7B, ("bf16",), QWEN25_7B, True, False),
        (QWEN25_7B, ("bf16",), QWEN25_7B_AWQ, False, True),
        (QWEN25_7B_AWQ, ("int4",), QWEN25_7B_GPTQ, False, False),
        (QWEN25_7B, ("int4",), QWEN25_7B_AWQ, False, False),
        (QWEN25_7B_AWQ, ("int4",), QWEN25_7B, False, False),
    ],
)
def test_the_pod_refuses_a_checkpoint_other_than_the_one_planned(
    planned: dict[str, Any],
    allowed: tuple[str, ...],
    loaded: dict[str, Any],
    starts: bool,
    quantization_alone_refuses: bool,
) -> None:
    flags = pod_flags(desire(read(planned), allowed))
    quant = checkpoint_quant.parse_quantization_config(loaded)  # the runtime's own parser

    def refused(check: Any) -> bool:
        try:
            check()
        except ValueError:
            return True
        return False

    by_quantization = refused(
        lambda: checkpoint_quant.resolve_quantization(flags.quantization, quant)
    )
    by_kind = refused(
        lambda: checkpoint_quant.check_expected_checkpoint(flags.expect_checkpoint, quant)
    )
    assert by_quantization is quantization_alone_refuses
    assert (not (by_quantization or by_kind)) is starts


def test_the_refusal_names_both_kinds_and_the_config_map() -> None:
    flags = pod_flags(desire(read(QWEN25_7B_AWQ), ("int4",)))
    with pytest.raises(ValueError) as error:
        checkpoint_quant.check_expected_checkpoint(flags.expect_checkpoint, None)
    assert str(error.value).startswith(
        "--expect-checkpoint awq-int4: the checkpoint at --model is 16-bit (no quantization_config"
    )
    assert "spec.model.configMapRef" in str(error.value)


# What is wrong with the ConfigMap -> the words of the condition (the field, what to do).
@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            None,
            "spec.model.configMapRef (ConfigMap qwen-config, key config.json): ConfigMap"
            " qwen-config not found in namespace ns: kubectl create configmap qwen-config -n ns"
            " --from-file=config.json=CHECKPOINT/config.json",
        ),
        (
            config_map(QWEN25_7B_AWQ, "config"),
            "the ConfigMap has no key config.json (its keys: config): set"
            " spec.model.configMapRef.key, or kubectl create configmap",
        ),
        ({}, "has no key config.json (its keys: none)"),
        ({"config.json": "{'bits': 4"}, "key config.json): not JSON (Expecting property name"),
        ({"config.json": "[1, 2]"}, "not a JSON object: it must hold the checkpoint's config.json"),
        (
            config_map(QWEN25_7B_AWQ | {"quantization_config": {"quant_method": "awq", "bits": 3}}),
            "key config.json): the model's checkpoint cannot be served:"
            " quantization_config.bits: 3 is not supported; supported: 4",
        ),
        (
            config_map({k: v for k, v in QWEN25_7B.items() if k != "num_hidden_layers"}),
            "key config.json): cannot read the model's config.json: 'num_hidden_layers'",
        ),
    ],
    ids=["no-config-map", "no-key", "empty", "not-json", "not-an-object", "3-bit", "no-layers"],
)
def test_a_config_map_that_cannot_be_planned_says_what_to_do(
    data: dict[str, str] | None, says: str
) -> None:
    with pytest.raises(ValueError) as error:
        facts_from_config_map(data, REF, "ns")
    assert says in str(error.value)


@pytest.mark.parametrize("stated", [{}, STATED], ids=["no-facts", "stated-facts"])
def test_an_unread_config_map_fails_the_plan_for_now_even_beside_stated_facts(
    stated: dict[str, int],
) -> None:
    """Planning the stated facts as 16-bit would start pods the checkpoint may refuse (or that
    quantise it unplanned): the plan fails, nothing is applied, and the pass is retried."""
    why = "spec.model.configMapRef (ConfigMap qwen-config, key config.json): ConfigMap ..."
    desired = desire(why, stated=stated)
    assert (desired.error, desired.needs_retry, desired.is_invalid_spec) == (why, True, False)
    assert desired.children == [] and desired.plan == []


def test_stated_facts_beside_a_config_map_behave_as_beside_a_read_config_json() -> None:
    stated = STATED | {"layers": 30}  # the spec's architecture wins, the checkpoint is read
    desired = desire(read(QWEN25_7B_AWQ), stated=stated)
    assert desired.error is None
    assert pod_flags(desired).expect_checkpoint == "awq-int4"
    too_few = desire(read(QWEN25_7B_AWQ), stated=STATED | {"parameters": 1000})
    assert too_few.is_invalid_spec
    assert "spec.model.parameters 1000 is fewer than" in str(too_few.error)


class FakeCoreV1:
    """CoreV1Api's read_namespaced_config_map on a dict of ConfigMaps by (namespace, name)."""

    found: ClassVar[dict[tuple[str, str], dict[str, str]]] = {}
    forbidden: ClassVar[bool] = False

    def __init__(self, client: Any) -> None:
        pass

    def read_namespaced_config_map(self, name: str, namespace: str) -> Any:
        if self.forbidden:
            raise ApiException(status=403, reason="Forbidden")
        if (namespace, name) not in self.found:
            raise ApiException(status=404, reason="Not Found")
        return type("V1ConfigMap", (), {"data": self.found[namespace, name]})()


def test_the_reader_reads_the_config_map_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_facts.k8s_client, "CoreV1Api", FakeCoreV1)
    reader = model_facts.ModelFactsReader(client=None)  # type: ignore[arg-type]
    monkeypatch.setattr(FakeCoreV1, "found", {})
    with pytest.raises(ValueError, match="ConfigMap qwen-config not found in namespace ns"):
        reader.read_config_map("ns", REF)
    monkeypatch.setattr(FakeCoreV1, "found", {("ns", "qwen-config"): config_map(QWEN25_7B)})
    assert reader.read_config_map("ns", REF).checkpoint is None
    # changed in place: read again, not remembered
    monkeypatch.setattr(FakeCoreV1, "found", {("ns", "qwen-config"): config_map(QWEN25_7B_AWQ)})
    checkpoint = reader.read_config_map("ns", REF).checkpoint
    assert checkpoint is not None and checkpoint.kind == "awq-int4"
    monkeypatch.setattr(FakeCoreV1, "forbidden", True)
    with pytest.raises(ValueError, match="may not read ConfigMap qwen-config in namespace ns"):
        reader.read_config_map("ns", REF)


def test_a_local_pre_quantised_model_under_the_gate_is_told_to_upload_it_as_a_variant() -> None:
    evaluation = {"dataset": {"configMap": "eval", "key": "eval.txt"}, "maxQualityLoss": 2.0}
    model = {"uri": URI, "configMapRef": {"name": REF.name}}
    spec = {"model": model, "quantization": {"evaluation": evaluation}}
    observed = desired_state.Observed(node_types=(L4,), source_facts=read(QWEN25_7B_AWQ))
    desired = desired_state.desire(MD | {"spec": spec}, CONFIG, observed)
    assert desired.is_invalid_spec
    assert (
        "put the model's 16-bit checkpoint in spec.model.uri and this one uploaded to S3 (a"
        " variant is read from hf:// or s3://) under spec.model.variants (e.g. {name: awq, uri:"
        " s3://BUCKET/awq})"
    ) in str(desired.error)


@pytest.mark.parametrize(
    ("uri", "accepted"),
    [
        ("file:///models/qwen-awq", True),
        ("pvc://models/qwen-awq", True),
        ("hf://Qwen/Qwen2.5-7B-Instruct-AWQ", False),
        ("s3://models/qwen-awq", False),
    ],
)
def test_config_map_ref_is_for_local_sources_on_both_sides(uri: str, accepted: bool) -> None:
    model = {"uri": uri, "configMapRef": {"name": "qwen-config"}}
    if accepted:
        ref = api.parse_spec({"model": model}).model.config_map_ref
        assert ref == api.ConfigMapKeyRef(name="qwen-config", key="config.json")
        return
    with pytest.raises(ValidationError) as info:
        api.parse_spec({"model": model})
    assert api.CONFIG_MAP_REF_IS_LOCAL in str(info.value)
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    source = schema["properties"]["spec"]["properties"]["model"]
    rules = {r["message"]: r["rule"] for r in source["x-kubernetes-validations"]}
    assert "self.uri.startsWith('pvc://')" in rules[api.CONFIG_MAP_REF_IS_LOCAL]
    assert source["properties"]["configMapRef"]["properties"]["key"]["default"] == "config.json"


def test_a_local_source_with_a_config_map_has_no_16_bit_note() -> None:
    model = api.ModelSource.model_validate({"uri": URI, "configMapRef": {"name": "c"}})
    assert model_facts.local_source_note(model) == ""
    assert "configMapRef" in model_facts.local_source_note(api.ModelSource(uri=URI))


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-checkpoint"
LOCAL = NodeType("local", "", 16384, 1, 0.0, {"t": "local"}, ("n",), (1,))
# tiny-llama int4 by compressed-tensors (group 128, down_proj and lm_head left out, embeddings
# tied): per layer q 256x256, k and v 256x64, o 256x256, gate and up 256x688 at 0.5 + 4/128
TINY_QUANTIZED = 4 * (2 * 256 * 256 + 2 * 256 * 64 + 2 * 256 * 688)
TINY_PARAMETERS = 3_819_776


def test_the_kustomize_example_is_planned_at_its_checkpoints_int4() -> None:
    """examples/local-checkpoint: the ConfigMap kustomize generates from config.json (that
    checkpoint's own, as bench.reference.prequantized writes it) is what the model names."""
    kustomization = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
    md = yaml.safe_load((EXAMPLE / "modeldeployment.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    spec = api.parse_spec(md["spec"])
    assert spec.model.config_map_ref == api.ConfigMapKeyRef(name=generator["name"])
    data = {name: (EXAMPLE / name).read_text() for name in generator["files"]}
    facts = facts_from_config_map(data, spec.model.config_map_ref, "ns")
    assert facts.parameters == TINY_PARAMETERS  # the shapes count what the safetensors hold
    md["metadata"] |= {"namespace": "ns", "uid": "u"}
    observed = desired_state.Observed(node_types=(LOCAL,), source_facts=facts)
    desired = desired_state.desire(md, CONFIG, observed)
    (entry,) = desired.plan
    assert (entry.quantization, entry.fits) == ("int4", True)
    weights = TINY_QUANTIZED * (0.5 + 4 / 128) + (TINY_PARAMETERS - TINY_QUANTIZED) * 2
    assert memory.model_weight_bytes(facts, "int4") == pytest.approx(weights)  # status: 0.00 GiB
    flags = pod_flags(desired)
    assert (flags.quantization, flags.expect_checkpoint) == ("int4", "compressed-tensors-int4")


def test_kustomize_writes_the_generated_config_maps_name_into_the_model() -> None:
    kubectl = require(Path(KUBERNETES.path("kubectl")))
    out = subprocess.run(
        [str(kubectl), "kustomize", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    config_map, md = sorted(yaml.safe_load_all(out), key=lambda o: o["kind"])
    assert config_map["metadata"]["name"].startswith("tiny-llama-int4-config-")  # hashed
    assert md["spec"]["model"]["configMapRef"]["name"] == config_map["metadata"]["name"]
    assert json.loads(config_map["data"]["config.json"])["quantization_config"]
