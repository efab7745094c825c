"""Planner inputs for pre-quantised checkpoints: Qwen2.5-7B-Instruct-AWQ and its bf16 sibling's
facts, GPU node types by memory, and a plan request (tests/operator/test_planner_prequantized.py
works their figures out by hand)."""

from __future__ import annotations

from typing import Any

from kvpilot.contract.memory import ModelFacts
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.planning.model_facts import facts_from_config_json
from tests.support.checkpoint_configs import QWEN25_7B, QWEN25_7B_AWQ, QWEN25_7B_PARAMETERS

CONFIG = OperatorConfig(runtime_image="registry.local/kvpilot-runtime:test")


def no_header_read() -> int:
    raise AssertionError("a pre-quantised checkpoint's parameters come from its shapes")


AWQ = facts_from_config_json(QWEN25_7B_AWQ, no_header_read, "model", "")
BF16 = facts_from_config_json(QWEN25_7B, lambda: QWEN25_7B_PARAMETERS, "model", "")


def pool(name: str, mib: int, gpus: int = 1) -> NodeType:
    return NodeType(name, "", mib, gpus, 1.0, {"t": name}, ("n",), (gpus,))


GTX_10GB = pool("rtx3080-10gb", 10240)  # usable 9.0 GiB
T4 = pool("t4-16gb", 15360)  # usable 13.5 GiB
L4 = pool("l4-24gb", 23034)  # usable 20.2 GiB
T4X4 = pool("t4x4-16gb", 15360, 4)


def request(facts: ModelFacts, levels: tuple[str, ...], **overrides: Any) -> planner.PlanRequest:
    return planner.PlanRequest(
        facts=facts,
        quantizations=levels,
        max_context_length=8192,
        target_concurrency=8,
        **overrides,
    )
