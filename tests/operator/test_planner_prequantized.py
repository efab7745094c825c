"""The planner on a pre-quantised checkpoint: Qwen2.5-7B-Instruct-AWQ next to its bf16 sibling.

Figures by hand (DESIGN.md §3.3, maxContextLength 8192 x targetConcurrency 8, KV bf16):
    AWQ weights  = 28 layers' projections x (0.5 + 4/128) + the rest (embeddings, lm_head,
                   norms, biases) x 2                                         = 5.26 GiB
    bf16 weights = 7,615,616,512 x 2                                          = 14.19 GiB
    kvpilot int4 = 7,615,616,512 x (0.5 + 4/128)                              = 3.77 GiB
    KV           = 2 x 28 x 4 x 128 x 2 bytes x 8192 x 8                      = 3.5 GiB
    per GPU      = weights + KV + 1 GiB + 5% of weights <= MiB x 2^20 x 0.9
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.contract import checkpoint_quant, memory, serve_config
from kvpilot.contract.memory import GIB, ModelFacts
from kvpilot.operator import api
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.planning.model_facts import UnservableCheckpointError, facts_from_config_json
from kvpilot.operator.reconcile import desired_state, manifests
from tests.support.checkpoint_configs import (
    QWEN25_7B,
    QWEN25_7B_AWQ,
    QWEN25_7B_LAYER,
    QWEN25_7B_PARAMETERS,
    TINYLLAMA,
)
from tests.support.prequant_plans import (
    AWQ,
    BF16,
    CONFIG,
    GTX_10GB,
    L4,
    T4,
    T4X4,
    no_header_read,
    pool,
    request,
)

MD = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}
KV = 2 * 28 * 4 * 128 * 2 * 8192 * 8
QUANTIZED = 28 * QWEN25_7B_LAYER
AWQ_WEIGHTS = QUANTIZED * (0.5 + 4 / 128) + (QWEN25_7B_PARAMETERS - QUANTIZED) * 2
BF16_WEIGHTS = QWEN25_7B_PARAMETERS * 2.0
INT4_WEIGHTS = QWEN25_7B_PARAMETERS * (0.5 + 4 / 128)


def per_gpu(weights: float) -> float:
    return weights + KV + GIB + 0.05 * weights


@pytest.mark.parametrize(
    ("facts", "levels", "node_type", "level", "weights"),
    [
        # bf16 alone: 19.4 GiB, more than a T4's 13.5; the AWQ checkpoint needs 10.0
        (BF16, ("bf16",), T4, None, BF16_WEIGHTS),
        (AWQ, ("bf16", "int8", "int4"), T4, "int4", AWQ_WEIGHTS),  # the checkpoint's level
        (BF16, ("bf16",), L4, "bf16", BF16_WEIGHTS),
        (AWQ, ("bf16", "int8", "int4"), L4, "int4", AWQ_WEIGHTS),
        # kvpilot's int4 quantises the embeddings and lm_head too (8.5 GiB); AWQ keeps them
        # 16-bit (10.0 GiB): only kvpilot's fits 9 GiB
        (BF16, ("bf16", "int8", "int4"), GTX_10GB, "int4", INT4_WEIGHTS),
        (AWQ, ("int4",), GTX_10GB, None, AWQ_WEIGHTS),
        # four T4s run the AWQ checkpoint on one (it fits), bf16 on two
        (AWQ, ("int4",), T4X4, "int4", AWQ_WEIGHTS),
    ],
)
def test_which_node_types_each_fits_and_its_bytes_per_replica(
    facts: ModelFacts,
    levels: tuple[str, ...],
    node_type: NodeType,
    level: str | None,
    weights: float,
) -> None:
    plan = planner.plan_node_type(request(facts, levels), node_type)
    assert plan.fits == (level is not None)
    assert plan.estimate is not None
    assert plan.estimate.weights_bytes == pytest.approx(weights)
    assert plan.estimate.total_bytes == pytest.approx(per_gpu(weights))
    if level is not None:
        assert (plan.quantization, plan.tensor_parallel) == (level, 1)
    if facts is AWQ:
        assert "pre-quantised awq int4 (awq-gemm, group 128" in plan.reason


def test_an_lm_head_the_checkpoint_quantised_is_planned_packed() -> None:
    """AWQ with `lm_head: true`: its 3584 x 152064 lm_head at 0.5 + 4/128 bytes a parameter, not
    2: 5.26 - 0.75 = 4.51 GiB of weights."""
    config = QWEN25_7B_AWQ | {
        "quantization_config": QWEN25_7B_AWQ["quantization_config"] | {"lm_head": True}
    }
    facts = facts_from_config_json(config, no_header_read, "model", "")
    weights = AWQ_WEIGHTS - 3584 * 152064 * (2 - (0.5 + 4 / 128))
    plan = planner.plan_node_type(request(facts, ("int4",)), L4)
    assert plan.fits and plan.estimate is not None
    assert plan.estimate.weights_bytes == pytest.approx(weights)


def test_bf16_splits_over_two_gpus_where_the_awq_checkpoint_runs_on_one() -> None:
    bf16 = planner.plan_node_type(request(BF16, ("bf16",)), T4X4)
    assert (bf16.fits, bf16.quantization, bf16.tensor_parallel) == (True, "bf16", 2)


def test_a_checkpoint_whose_level_is_not_allowed_is_refused_saying_so() -> None:
    plan = planner.plan_node_type(request(AWQ, ("bf16", "int8")), L4)
    assert not plan.fits
    assert "no allowed level (bf16, int8)" in plan.reason
    assert "spec.model pre-quantised awq int4" in plan.reason


def test_a_checkpoint_splits_over_the_gpus_that_give_each_rank_whole_groups() -> None:
    """Qwen2.5-7B-AWQ: o_proj's 3584 and down_proj's 18944 inputs are whole groups of 128 on
    1, 2 or 4 ranks (the runtime's own check, read with the facts), not on 8: 448 a rank."""
    assert AWQ.checkpoint is not None and AWQ.checkpoint.tensor_parallel_sizes == (1, 2, 4)
    two = planner.plan_node_type(request(AWQ, ("int4",), min_gpus_per_replica=2), T4X4)
    assert (two.fits, two.quantization, two.tensor_parallel) == (True, "int4", 2)
    assert two.estimate is not None
    assert two.estimate.weights_bytes == pytest.approx(AWQ_WEIGHTS / 2)
    eight_kv_heads = QWEN25_7B_AWQ | {"num_key_value_heads": 8}  # KV heads would split in 8
    facts = facts_from_config_json(eight_kv_heads, no_header_read, "model", "")
    eight = planner.plan_node_type(
        request(facts, ("int4",), min_gpus_per_replica=8), pool("a100x8", 81559, 8)
    )
    assert not eight.fits
    assert "pre-quantised checkpoint splits over 1, 2 or 4 GPUs only" in eight.reason
    assert "minGpusPerReplica is 8" in eight.reason


CT_INT4 = TINYLLAMA | {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 64},
            }
        },
        "ignore": ["lm_head"],
    }
}
CT_FP8 = TINYLLAMA | {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
            }
        },
        "ignore": ["lm_head"],
    }
}


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("config", [QWEN25_7B_AWQ, CT_INT4, CT_FP8], ids=["awq", "int4", "fp8"])
def test_the_runtime_accepts_the_level_and_parallelism_the_operator_writes(
    config: dict[str, Any], gpus: int, tmp_path: Path
) -> None:
    """The pod's args, parsed by the runtime's parser, pass the runtime's own checks against
    the same config.json as its loader reads it (checkpoint_quant: the level, and the ranks'
    shares of o_proj's and down_proj's inputs whole groups)."""
    from kvpilot.runtime.engine.parallel import row_parallel_inputs
    from kvpilot.runtime.models.loader import load_model_config

    facts = facts_from_config_json(config, no_header_read, "model", "")
    spec = api.parse_spec(
        {"model": {"uri": "hf://org/model-awq"}, "placement": {"minGpusPerReplica": gpus}}
    )
    plan = planner.plan_node_type(planner.PlanRequest.from_spec(spec, facts), pool("big", 81559, 8))
    assert (plan.fits, plan.tensor_parallel) == (True, gpus)
    pod = manifests.build_deployment(MD, spec, plan, 1, CONFIG)["spec"]["template"]["spec"]
    _, *args = pod["containers"][0]["args"]
    parsed = serve_config.ServeConfig(**vars(serve_config.build_parser().parse_args(args)))
    architecture = "LlamaForCausalLM" if config["model_type"] == "llama" else "Qwen2ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": [architecture]}))
    cfg = load_model_config(tmp_path)
    quant = cfg.checkpoint_quant
    assert checkpoint_quant.resolve_quantization(parsed.quantization, quant) == "none"
    checkpoint_quant.check_prequantized_parallel(
        quant, parsed.tensor_parallel_size, row_parallel_inputs(cfg)
    )


