"""A spec that states spec.model's architecture facts itself (parameters, layers, kvHeads,
headDim) still has its hf:// or s3:// config.json read: the facts do not say whether the
checkpoint is pre-quantised, and the runtime reads that at start and refuses a conflicting
--quantization. The stated facts give the architecture, config.json the checkpoint's level and
bytes; where config.json cannot be read, the plan is the stated facts' 16-bit one, and says so."""

from __future__ import annotations

import pytest

from kvpilot.contract import catalog, checkpoint_quant, serve_config
from kvpilot.contract.memory import ModelFacts
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.planning.model_facts import facts_from_config_json, needs_reading
from kvpilot.operator.reconcile import desired_state
from tests.support.checkpoint_configs import (
    QWEN25_7B_AWQ,
    QWEN25_7B_LAYER,
    QWEN25_7B_PARAMETERS,
)

MD = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}
CONFIG = OperatorConfig(runtime_image="registry.local/kvpilot-runtime:test")
L4 = NodeType("l4-24gb", "", 23034, 1, 1.0, {"t": "l4"}, ("n",), (1,))
STATED = {"parameters": QWEN25_7B_PARAMETERS, "layers": 28, "kvHeads": 4, "headDim": 128}
URI = "hf://Qwen/Qwen2.5-7B-Instruct-AWQ"  # not in the catalog
AWQ = facts_from_config_json(QWEN25_7B_AWQ, lambda: 0, "model", "")
AWQ_WEIGHTS = (
    28 * QWEN25_7B_LAYER * (0.5 + 4 / 128) + (QWEN25_7B_PARAMETERS - 28 * QWEN25_7B_LAYER) * 2
)
UNREAD = "cannot read the model's config.json: 401 Unauthorized"


@pytest.mark.parametrize(
    ("uri", "facts", "expected"),
    [
        (URI, STATED, True),  # stated facts no longer spare the read
        (URI, {}, True),
        ("s3://models/qwen-awq", STATED, True),
        ("hf://Qwen/Qwen2.5-7B-Instruct", {}, False),  # a catalog entry: a 16-bit checkpoint
        ("hf://Qwen/Qwen2.5-7B-Instruct", STATED, False),
        ("pvc://models/qwen-awq", STATED, False),  # the operator cannot read a claim
        ("file:///models/qwen-awq", STATED, False),
    ],
)
def test_which_sources_the_operator_reads(uri: str, facts: dict[str, int], expected: bool) -> None:
    model = api.ModelSource.model_validate({"uri": uri, **facts})
    assert needs_reading(model) is expected


def desire(
    read: desired_state.Read | None, allowed: list[str], uri: str = URI
) -> desired_state.Desired:
    model = {"uri": uri, **STATED}
    spec = {"model": model, "serving": {"maxContextLength": 8192}}
    md = MD | {"spec": spec | {"quantization": {"allowed": allowed}}}
    observed = desired_state.Observed(node_types=(L4,), source_facts=read)
    return desired_state.desire(md, CONFIG, observed)


def quantization_flag(desired: desired_state.Desired) -> str:
    (deployment,) = [c for c in desired.children if c["kind"] == "Deployment"]
    _, *args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(serve_config.build_parser().parse_args(args).quantization)


# What config.json said (or why it was not read) -> the level planned, the weights' GiB, and
# whether the runtime accepts the pod's --quantization for the AWQ checkpoint it will load.
@pytest.mark.parametrize(
    ("read", "allowed", "level", "weights", "runtime_accepts"),
    [
        (AWQ, ["bf16", "int8", "int4"], "int4", AWQ_WEIGHTS, True),  # the checkpoint's level
        (AWQ, ["int4"], "int4", AWQ_WEIGHTS, True),
        (UNREAD, ["bf16", "int8", "int4"], "bf16", QWEN25_7B_PARAMETERS * 2, False),
    ],
)
def test_the_level_planned_from_stated_facts_and_config_json(
    read: ModelFacts | str,
    allowed: list[str],
    level: str,
    weights: float,
    runtime_accepts: bool,
) -> None:
    desired = desire(read, allowed)
    assert desired.error is None
    (entry,) = desired.plan
    assert (entry.quantization, entry.fits) == (level, True)
    assert entry.weights_gi_b == pytest.approx(weights / 2**30, abs=0.01)
    checkpoint = checkpoint_quant.parse_quantization_config(QWEN25_7B_AWQ)
    flag = quantization_flag(desired)
    try:
        checkpoint_quant.resolve_quantization(flag, checkpoint)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted is runtime_accepts
    # an unread config.json is said where the plan is, so a refused pod has its explanation
    assert (UNREAD in desired.summary) is isinstance(read, str)


def test_a_pre_quantised_level_that_is_not_allowed_is_refused() -> None:
    desired = desire(AWQ, ["bf16", "int8"])
    assert desired.error is not None
    assert "int4" in desired.error


def test_stated_parameters_fewer_than_the_checkpoints_quantised_ones_are_refused() -> None:
    model = api.ModelSource.model_validate({"uri": URI, **STATED, "parameters": 1000})
    with pytest.raises(ValueError, match=r"spec\.model\.parameters 1000 is fewer than") as error:
        catalog.resolve(model, AWQ)
    assert AWQ.checkpoint is not None and AWQ.checkpoint.description in str(error.value)


def test_stated_facts_win_for_the_architecture_and_config_json_gives_the_checkpoint() -> None:
    model = api.ModelSource.model_validate({"uri": URI, **STATED, "vocabSize": 152064})
    facts = catalog.resolve(model, AWQ)
    assert (facts.parameters, facts.layers, facts.kv_heads, facts.head_dim) == (
        QWEN25_7B_PARAMETERS,
        28,
        4,
        128,
    )
    assert facts.checkpoint == AWQ.checkpoint


LOCAL_NOTE = "planned from spec.model's facts as a 16-bit checkpoint: the operator does not read"


# A file:// or pvc:// spec.model is not read (a node's path, a claim): without a configMapRef the
# Planned message says it was planned as 16-bit and how to give the operator its config.json.
@pytest.mark.parametrize(
    ("uri", "read", "scheme"),
    [
        ("file:///models/qwen-awq", None, "file"),
        ("pvc://models/qwen-awq", None, "pvc"),
        (URI, AWQ, None),  # read: planned at its own level, nothing to say
        ("hf://Qwen/Qwen2.5-7B-Instruct", None, None),  # the catalog's: a 16-bit checkpoint
    ],
)
def test_a_local_source_is_planned_as_16_bit_and_the_planned_message_says_so(
    uri: str, read: ModelFacts | None, scheme: str | None
) -> None:
    desired = desire(read, ["bf16", "int8", "int4"], uri)
    assert desired.error is None
    if scheme is None:
        assert LOCAL_NOTE not in desired.summary
        return
    assert desired.plan[0].quantization == "bf16"
    assert f"{LOCAL_NOTE} {scheme}:// sources" in desired.summary
    assert desired.summary.endswith(
        "give its config.json in a ConfigMap that spec.model.configMapRef names, where it is read"
    )
