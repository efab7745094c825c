"""The table `kvpilot-runtime eval` prints (eval_report.format_table): every value ends under the
right end of its column's header, whatever the labels' widths, the KV cache dtype or the signs."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.runtime.eval_report import format_table

HEADERS = ("level", "rel. loss", "weight MiB")  # the metric's own name is the second column's


def row(value: float, loss: float, mib: float, **extra: Any) -> dict[str, Any]:
    return {"value": value, "relative_loss": loss, "weight_bytes": int(mib * 2**20), **extra}


def result(levels: dict[str, Any], checkpoints: dict[str, Any], kv: str, metric: str) -> Any:
    return {
        "model": "tiny-llama",
        "dataset": "eval.txt",
        "num_samples": 3,
        "num_tokens": 120,
        "kv_cache_dtype": kv,
        "metric": metric,
        "baseline": {"quantization": "bf16", **row(140.0, 0.0, 7.3)},
        "levels": levels,
        "checkpoints": checkpoints,
    }


CASES = [
    result({"int8": row(141.2, 0.0086, 3.7)}, {}, "auto", "perplexity"),
    result({"int8": row(0.91, -0.0123, 3.7), "int4": row(0.5, 0.45, 1.9)}, {}, "fp8", "agreement"),
    result({}, {"awq-instruct-int4": row(150.5, 1.5, 1.9, level="int4")}, "auto", "exact-match"),
]


def column_ends(header: str) -> list[int]:
    """Where each right-aligned column ends: after the metric's name and each later title."""
    _, metric, *_ = header.split()
    titles = [metric, *HEADERS[1:]]
    ends, start = [], 0
    for title in titles:
        start = header.index(title, start) + len(title)
        ends.append(start)
    return ends


@pytest.mark.parametrize("found", CASES)
def test_each_value_ends_under_its_columns_header(found: dict[str, Any]) -> None:
    _, header, *rows = format_table(found).splitlines()
    assert header.startswith(HEADERS[0]) and found["metric"] in header
    assert len(rows) == 1 + len(found["levels"]) + len(found["checkpoints"])  # baseline first
    ends = column_ends(header)
    for line in rows:
        assert len(line) == len(header), (header, line)
        for end in ends:
            assert line[end - 1] != " " and line[end : end + 1] in ("", " "), (header, line)
