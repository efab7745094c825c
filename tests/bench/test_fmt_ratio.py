"""bench.engine_common.fmt_ratio: the figure shown agrees with the verdict beside it."""

from __future__ import annotations

import pytest

from bench.engine_common import fmt_ratio


@pytest.mark.parametrize(
    ("value", "target", "expected"),
    [
        (0.78, 0.75, "0.78x (target >= 0.75x: met)"),
        (0.5, 0.6, "0.50x (target >= 0.6x: not met)"),
        (0.598, 0.6, "0.598x (target >= 0.6x: not met)"),
        (0.5999, 0.6, "0.5999x (target >= 0.6x: not met)"),
        (0.6, 0.6, "0.60x (target >= 0.6x: met)"),
        (0.7496, 0.75, "0.7496x (target >= 0.75x: not met)"),
        (1.004, 1.0, "1.00x (target >= 1.0x: met)"),
        (0.59999, 0.6, "0.59999x (target >= 0.6x: not met)"),
    ],
)
def test_the_shown_ratio_agrees_with_its_verdict(
    value: float, target: float, expected: str
) -> None:
    assert fmt_ratio(value, target) == expected
