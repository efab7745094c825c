"""The API's timestamps, written and read in one place."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kvpilot.operator import timestamps

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
