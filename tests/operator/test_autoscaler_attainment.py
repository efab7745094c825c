"""SLO attainment from the TTFT histogram, and how status.autoscaling.slo records it (pure)."""

from __future__ import annotations

import math

import pytest

from kvpilot.operator import api, crdgen
from kvpilot.operator.autoscaling import attainment, recording
from kvpilot.operator.autoscaling.loop import is_news
from kvpilot.operator.autoscaling.policy import Observations

INF = math.inf
# Cumulative rates per upper bound, as `sum by (le) (rate(..._bucket[5m]))` returns them:
# 2/s at or under 0.25 s, 6/s under 0.5 s, 8/s under 1 s, 10/s in all.
FLEET = {0.25: 2.0, 0.5: 6.0, 1.0: 8.0, INF: 10.0}

CASES = [
    ("a bucket bound", FLEET, 0.5, 0.6),
    ("halfway through a bucket", FLEET, 0.75, 0.7),  # 6 + (8 - 6) / 2 of 10
    ("inside the first bucket, from zero", FLEET, 0.125, 0.1),
    ("beyond the last finite bound: only those counted under it", FLEET, 5.0, 0.8),
    ("every request under the target", {0.5: 4.0, 1.0: 4.0, INF: 4.0}, 0.6, 1.0),
    ("none under the target", {0.5: 0.0, 1.0: 0.0, INF: 3.0}, 0.4, 0.0),
]


@pytest.mark.parametrize(
    ("buckets", "target", "share"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_attainment_from_cumulative_buckets(
    buckets: dict[float, float], target: float, share: float
) -> None:
    met = attainment.from_buckets(buckets, target)
    assert met is not None
    assert met.share == pytest.approx(share)
    assert met.requests_per_s == buckets[INF]


@pytest.mark.parametrize(
    "buckets",
    [{}, {0.5: 0.0, INF: 0.0}, {0.5: 1.0}, {0.5: 1.0, INF: math.nan}],
    ids=["no series", "no requests in the window", "no +Inf bucket", "NaN total"],
)
def test_no_attainment_without_requests(buckets: dict[float, float]) -> None:
    assert attainment.from_buckets(buckets, 1.0) is None


def test_buckets_from_a_prometheus_vector() -> None:
    vector = [
        {"metric": {"le": "0.5"}, "value": [0, "3"]},
        {"metric": {"le": "+Inf"}, "value": [0, "4"]},
        {"metric": {"le": "1.0"}, "value": [0, "NaN"]},  # a window with one scrape
        {"metric": {}, "value": [0, "9"]},
    ]
    assert attainment.buckets_from_vector(vector) == {0.5: 3.0, INF: 4.0}


SLO = api.LatencySlo(ttft_seconds=1.0, percentile=95)


@pytest.mark.parametrize(
    ("share", "attained", "met"),
    [(0.97, 0.97, True), (0.95, 0.95, True), (0.9412345, 0.9412, False), (None, None, None)],
)
def test_slo_status_says_whether_the_percentile_holds(
    share: float | None, attained: float | None, met: bool | None
) -> None:
    seen = Observations(current_replicas=1, ttft_slo_attainment=share)
    patch = recording.slo_patch(SLO, seen)
    assert patch == {
        "ttftSeconds": 1.0,
        "percentile": 95,
        "windowSeconds": attainment.WINDOW_S,
        "attainment": attained,
        "tpotSeconds": None,
        "tpotAttainment": None,
        "met": met,
    }
    if share is not None:  # what the patch writes reads back as the typed status
        assert api.SloStatus.model_validate(patch).met is met


TPOT_SLO = api.LatencySlo(ttft_seconds=1.0, tpot_seconds=0.05, percentile=95)


@pytest.mark.parametrize(
    ("ttft_share", "tpot_share", "met"),
    [
        (0.97, 0.96, True),
        (0.97, 0.90, False),  # the TTFT holds, the TPOT does not
        (0.90, 0.99, False),
        (None, 0.99, True),  # what was measured holds
        (0.97, None, True),  # no request made two tokens yet
        (None, None, None),
    ],
)
def test_a_tpot_target_is_reported_and_must_hold_too(
    ttft_share: float | None, tpot_share: float | None, met: bool | None
) -> None:
    seen = Observations(
        current_replicas=1, ttft_slo_attainment=ttft_share, tpot_slo_attainment=tpot_share
    )
    patch = recording.slo_patch(TPOT_SLO, seen)
    assert patch is not None
    assert (patch["tpotSeconds"], patch["tpotAttainment"], patch["met"]) == (0.05, tpot_share, met)
    assert api.SloStatus.model_validate(patch).tpot_attainment == tpot_share
    # Without a TPOT target a stray TPOT share is neither written nor judged
    plain = recording.slo_patch(SLO, seen)
    assert plain is not None and plain["tpotAttainment"] is None


def test_no_slo_status_without_an_slo() -> None:
    assert recording.slo_patch(None, Observations(current_replicas=1)) is None


def test_attainment_is_news_to_the_percentage_point() -> None:
    written = {"ttftSeconds": 1.0, "percentile": 95, "windowSeconds": 300, "attainment": 0.97}
    old = api.AutoscalingStatus.model_validate({"slo": {**written, "met": True}})
    assert not is_news(old, {"slo": {**written, "attainment": 0.9701, "met": True}})
    assert is_news(old, {"slo": {**written, "attainment": 0.99, "met": True}})
    assert is_news(old, {"slo": {**written, "attainment": 0.90, "met": False}})
    with_tpot = {**written, "tpotSeconds": 0.05, "tpotAttainment": 0.96, "met": True}
    old_tpot = api.AutoscalingStatus.model_validate({"slo": with_tpot})
    assert not is_news(old_tpot, {"slo": {**with_tpot, "tpotAttainment": 0.9612}})
    assert is_news(old_tpot, {"slo": {**with_tpot, "tpotAttainment": 0.93}})
    assert not is_news(
        api.AutoscalingStatus.model_validate({"slo": {**written, "attainment": None}}),
        {"slo": {**written, "attainment": None, "met": None}},
    )


def test_the_crd_requires_only_what_every_slo_patch_writes() -> None:
    # A null in the merge patch removes the field: the CRD must not require attainment or met.
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    autoscaling = schema["properties"]["status"]["properties"]["autoscaling"]
    required = set(autoscaling["properties"]["slo"].get("required", []))
    patch = recording.slo_patch(SLO, Observations(current_replicas=0))
    assert patch is not None
    assert required and required <= {k for k, v in patch.items() if v is not None}
