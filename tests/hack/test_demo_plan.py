"""The demo's plan table: the measured quality loss next to each node type's level."""

from __future__ import annotations

from hack.demo import plan_rows, table


def test_the_plan_table_shows_measured_loss_or_a_dash() -> None:
    plan = [
        {
            "nodeType": "l4-24gb",
            "fits": True,
            "quantization": "int8",
            "qualityLoss": 0.31,
            "tensorParallel": 1,
            "weightsGiB": 7.1,
            "kvCacheGiB": 8.0,
            "maxConcurrency": 12,
            "pricePerHour": 0.98,
            "reason": "l4-24gb: int8, fits",
        },
        {
            "nodeType": "t4-16gb",
            "fits": True,
            "quantization": "int4",
            "qualityLoss": -0.02,
            "tensorParallel": 1,
            "pricePerHour": 0.53,
        },
        {"nodeType": "a100-40gb", "fits": True, "quantization": "bf16", "qualityLoss": None},
        {"nodeType": "h100-80gb", "fits": False, "reason": "h100-80gb: no free GPU"},
    ]
    header, l4, t4, a100, h100 = plan_rows(plan)
    assert header[:4] == ["NODE TYPE", "FITS", "QUANT", "LOSS %"]
    assert l4[:4] == ["l4-24gb", "yes", "int8", "+0.31"]
    assert t4[2:4] == ["int4", "-0.02"]
    assert a100[2:4] == ["bf16", "-"]  # not measured (no eval set, or not yet)
    assert h100[1:4] == ["no", "-", "-"]
    lines = table(plan_rows(plan)).splitlines()
    assert lines[0].split()[:5] == ["NODE", "TYPE", "FITS", "QUANT", "LOSS"]
    assert lines[1].split()[:4] == ["l4-24gb", "yes", "int8", "+0.31"]
