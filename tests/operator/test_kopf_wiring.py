"""handlers.NoDiffBase is right only while kvpilot registers no handler that reads kopf's diff
base: none that detects changes (create/update/resume/field/delete), no daemon, no timer."""

from __future__ import annotations

import kopf

from kvpilot.operator import handlers


def test_no_registered_handler_reads_the_diff_base() -> None:
    registry = kopf.get_default_registry()
    assert handlers.md_event in [h.fn for h in registry._watching.get_all_handlers()]
    assert registry._changing.get_all_handlers() == []
    assert registry._spawning.get_all_handlers() == []


def test_the_diff_base_builds_and_keeps_nothing() -> None:
    storage = handlers.NoDiffBase()
    body = kopf.Body({"metadata": {"name": "m", "labels": {"a": "b"}}, "spec": {"x": [1, 2]}})
    assert storage.build(body=body) == {}
    assert storage.fetch(body=body) is None
    storage.store(body=body, patch=kopf.Patch(), essence=kopf.BodyEssence(spec={"x": 1}))
    assert storage.fetch(body=body) is None
