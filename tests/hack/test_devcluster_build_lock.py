"""Two builds of one component wait for each other (hack/devcluster/build.py: build_lock)."""

from __future__ import annotations

import threading

import pytest

from hack.devcluster import build
from hack.devcluster.versions import Component


def test_a_second_build_of_the_same_component_waits_for_the_first(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    component = Component("kwok", "v0.0.0-test", ("kwok",))
    entered = threading.Event()

    def second_build() -> None:
        with build.build_lock(component):
            entered.set()

    with build.build_lock(component):
        other = threading.Thread(target=second_build)
        other.start()
        assert not entered.wait(0.3), "the second build ran while the first held the lock"
    assert entered.wait(5), "the second build never ran after the first released the lock"
    other.join()