def test_a_16_bit_level_asked_of_a_checkpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="runs at its own level int4, not bf16"):
        memory.model_weight_bytes(AWQ, "bf16")
    assert memory.model_weight_bytes(dataclasses.replace(AWQ, checkpoint=None), "bf16") == (
        pytest.approx(BF16_WEIGHTS)
    )


def test_an_unsupported_checkpoint_names_the_field() -> None:
    config = QWEN25_7B | {"quantization_config": {"quant_method": "awq", "bits": 3}}
    with pytest.raises(UnservableCheckpointError, match="is not supported") as error:
        facts_from_config_json(config, no_header_read, "model", "")
    assert str(error.value).startswith(
        "the model's checkpoint cannot be served: quantization_config.bits: 3 is not supported"
    )


# spec.model the bf16 checkpoint, spec.model.variants [awq]: per node type the first allowed
# level in preference order where something fits, and within it the source of known quality:
# with no eval set the AWQ checkpoint as published before kvpilot's own unmeasured int4, though
# that packs the embeddings and lm_head too and holds fewer bytes
# (planning/choice.py; tests/operator/test_planner_variant_choice.py).
@pytest.mark.parametrize(
    ("levels", "node_type", "variant", "level", "tp", "weights"),
    [
        (("bf16", "int8", "int4"), L4, "", "bf16", 1, BF16_WEIGHTS),
        (("bf16", "int8", "int4"), T4, "", "int8", 1, QWEN25_7B_PARAMETERS * 1.0),
        (("bf16", "int4"), T4, "awq", "int4", 1, AWQ_WEIGHTS),
        (("bf16", "int4"), GTX_10GB, "", "int4", 1, INT4_WEIGHTS),  # AWQ's 10.0 GiB > 9.0
        (("bf16", "int4"), T4X4, "", "bf16", 2, BF16_WEIGHTS / 2),
        (("int4",), T4X4, "awq", "int4", 1, AWQ_WEIGHTS),
    ],
)
def test_the_planner_chooses_per_node_type_among_the_variants_and_its_levels(
    levels: tuple[str, ...],
    node_type: NodeType,
    variant: str,
    level: str,
    tp: int,
    weights: float,
) -> None:
    plan = planner.plan_node_type(request(BF16, levels, variants=(("awq", AWQ),)), node_type)
    assert plan.fits
    assert (plan.variant, plan.quantization, plan.tensor_parallel) == (variant, level, tp)
    assert plan.estimate is not None
    assert plan.estimate.weights_bytes == pytest.approx(weights)


