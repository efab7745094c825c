"""API models, the generated CRD, the catalog and the examples."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvpilot.contract import catalog
from kvpilot.operator import api, crdgen

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


def test_committed_crds_match_the_generator(capsys: pytest.CaptureFixture[str]) -> None:
    status = crdgen.main(["--check"])
    assert status == 0, (
        f"crds/ is stale, run `python -m kvpilot.operator.crdgen`:\n{capsys.readouterr().out}"
    )


def test_check_reports_a_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    target = tmp_path / "crds" / crdgen.MD_FILE
    target.write_text(target.read_text().replace("maxReplicas", "maxReplica"))
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "maxReplica:" in out and "+" in out and "stale" not in out


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return []
    out = [(path, node)]
    for key, child in (node.get("properties") or {}).items():
        out += _walk(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += _walk(node[key], f"{path}[{key}]")
    return out


def test_schema_is_structural() -> None:
    version = crdgen.crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    text = json.dumps(schema)
    for forbidden in ("$ref", "anyOf", "$defs", '"title"', '"const"'):
        assert forbidden not in text
    for path, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_crd_subresources_columns_and_rules() -> None:
    version = crdgen.crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.autoscaling.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Ready",
        "Replicas",
        "Quantization",
        "Loss %",
        "$/1k req",
        "Age",
    ]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    autoscaling = spec["properties"]["autoscaling"]
    assert (
        autoscaling["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"
    )
    assert autoscaling["properties"]["mode"]["enum"] == ["builtin", "external", "off"]
    assert spec["properties"]["quantization"]["properties"]["allowed"]["minItems"] == 1
    assert spec["required"] == ["model"]
    # Nested defaults are spelled out: the apiserver checks a default against its level's CEL rules.
    assert autoscaling["default"]["minReplicas"] == 1


def test_defaults() -> None:
    s = api.parse_spec({"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}})
    assert s.quantization.allowed == ["bf16", "int8", "int4"]
    assert s.placement.node_types == ["auto"]
    assert s.autoscaling.mode == "builtin"
    assert api.served_name(s.model) == "Qwen2.5-7B-Instruct"


@pytest.mark.parametrize(
    ("loss", "allowed", "expected"),
    [
        ("medium", ["int4", "bf16"], ("int4", "bf16")),
        ("low", ["int4", "int8", "bf16"], ("int8", "bf16")),
        ("none", ["bf16", "int8"], ("bf16",)),
    ],
)
def test_quality_loss_filters_the_preference(
    loss: str, allowed: list[str], expected: tuple[str, ...]
) -> None:
    policy = api.QuantizationPolicy.model_validate({"allowed": allowed, "maxQualityLoss": loss})
    assert api.allowed_quantizations(policy) == expected


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse_and_resolve(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    spec = api.parse_spec(doc["spec"])
    assert catalog.resolve(spec.model).parameters > 0
    assert len(doc["metadata"]["name"]) <= crdgen.MAX_NAME_LENGTH


def test_there_are_nineteen_invalid_examples_each_naming_its_field() -> None:
    assert len(INVALID) == 19
    for path in INVALID:
        assert "the error names: spec" in path.read_text().splitlines()[0], path


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_fail_the_models_too(path: Path) -> None:
    # The models repeat the CRD's rules, so a spec the apiserver rejects cannot reach the planner.
    with pytest.raises(ValidationError):
        api.parse_spec(yaml.safe_load(path.read_text())["spec"])


@pytest.mark.parametrize(
    ("uri", "layers"),
    [
        ("hf://Qwen/Qwen2.5-7B-Instruct", 28),
        ("hf://qwen/qwen2.5-0.5b@main", 24),
        ("hf://meta-llama/Llama-3.1-70B-Instruct", 80),
        ("hf://mistralai/Mistral-7B-Instruct-v0.3", 32),
        ("hf://Qwen/Qwen3-8B", 36),
        ("hf://Qwen/Qwen3-0.6B-Base@main", 28),
    ],
)
def test_catalog_lookup(uri: str, layers: int) -> None:
    facts = catalog.lookup(uri)
    assert facts is not None and facts.layers == layers


def test_spec_facts_win_and_missing_ones_are_named() -> None:
    given = api.ModelSource.model_validate(
        {
            "uri": "hf://Qwen/Qwen2.5-7B-Instruct",
            "parameters": 10,
            "layers": 1,
            "kvHeads": 1,
            "headDim": 8,
        }
    )
    assert catalog.resolve(given).parameters == 10
    unknown = api.ModelSource.model_validate({"uri": "pvc://weights/mine", "layers": 4})
    with pytest.raises(ValueError, match=r"set spec\.model parameters, kvHeads, headDim"):
        catalog.resolve(unknown)


def test_facts_from_the_tiny_llama_config() -> None:
    config = json.loads((ROOT / "models" / "tiny-llama" / "config.json").read_text())
    facts = catalog.facts_from_config(config, parameters=3_819_776)
    tiny = api.parse_spec(
        yaml.safe_load((ROOT / "examples" / "tiny-llama.yaml").read_text())["spec"]
    )
    # the spec states no projection widths (they size LoRA slots, estimated without them)
    widths = dataclasses.replace(
        catalog.resolve(tiny.model), hidden_size=256, intermediate_size=688, attention_heads=8
    )
    assert facts == widths


MODEL = {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}
PROVIDER = {
    "baseURL": "https://api.example.com/v1",
    "model": "gpt-4o-mini",
    "apiKeySecretRef": {"name": "example-key", "key": "api-key"},
}


def test_routing_defaults_and_the_contracts_example() -> None:
    assert api.parse_spec({"model": MODEL}).routing == api.Routing()
    assert api.Routing().fallback_after_seconds == 30 and api.Routing().fallbacks == []
    routing = api.parse_spec(
        {
            "model": MODEL,
            "routing": {
                "fallbacks": [{"modelDeployment": "small-model"}, {"provider": PROVIDER}],
                "fallbackAfterSeconds": 12,
            },
        }
    ).routing
    first, second = routing.fallbacks
    assert first.model_deployment == "small-model" and first.provider is None
    assert second.provider is not None and second.provider.base_url == PROVIDER["baseURL"]
    assert second.provider.api_key_secret_ref == api.SecretKeyRef(name="example-key", key="api-key")
    assert routing.fallback_after_seconds == 12
    wire = routing.model_dump(by_alias=True, exclude_none=True)
    assert wire["fallbacks"][1]["provider"]["baseURL"] == PROVIDER["baseURL"]


@pytest.mark.parametrize(
    ("routing", "error"),
    [
        ({"fallbacks": [{}]}, "exactly one of modelDeployment or provider"),
        (
            {"fallbacks": [{"modelDeployment": "a", "provider": PROVIDER}]},
            "exactly one of modelDeployment or provider",
        ),
        (
            {"fallbacks": [{"modelDeployment": "a"}, {"modelDeployment": "a"}]},
            "fallbacks name modelDeployment a twice",
        ),
        (
            {
                "fallbacks": [
                    {"provider": PROVIDER},
                    {"provider": {**PROVIDER, "apiKeySecretRef": None}},
                ]
            },
            "twice",
        ),
        ({"fallbackAfterSeconds": 0}, "fallbackAfterSeconds"),
        ({"fallbackAfterSeconds": 601}, "fallbackAfterSeconds"),
        ({"fallbacks": [{"modelDeployment": "Not_A_Name"}]}, "modelDeployment"),
        ({"fallbacks": [{"provider": {**PROVIDER, "baseURL": "api.example.com"}}]}, "baseURL"),
        ({"fallbacks": [{"provider": {"baseURL": PROVIDER["baseURL"]}}]}, "model"),
        ({"fallbacks": [{"modelDeployment": f"m{i}"} for i in range(9)]}, "fallbacks"),
        ({"endpointPickerRef": {"name": "epp"}}, "port is required"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_routing_is_refused_naming_the_field(routing: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        api.parse_spec({"model": MODEL, "routing": routing})


def test_a_fallback_to_itself_is_refused_by_name() -> None:
    spec = api.parse_spec({"model": MODEL, "routing": {"fallbacks": [{"modelDeployment": "qwen"}]}})
    api.check_routing("other", spec)
    with pytest.raises(ValueError, match="qwen cannot fall back to itself"):
        api.check_routing("qwen", spec)


def test_routing_crd_rules() -> None:
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    routing = schema["properties"]["spec"]["properties"]["routing"]
    fallback = routing["properties"]["fallbacks"]["items"]
    assert fallback["x-kubernetes-validations"][0]["rule"] == (
        "has(self.modelDeployment) != has(self.provider)"
    )
    assert routing["properties"]["fallbacks"]["maxItems"] == api.MAX_FALLBACKS
    assert "baseURL" in fallback["properties"]["provider"]["properties"]
    after = routing["properties"]["fallbackAfterSeconds"]
    assert (after["default"], after["minimum"], after["maximum"]) == (30, 1, 600)
    assert [r["message"] for r in routing["x-kubernetes-validations"]] == [
        "fallbacks name a ModelDeployment twice",
        "fallbacks name a provider (baseURL and model) twice",
    ]
    root_rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
    assert any("f.modelDeployment != self.metadata.name" in rule for rule in root_rules)


def test_endpoint_picker_ref_matches_the_inference_pool_field() -> None:
    ref = api.EndpointPickerRef.model_validate({"name": "epp", "port": {"number": 9002}})
    assert ref.model_dump(by_alias=True, exclude_none=True) == {
        "group": "",
        "kind": "Service",
        "name": "epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }


def _schema_at(path: tuple[str, ...]) -> dict[str, Any]:
    node = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for name in path:
        node = node["properties"][name]
    return dict(node)


@pytest.mark.parametrize("uri", ["file:///models/qwen-awq", "pvc://models/qwen-awq"])
def test_a_variant_the_operator_cannot_read_is_refused_saying_what_to_do(uri: str) -> None:
    """Both sides say why (the operator plans a variant by its config.json) and what works."""
    model = {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "variants": [{"name": "awq", "uri": uri}]}
    with pytest.raises(ValidationError) as info:
        api.parse_spec({"model": model})
    (error,) = info.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == "model.variants.0.uri"
    assert error["msg"] == f"Value error, must be {api.VARIANT_URI_FORMS}"
    assert "cannot read a node's file:// path" in error["msg"]
    assert "upload the checkpoint to S3, or serve it as spec.model (file:///PATH" in error["msg"]
    assert "with configMapRef naming a ConfigMap that holds its config.json" in error["msg"]
    items = _schema_at(("spec", "model", "variants"))["items"]["properties"]["uri"]
    (rule,) = items["x-kubernetes-validations"]
    assert rule["message"] == f"must be {api.VARIANT_URI_FORMS}"


@pytest.mark.parametrize(
    ("spec", "loc", "forms", "crd_path"),
    [
        ({"model": {"uri": "Qwen/Qwen2.5-7B-Instruct"}}, "model.uri", api.MODEL_URI_FORMS,
         ("spec", "model", "uri")),
        ({"model": {"uri": "https://huggingface.co/Qwen/Qwen2.5-7B-Instruct"}}, "model.uri",
         api.MODEL_URI_FORMS, ("spec", "model", "uri")),
        ({"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"},
          "serving": {"speculative": {"method": "draft_model", "model": "pvc://drafts/small"}}},
         "serving.speculative.model", api.DRAFT_URI_FORMS,
         ("spec", "serving", "speculative", "model")),
        ({"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"},
          "quantization": {"evaluation": {"maxQualityLoss": 1, "dataset": {"uri": "s3://b/"}}}},
         "quantization.evaluation.dataset.uri", api.EVAL_DATASET_URI_FORMS,
         ("spec", "quantization", "evaluation", "dataset", "uri")),
    ],
)  # fmt: skip
def test_a_uri_in_no_accepted_form_is_refused_listing_the_forms_on_both_sides(
    spec: dict[str, Any], loc: str, forms: str, crd_path: tuple[str, ...]
) -> None:
    """pydantic's message and the CRD rule's (what `kubectl apply` prints) are the same words,
    and neither is a regular expression."""
    with pytest.raises(ValidationError) as info:
        api.parse_spec(spec)
    (error,) = info.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == loc
    assert error["msg"] == f"Value error, must be {forms}"
    (rule,) = _schema_at(crd_path)["x-kubernetes-validations"]
    assert rule["message"] == f"must be {forms}"
    assert "pattern" not in _schema_at(crd_path)


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"runtime": {"kvOffload": {"hostGiB": 0}}}, "hostGiB"),
        ({"runtime": {"kvOffload": {}}}, "hostGiB"),
        ({"runtime": {"kvOffload": {"hostGiB": 4, "disk": {}}}}, "sizeGiB"),
        (
            {"runtime": {"kvOffload": {"hostGiB": 4, "disk": {"sizeGiB": 8, "hostPath": "kv"}}}},
            "hostPath",
        ),
        (
            {"runtime": {"kvOffload": {"hostGiB": 4, "disk": {"sizeGiB": 8, "claimName": "A_"}}}},
            "claimName",
        ),
        (
            {"runtime": {"kvOffload": {"hostGiB": 4, "disk": {"sizeGiB": 8, "claimName": "kv",
                                                              "hostPath": "/kv"}}}},
            "at most one of claimName or hostPath",
        ),
        (
            {"runtime": {"kvOffload": {"hostGiB": 4}}, "placement": {"minGpusPerReplica": 2}},
            "kvOffload needs one GPU per replica",
        ),
        (
            {"runtime": {"kvOffload": {"hostGiB": 4}},
             "serving": {"speculative": {"method": "draft_model", "model": "hf://org/draft"}}},
            "does not work with speculative method draft_model",
        ),
    ],
)  # fmt: skip
def test_a_kv_offload_the_runtime_would_refuse_is_refused_naming_why(
    spec: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValidationError, match=error):
        api.parse_spec({"model": MODEL, **spec})


def test_kv_offload_crd_rules_say_what_the_models_say() -> None:
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    offload = spec["properties"]["runtime"]["properties"]["kvOffload"]
    assert offload["required"] == ["hostGiB"]
    disk = offload["properties"]["disk"]
    assert [r["message"] for r in disk["x-kubernetes-validations"]] == [
        "kvOffload.disk: give at most one of claimName or hostPath (neither: an emptyDir)"
    ]
    messages = [r["message"] for r in spec["x-kubernetes-validations"]]
    assert any("needs one GPU per replica" in m for m in messages)
    assert any("does not work with speculative method draft_model" in m for m in messages)
    tiered = api.parse_spec({"model": MODEL, "runtime": {"kvOffload": {"hostGiB": 8}}})
    assert tiered.runtime.kv_offload is not None and tiered.runtime.kv_offload.disk is None


@pytest.mark.parametrize(
    ("adapter", "field", "forms"),
    [
        ({"name": "a=b", "uri": "hf://org/a"}, "name", api.ADAPTER_NAME_FORMS),
        ({"name": "-sql", "uri": "hf://org/a"}, "name", api.ADAPTER_NAME_FORMS),
        ({"name": "sql", "uri": "pvc://My_Claim/a"}, "uri", api.ADAPTER_URI_FORMS),
        ({"name": "sql", "uri": "org/a"}, "uri", api.ADAPTER_URI_FORMS),
    ],
)
def test_a_bad_adapter_is_refused_in_words_on_both_sides(
    adapter: dict[str, Any], field: str, forms: str
) -> None:
    with pytest.raises(ValidationError) as info:
        api.parse_spec({"model": MODEL, "adapters": [adapter]})
    (error,) = info.value.errors()
    assert error["loc"] == ("adapters", 0, field)
    assert error["msg"] == f"Value error, must be {forms}"
    items = _schema_at(("spec", "adapters"))["items"]["properties"][field]
    (rule,) = items["x-kubernetes-validations"]
    assert rule["message"] == f"must be {forms}" and "pattern" not in items


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"adapters": [{"name": "a", "uri": "hf://o/a"}, {"name": "a", "uri": "hf://o/b"}]},
         "name a is given twice"),
        ({"adapters": [{"name": "Qwen2.5-7B-Instruct", "uri": "hf://o/a"}]},
         "is the base model's served name"),
        ({"lora": {"maxLoras": 4, "maxCpuLoras": 2}}, "maxCpuLoras must be >= lora.maxLoras"),
    ],
)  # fmt: skip
def test_adapter_names_and_slots_are_checked(spec: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        api.parse_spec({"model": MODEL, **spec})
    lists = _schema_at(("spec", "adapters"))
    assert lists["x-kubernetes-list-type"] == "map"  # the apiserver refuses a name twice too
    assert lists["x-kubernetes-list-map-keys"] == ["name"]


@pytest.mark.parametrize(
    ("adapter_uri", "cache", "refused"),
    [
        ("hf://example/sql-lora", {"size": "20Gi"}, True),
        ("s3://loras/sql", {"size": "20Gi"}, True),
        ("pvc://loras/sql", {"size": "20Gi"}, False),  # read where it is, never cached
        ("hf://example/sql-lora", None, False),  # fetched by each pod
    ],
)
def test_cached_adapters_and_variants_need_one_claim(
    adapter_uri: str, cache: dict[str, str] | None, refused: bool
) -> None:
    model: dict[str, Any] = {
        "uri": "hf://Qwen/Qwen2.5-7B-Instruct",
        "variants": [{"name": "awq", "uri": "hf://Qwen/Qwen2.5-7B-Instruct-AWQ"}],
    }
    if cache is not None:
        model["cache"] = cache
    spec = {"model": model, "adapters": [{"name": "sql", "uri": adapter_uri}]}
    if refused:
        with pytest.raises(ValidationError, match="which the pods of a node type serving a"):
            api.parse_spec(spec)
    else:
        assert api.parse_spec(spec).adapters[0].uri == adapter_uri
