"""Which source a node type serves when several fit at its level (planning/choice.py): the
fewest GPUs per replica, then a source of known quality (measured, or served as published) before
kvpilot's own unmeasured quantisation, then the fewest weight bytes, then the lower measured loss,
then spec order; and status.plan[].reason says which of these decided.

Qwen2.5-7B on a T4 (usable 13.5 GiB, maxContextLength 8192 x 8): bf16 does not fit; at int4
kvpilot's own quantisation of the bf16 checkpoint holds 3.77 GiB of weights, the AWQ and GPTQ
checkpoints (group 128, embeddings and lm_head left at 16 bits) 5.26 each
(tests/operator/test_planner_prequantized.py works these out)."""

from __future__ import annotations

import pytest

from kvpilot.contract.memory import GIB
from kvpilot.operator.planning import choice, planner
from kvpilot.operator.planning.model_facts import facts_from_config_json
from tests.support.checkpoint_configs import QWEN25_7B_GPTQ
from tests.support.prequant_plans import AWQ, BF16, T4, no_header_read, request

GPTQ = facts_from_config_json(QWEN25_7B_GPTQ, no_header_read, "variant gptq", "")


def fit(
    label: str, tp: int, gib: float, loss: float | None, order: int, *, rtn: bool = False
) -> choice.Fit:
    return choice.Fit(label, tp, gib * GIB, loss, order, quantized_by_kvpilot=rtn)


A = "spec.model"
B = "variant awq"


# (a, b): two sources that fit -> the winner and what decided against the other
@pytest.mark.parametrize(
    ("a", "b", "winner", "why"),
    [
        (fit(A, 2, 3.0, None, 0), fit(B, 1, 5.0, None, 1), B, "1 vs 2 GPUs per replica"),
        (fit(A, 1, 3.77, None, 0), fit(B, 1, 5.26, 0.1, 1), A, "weights 3.77 vs 5.26 GiB"),
        (fit(A, 1, 5.0, 1.2, 0), fit(B, 1, 5.0, 0.8, 1), B, "measured loss +0.80% vs +1.20%"),
        (fit(A, 1, 5.0, None, 0), fit(B, 1, 5.0, 2.0, 1), B, "measured loss +2.00% vs not"),
        (fit(A, 1, 5.0, -0.5, 0), fit(B, 1, 5.0, None, 1), A, "measured loss -0.50% vs not"),
        (fit(A, 1, 5.0, 1.0, 0), fit(B, 1, 5.0, 1.0, 1), A, "listed first"),
        (fit(A, 1, 5.0, None, 0), fit(B, 1, 5.0, None, 1), A, "listed first"),
        (fit(A, 1, 0.002, None, 0), fit(B, 1, 0.004, None, 1), A, "weights 2.0 vs 4.1 MiB"),
        # kvpilot's int4 of the bf16 weights, unmeasured, against a published checkpoint
        (fit(A, 1, 3.77, None, 0, rtn=True), fit(B, 1, 5.26, None, 1), B, "served as published"),
        (fit(A, 2, 3.77, None, 0, rtn=True), fit(B, 4, 5.26, None, 1), A, "2 vs 4 GPUs"),
        # ... measured by the gate: the cheapest within the budget
        (fit(A, 1, 3.77, 0.5, 0, rtn=True), fit(B, 1, 5.26, None, 1), A, "weights 3.77 vs 5.26"),
        (fit(A, 1, 3.77, 0.5, 0, rtn=True), fit(B, 1, 5.26, 0.2, 1), A, "weights 3.77 vs 5.26"),
    ],
)
def test_the_cheapest_source_wins_and_the_reason_names_what_decided(
    a: choice.Fit, b: choice.Fit, winner: str, why: str
) -> None:
    for fits in ([a, b], [b, a]):  # the order they are given in does not matter
        found = choice.best(fits)
        assert found.label == winner
        loser = b if winner == a.label else a
        assert choice.explain(found, fits).startswith(f"{winner} over {loser.label} ({why}")


def test_a_source_alone_needs_no_reason_and_none_is_an_error() -> None:
    alone = fit(A, 1, 1.0, None, 0)
    assert choice.explain(alone, [alone]) == ""
    with pytest.raises(ValueError, match="no source fits"):
        choice.best([])


BOTH = (("awq", AWQ), ("gptq", GPTQ))


# spec.model (bf16) with AWQ and GPTQ variants on a T4; the gate's admitted (source, level)
# pairs and measured losses -> the source served and status.plan[].reason
@pytest.mark.parametrize(
    ("admitted", "losses", "served", "reason"),
    [
        (
            None,  # no eval set: the published checkpoints before kvpilot's unmeasured int4
            {},
            "awq",
            "variant awq over variant gptq (listed first), spec.model (served as published;"
            " kvpilot's own quantisation of it is not measured)",
        ),
        (
            (("", "int4"), ("awq", "int4"), ("gptq", "int4")),  # all measured, within budget
            {"int4": 1.5, "variant:awq": 1.2, "variant:gptq": 0.8},
            "",
            "spec.model over variant awq (weights 3.77 vs 5.26 GiB per GPU),"
            " variant gptq (weights 3.77 vs 5.26 GiB per GPU)",
        ),
        (
            (("awq", "int4"), ("gptq", "int4")),  # kvpilot's int4 over budget: the same bytes
            {"variant:awq": 1.2, "variant:gptq": 0.8},
            "gptq",
            "variant gptq over variant awq (measured loss +0.80% vs +1.20%)",
        ),
        (
            (("awq", "int4"), ("gptq", "int4")),
            {"variant:awq": 0.9, "variant:gptq": 0.9},
            "awq",
            "variant awq over variant gptq (listed first)",
        ),
        ((("", "int8"), ("gptq", "int4")), {"variant:gptq": 0.8}, "gptq", ""),  # alone at int4
    ],
)
def test_per_node_type_the_cheapest_admitted_source_is_served_saying_why(
    admitted: tuple[tuple[str, str], ...] | None,
    losses: dict[str, float],
    served: str,
    reason: str,
) -> None:
    req = request(
        BF16, ("int4", "int8"), variants=BOTH, admitted=admitted, losses=tuple(losses.items())
    )
    (plan,) = planner.plan(req, [T4])
    assert (plan.fits, plan.variant, plan.quantization, plan.tensor_parallel) == (
        True,
        served,
        "int4",
        1,
    )
    (entry,) = planner.status_entries([plan], [1], losses)
    assert entry.reason == reason
    assert entry.quality_loss == losses.get(planner.loss_key(served, "int4"))
    if reason:
        assert plan.reason.endswith(f"; {reason}")  # the planner's own text says it too


def test_the_level_comes_before_the_cost_within_it() -> None:
    """int8 first in preference: kvpilot's int8 (7.09 GiB) fits a T4 and is served although
    kvpilot's int4 and both checkpoints hold fewer bytes; it is alone at its level."""
    (plan,) = planner.plan(request(BF16, ("int8", "int4"), variants=BOTH), [T4])
    assert (plan.variant, plan.quantization, plan.choice) == ("", "int8", "")
