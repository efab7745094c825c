"""bench.model_cache_startup's tables from known pod starts: each phase's median per variant,
the new pod's own start (scheduled -> Ready) and the total, for replacements and scale-ups."""

from __future__ import annotations

from bench.model_cache_startup import PodStart, phases_table, scale_up_report
from bench.pod_phases import PHASES, SCALE_UP_PHASES


def start(parts: list[float], names: tuple[str, ...]) -> PodStart:
    return PodStart(sum(parts), dict(zip(names, parts, strict=True)))


def rows(table: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell (the header and the rule left out)."""
    lines = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in lines}


def test_own_start_is_scheduled_to_ready_whatever_started_the_pod() -> None:
    assert start([0.1, 6.0, 0.2, 2.0, 0.3], PHASES).own_start_s == 2.5
    assert start([0.5, 0.01, 0.2, 2.0, 0.3], SCALE_UP_PHASES).own_start_s == 2.5


def test_replacement_table_medians_per_variant() -> None:
    runs = {
        "per-pod": [start([0.1, 5.0, 3.0, 2.0, 0.2], PHASES),
                    start([0.3, 7.0, 5.0, 4.0, 0.4], PHASES),
                    start([0.2, 6.0, 4.0, 9.0, 0.3], PHASES)],
        "cached": [start([0.1, 1.0, 0.1, 2.0, 0.2], PHASES)],
    }  # fmt: skip
    got = rows(phases_table(runs))
    assert list(got) == [
        *PHASES,
        "scheduled -> Ready (the new pod's own start)",
        "delete -> Ready (total)",
    ]
    assert got["created -> scheduled"] == ["6.00", "1.00"]
    assert got["process created -> engine ready"] == ["4.00", "2.00"]
    # the median of each run's own start (7.3, 9.4, 13.3), not a sum of the phases' medians
    assert got["scheduled -> Ready (the new pod's own start)"] == ["9.40", "2.30"]
    assert got["delete -> Ready (total)"] == ["16.70", "3.40"]


def test_scale_up_report_has_its_runs_and_its_own_phases() -> None:
    scale_ups = {
        "cached": [start([0.4, 0.1, 0.1, 2.0, 0.3], SCALE_UP_PHASES),
                   start([0.6, 0.1, 0.1, 3.0, 0.2], SCALE_UP_PHASES)],
        "per-pod": [start([0.5, 0.1, 3.0, 2.5, 0.2], SCALE_UP_PHASES)],
    }  # fmt: skip
    report = scale_up_report(scale_ups)
    summary, phases = report.split("By phase:")
    assert rows(summary.strip()) == {"cached": ["3.45", "2.90 4.00"], "per-pod": ["6.30", "6.30"]}
    got = rows(phases.strip().split("\n\n")[0])
    assert got["written -> created"] == ["0.50", "0.50"]
    assert got["scheduled -> Ready (the new pod's own start)"] == ["2.85", "5.70"]  # 2.4 and 3.3
    assert got["written -> Ready (total)"] == ["3.45", "6.30"]
    assert "delete -> Ready (total)" not in got
