"""The reference an eval measures against: bf16 on a node type that fits it; where none does, the
largest level some node type fits, which status then names and losses are relative to.

Hand figures (DESIGN.md §3.3, one 512-token window, one sequence, per GPU = weights + KV +
1 GiB + 5% of weights; usable = 0.9 x GPU memory): T4 (15 GiB -> 13.5 GiB usable) holds 7B at
int8 (7 GB) but not bf16 (14 GB), 13B at int4 (~6.9 GB) but not int8 (13 GB); L4 (22.5 GiB ->
20.2 GiB) holds 7B at bf16 and 13B at int8; 40B (int4 ~21 GB) fits neither."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract.memory import ModelFacts
from kvpilot.operator import api
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import desired_state, typed_status
from tests.support.quality_fixtures import CONFIG, DIGEST, NOW, job, md, summary_pod

T4 = NodeType("t4", "Tesla-T4", 15360, 1, 0.53, {"kvpilot.dev/node-type": "t4"}, ("t0",), (1,))
L4 = NodeType("l4", "NVIDIA-L4", 23034, 1, 0.98, {"kvpilot.dev/node-type": "l4"}, ("n0",), (1,))
URI = "hf://org/model-7b"


def facts(billions: int) -> ModelFacts:
    return ModelFacts(billions * 10**9, 32, 8, 128, 32000)


def request(billions: int) -> planner.PlanRequest:
    return planner.PlanRequest(facts(billions), ("bf16", "int8", "int4"), 4096, 2)


@pytest.mark.parametrize(
    ("billions", "node_types", "expected"),
    [
        (7, [L4], ("l4", "bf16")),
        (7, [T4, L4], ("l4", "bf16")),  # bf16 wherever it fits, before a smaller level
        (7, [T4], ("t4", "int8")),
        (13, [L4, T4], ("l4", "int8")),  # the largest level some node type fits
        (13, [T4], ("t4", "int4")),
        (40, [T4, L4], None),
    ],
)
def test_the_reference_is_bf16_else_the_largest_level_that_fits(
    billions: int, node_types: list[NodeType], expected: tuple[str, str] | None
) -> None:
    found = planner.reference_plan(request(billions), node_types, quality_job.EVAL_WINDOW_TOKENS)
    assert (found and (found.node_type.name, found.quantization)) == expected


def spec_7b(max_loss: float = 1.0) -> dict[str, Any]:
    evaluation = {
        "dataset": {"configMap": "eval", "key": "eval.txt"},
        "metric": "perplexity",
        "maxQualityLoss": max_loss,
    }
    return {
        "model": {"uri": URI, "parameters": 7 * 10**9, "layers": 32, "kvHeads": 8, "headDim": 128},
        "serving": {"maxContextLength": 512, "targetConcurrency": 1},
        "quantization": {"allowed": ["bf16", "int8", "int4"], "evaluation": evaluation},
        "placement": {"nodeTypes": ["t4"]},
        "autoscaling": {"mode": "off", "replicas": 1},
    }


def int8_reference() -> planner.NodePlan:
    found = planner.reference_plan(request(7), [T4], quality_job.EVAL_WINDOW_TOKENS)
    assert found is not None and found.quantization == "int8"
    return found


def test_with_an_int8_reference_bf16_is_excluded_and_the_rest_measured_against_int8() -> None:
    s = api.parse_spec(spec_7b())
    verdict = admission.assess(
        md(spec_7b()), s, admission.Observed(DIGEST), int8_reference(), CONFIG, NOW
    )
    assert verdict.admission.excluded == ("bf16: fits no node type",)
    assert verdict.admission.pending == ("int8", "int4")
    jobs = verdict.jobs_to_create
    assert [j["metadata"]["annotations"][quality_job.ANNOTATION_LEVEL] for j in jobs] == [
        "int8",
        "int4",
    ]
    for made in jobs:
        assert made["metadata"]["annotations"][quality_job.ANNOTATION_REFERENCE] == "int8"
        (container,) = made["spec"]["template"]["spec"]["containers"]
        assert container["args"][-1] == "--baseline=int8"
    # another reference, another Job: a loss against int8 is not a loss against bf16
    assert jobs[0]["metadata"]["name"] == quality_job.job_name(
        URI, "int8", "perplexity", DIGEST, "int8"
    )
    assert jobs[0]["metadata"]["name"] != quality_job.job_name(URI, "int8", "perplexity", DIGEST)
    assert verdict.condition is not None and verdict.condition.reason == "Measuring"
    assert "loss vs int8, the largest level a node type fits" in verdict.condition.message


def test_a_measurement_against_int8_says_so_and_is_cached_apart() -> None:
    s = api.parse_spec(spec_7b(max_loss=1.0))
    names = {
        q: quality_job.job_name(URI, q, "perplexity", DIGEST, "int8") for q in ("int8", "int4")
    }
    done = job("Complete")
    done["metadata"]["annotations"][quality_job.ANNOTATION_REFERENCE] = "int8"
    runs = {
        names["int8"]: admission.EvalRun(done, [summary_pod("int8", 150.0, 0.0)]),
        names["int4"]: admission.EvalRun(done, [summary_pod("int4", 154.5, 0.03)]),
    }
    observed = admission.Observed(DIGEST, runs=runs)
    verdict = admission.assess(md(spec_7b()), s, observed, int8_reference(), CONFIG, NOW)
    assert [(m.level, m.reference, m.relative_loss) for m in verdict.measurements] == [
        ("int8", "int8", 0.0),
        ("int4", "int8", 3.0),
    ]
    assert sorted(verdict.new_records) == sorted(
        admission.record_key(q, "perplexity", DIGEST, "int8") for q in ("int8", "int4")
    )
    assert all(".vs-int8." in key for key in verdict.new_records)
    assert verdict.admission.levels == ("int8",)  # int4 is 3% worse than int8: over budget
    assert verdict.condition is not None and verdict.condition.status == "True"
    assert "bf16: fits no node type" in verdict.condition.message
    # A bf16-referenced record of the same level does not stand in for it, nor it for one.
    bf16_records = {
        admission.record_key("int8", "perplexity", DIGEST): verdict.new_records[
            admission.record_key("int8", "perplexity", DIGEST, "int8")
        ]
    }
    assert admission.cached(bf16_records, ["int8"], "perplexity", DIGEST, "int8") == {}


def test_the_pass_uses_the_reference_of_the_inventory_and_status_names_it() -> None:
    records = {
        admission.record_key(q, "perplexity", DIGEST, "int8"): api.QualityMeasurement(
            level=q,
            metric="perplexity",
            value=150.0,
            relative_loss=loss,
            dataset_digest=DIGEST,
            reference="int8",
        ).model_dump_json(by_alias=True)
        for q, loss in (("int8", 0.0), ("int4", 0.4))
    }
    observed = admission.Observed(DIGEST, records=records)
    seen = desired_state.Observed(node_types=(T4,), quality=observed, now=NOW)
    desired = desired_state.desire(md(spec_7b()), CONFIG, seen)
    assert desired.error is None and desired.quantization == "int8"
    status = desired_state.build_status(md(spec_7b()), typed_status.EMPTY, desired, [], CONFIG, NOW)
    assert [(q["level"], q["reference"]) for q in status["quality"]] == [
        ("int8", "int8"),
        ("int4", "int8"),
    ]
    measured = next(c for c in status["conditions"] if c["type"] == "QualityMeasured")
    assert measured["status"] == "True"
    assert "vs int8, the largest level a node type fits" in measured["message"]
