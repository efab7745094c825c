"""The adapter sync against a real runtime process: spec adapters loaded through its API
without a restart, a removed one unloaded, one that cannot be loaded named while the others are
served (the official openai client asks for each by name)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from bench.reference.lora import MIXED_ADAPTERS, load_base, make_adapter
from kvpilot.contract import serve_config
from kvpilot.operator.adapters import placement, sync
from tests.support.server_process import RuntimeServer

pytestmark = pytest.mark.slow  # starts a runtime process


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base, root = load_base(), tmp_path_factory.mktemp("adapters")
    for spec in MIXED_ADAPTERS:
        make_adapter(base, spec, root / spec.name)
    return {spec.name: f"file://{root / spec.name}" for spec in MIXED_ADAPTERS}


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeServer]:
    """A runtime started as the operator starts one with spec.lora: slots, no adapters."""
    log = tmp_path_factory.mktemp("pod") / "runtime.log"
    with pytest.MonkeyPatch.context() as env:  # the process inherits it, as the pod's env
        env.setenv(serve_config.LORA_RUNTIME_UPDATES_ENV, "true")
        server = RuntimeServer(
            ["--max-model-len", "256", "--enable-lora", "--max-loras", "2",
             "--max-lora-rank", "16", "--attention-backend", "sdpa"],
            log,
        )  # fmt: skip
    yield server
    assert server.stop() == 0


Converged = tuple[list[placement.PodAdapters], list[placement.Outcome]]


def converge(server: RuntimeServer, want: dict[str, str]) -> Converged:
    async def run() -> Converged:
        async with httpx.AsyncClient() as client:
            return await sync.converge(client, {"pod-0": server.url}, want)

    return asyncio.run(run())


def answers(server: RuntimeServer, model: str) -> bool:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        out = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    except openai.NotFoundError:
        return False
    return out.model == model and len(out.choices[0].text) > 0


def test_spec_adapters_are_loaded_changed_and_unloaded_in_a_running_pod(
    pod: RuntimeServer, adapter_dirs: dict[str, str]
) -> None:
    pid = pod.process.pid
    first = {"qv8": adapter_dirs["qv8"], "mlp4": adapter_dirs["mlp4"]}
    held, outcomes = converge(pod, first)
    assert [o.error for o in outcomes] == [None, None]
    status = placement.statuses(first, held, outcomes)
    assert [(s.name, s.pods, s.message) for s in status] == [
        ("qv8", ["pod-0"], ""),
        ("mlp4", ["pod-0"], ""),
    ]
    assert placement.condition(status, 1, 1).status == "True"
    assert answers(pod, "qv8") and answers(pod, "mlp4")

    # mlp4 removed, ko2 added, and one whose directory does not exist
    second = {"qv8": first["qv8"], "ko2": adapter_dirs["ko2"], "gone": "file:///no/such/dir"}
    held, outcomes = converge(pod, second)
    verbs = sorted((o.action.verb, o.action.name, o.error is None) for o in outcomes)
    assert verbs == [("load", "gone", False), ("load", "ko2", True), ("unload", "mlp4", True)]
    status = placement.statuses(second, held, outcomes)
    condition = placement.condition(status, 1, 2)
    assert (condition.status, condition.reason) == ("False", "AdapterLoadFailed")
    assert condition.message.startswith("adapter gone: pod-0: 400 ")
    assert "/no/such/dir" in condition.message
    assert answers(pod, "qv8") and answers(pod, "ko2") and not answers(pod, "mlp4")

    # the next sync only retries what failed
    _, outcomes = converge(pod, second)
    assert [(o.action.verb, o.action.name) for o in outcomes] == [("load", "gone")]
    assert pod.process.pid == pid and pod.process.poll() is None  # never restarted