def test_status_names_the_variant_and_no_loss_measured_for_kvpilots_level() -> None:
    admitted = (("", "bf16"), ("awq", "int4"))  # the gate kept kvpilot's int4 out
    req = request(BF16, ("bf16", "int4"), variants=(("awq", AWQ),), admitted=admitted)
    plans = planner.plan(req, [T4, L4])
    entries = planner.status_entries(plans, [1, 1], losses={"int4": 2.0, "bf16": 0.0})
    by_type = {e.node_type: e for e in entries}
    assert (by_type["l4-24gb"].variant, by_type["l4-24gb"].quality_loss) == ("", 0.0)
    assert (by_type["t4-16gb"].variant, by_type["t4-16gb"].quality_loss) == ("awq", None)
    assert "variant awq: pre-quantised awq int4" in plans[1].reason


def test_a_variants_pods_fetch_its_uri_with_its_secret_under_the_models_name() -> None:
    spec = api.parse_spec(
        {
            "model": {
                "uri": "hf://Qwen/Qwen2.5-7B-Instruct",
                "secretRef": {"name": "hf"},
                "variants": [
                    {"name": "awq", "uri": "hf://Qwen/Qwen2.5-7B-Instruct-AWQ"},
                    {"name": "own", "uri": "s3://models/qwen-awq", "secretRef": {"name": "s3"}},
                ],
            }
        }
    )
    for variant, uri, secret in (
        ("awq", "hf://Qwen/Qwen2.5-7B-Instruct-AWQ", "hf"),
        ("own", "s3://models/qwen-awq", "s3"),
        ("", "hf://Qwen/Qwen2.5-7B-Instruct", "hf"),
    ):
        plan = planner.NodePlan(T4, True, "int4", 1, max_concurrency=8, variant=variant)
        pod = manifests.build_deployment(MD, spec, plan, 1, CONFIG)["spec"]["template"]["spec"]
        (fetch,) = pod["initContainers"]
        assert f"--model={uri}" in fetch["args"]
        assert fetch["envFrom"] == [{"secretRef": {"name": secret}}]
        _, *args = pod["containers"][0]["args"]
        parsed = serve_config.ServeConfig(**vars(serve_config.build_parser().parse_args(args)))
        assert (parsed.served_name, parsed.quantization) == ("Qwen2.5-7B-Instruct", "int4")


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"variants": [{"name": "a", "uri": "hf://o/a"}, {"name": "a", "uri": "hf://o/b"}]},
            "each name once",
        ),
        ({"variants": [{"name": "a", "uri": "pvc://claim/a"}]}, "hf://ORG/NAME"),
    ],
)
def test_variants_the_operator_cannot_serve_are_refused_at_parse(
    model: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        api.parse_spec({"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", **model}})


