"""The API's timestamps, written and read in one place."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from kubernetes.client import ApiClient, EventsV1Event

from kvpilot.contract import timestamps

MOMENT = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)


@pytest.mark.parametrize(
    ("stamp", "unix"),
    [
        ("2026-01-02T03:04:05Z", 1767323045.0),  # metav1.Time
        ("2026-01-02T03:04:05.000006Z", 1767323045.000006),  # metav1.MicroTime
        ("2026-01-02T04:04:05+01:00", 1767323045.0),  # an offset, as some clients write
    ],
)
def test_unix_reads_every_form_the_api_writes(stamp: str, unix: float) -> None:
    assert timestamps.unix(stamp) == pytest.approx(unix, abs=1e-6)


def test_written_times_read_back() -> None:
    assert timestamps.rfc3339(MOMENT) == "2026-01-02T03:04:05Z"
    assert timestamps.micro_time(MOMENT) == "2026-01-02T03:04:05.000006Z"
    assert timestamps.parse(timestamps.micro_time(MOMENT)) == MOMENT
    assert timestamps.rfc3339_from_unix(timestamps.unix("2026-01-02T03:04:05Z")) == (
        "2026-01-02T03:04:05Z"
    )


MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")


@pytest.mark.parametrize(
    ("moment", "written"),
    [
        (MOMENT, MOMENT),  # a fraction: as it is
        (MOMENT.replace(microsecond=0), MOMENT.replace(microsecond=1)),  # whole: one µs on
        (datetime(2026, 1, 2, 3, 4, 5, 999999, tzinfo=UTC), None),
    ],
)
def test_client_micro_time_writes_the_six_digits_the_api_reads(
    moment: datetime, written: datetime | None
) -> None:
    got = timestamps.client_micro_time(moment)
    assert got == (written or moment)
    # as the typed client serialises a model's datetime (eventTime of an events.k8s.io Event)
    serialised = ApiClient().sanitize_for_serialization(EventsV1Event(event_time=got))
    assert MICRO_TIME.fullmatch(serialised["eventTime"])