def desire(variant_facts: dict[str, desired_state.Read], **spec: Any) -> desired_state.Desired:
    model = {
        "uri": "hf://Qwen/Qwen2.5-7B-Instruct",  # in the catalog: nothing to read for it
        "variants": [{"name": "awq", "uri": "hf://Qwen/Qwen2.5-7B-Instruct-AWQ"}],
    }
    md = MD | {"spec": {"model": model, "serving": {"maxContextLength": 8192}, **spec}}
    observed = desired_state.Observed(node_types=(T4,), variant_facts=variant_facts)
    return desired_state.desire(md, CONFIG, observed)


def test_a_pass_serves_the_variant_that_fits_and_says_why() -> None:
    # bf16 does not fit a T4; at int4 both fit, and with no eval set the AWQ checkpoint as
    # published comes before kvpilot's own int4 of spec.model, whose loss nobody measured
    desired = desire({"awq": AWQ}, quantization={"allowed": ["bf16", "int4"]})
    assert desired.error is None
    (entry,) = desired.plan
    assert (entry.variant, entry.quantization, entry.fits) == ("awq", "int4", True)
    assert entry.reason == (
        "variant awq over spec.model (served as published; kvpilot's own quantisation of it is"
        " not measured)"
    )
    (deployment,) = [c for c in desired.children if c["kind"] == "Deployment"]
    (fetch,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert "--model=hf://Qwen/Qwen2.5-7B-Instruct-AWQ" in fetch["args"]
    assert "t4-16gb: variant awq int4 on 1 GPU(s)" in desired.summary


def test_a_variant_of_another_architecture_is_an_invalid_spec_naming_the_fields() -> None:
    tiny = facts_from_config_json(TINYLLAMA, lambda: 1_100_048_384, "model", "")
    desired = desire({"awq": tiny})
    assert desired.is_invalid_spec
    assert desired.error is not None
    assert "spec.model.variants[awq]" in desired.error
    assert "layers 22 vs 28, headDim 64 vs 128" in desired.error
    assert "kvHeads" not in desired.error  # both have 4: only what differs is named


def test_a_variant_that_cannot_be_read_fails_the_plan_for_now() -> None:
    why = "cannot read the variant awq's config.json: 401 Unauthorized"
    desired = desire({"awq": why})
    assert desired.needs_retry and not desired.is_invalid_spec
    assert desired.error is not None and why in desired.error


def test_a_checkpoint_the_runtime_would_refuse_is_an_invalid_spec_naming_the_field() -> None:
    config = QWEN25_7B | {"quantization_config": {"quant_method": "awq", "bits": 3}}
    with pytest.raises(UnservableCheckpointError) as error:
        facts_from_config_json(config, no_header_read, "variant awq", "")
    desired = desire({"awq": desired_state.Unservable(str(error.value))})
    assert desired.is_invalid_spec and not desired.needs_retry
    assert desired.error == (
        "the variant awq's checkpoint cannot be served: quantization_config.bits: 3 is not"
        " supported; supported: 4 (see docs/architecture.md, pre-quantised checkpoints)"
    )
