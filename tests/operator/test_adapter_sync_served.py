"""The adapter sync against real runtime processes: spec adapters loaded through their API
without a restart, a removed one unloaded, one that cannot be loaded named while the others are
served; and placed by demand over three pods, the hot adapter on every pod and the cold ones on
one each (the official openai client asks for each by name)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from bench.reference.lora import MIXED_ADAPTERS
from kvpilot.contract import serve_config
from kvpilot.operator.adapters import placement, pod_api, sync
from tests.support.adapters import write_adapters
from tests.support.gateway_process import start_servers
from tests.support.server_process import RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes


POD_ARGS = ["--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--attention-backend", "sdpa"]  # fmt: skip


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    dirs = write_adapters(MIXED_ADAPTERS, tmp_path_factory.mktemp("adapters"))
    return {name: f"file://{path}" for name, path in dirs.items()}


@pytest.fixture
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeServer]:
    """A runtime started as the operator starts one with spec.lora: slots, no adapters."""
    log = tmp_path_factory.mktemp("pod") / "runtime.log"
    with pytest.MonkeyPatch.context() as env:  # the process inherits it, as the pod's env
        env.setenv(serve_config.LORA_RUNTIME_UPDATES_ENV, "true")
        server = RuntimeServer(POD_ARGS, log)
    yield server
    assert server.stop() == 0


def converge(bases: dict[str, str], want: dict[str, str], slots: int = 4) -> sync.Synced:
    async def run() -> sync.Synced:
        async with httpx.AsyncClient() as client:
            return await sync.converge(client, bases, want, slots)

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
    synced = converge({"pod-0": pod.url}, first)
    assert [o.error for o in synced.outcomes] == [None, None]
    status = placement.statuses(first, synced.pods, synced.outcomes)
    assert [(s.name, s.pods, s.message) for s in status] == [
        ("qv8", ["pod-0"], ""),
        ("mlp4", ["pod-0"], ""),
    ]
    assert placement.condition(status, synced.plan, 1, 1).status == "True"
    assert answers(pod, "qv8") and answers(pod, "mlp4")

    # mlp4 removed, ko2 added, and one whose directory does not exist
    second = {"qv8": first["qv8"], "ko2": adapter_dirs["ko2"], "gone": "file:///no/such/dir"}
    synced = converge({"pod-0": pod.url}, second)
    verbs = sorted((o.action.verb, o.action.name, o.error is None) for o in synced.outcomes)
    assert verbs == [("load", "gone", False), ("load", "ko2", True), ("unload", "mlp4", True)]
    status = placement.statuses(second, synced.pods, synced.outcomes)
    condition = placement.condition(status, synced.plan, 1, 2)
    assert (condition.status, condition.reason) == ("False", "AdapterLoadFailed")
    assert condition.message.startswith("adapter gone: pod-0: 400 ")
    assert "/no/such/dir" in condition.message
    assert answers(pod, "qv8") and answers(pod, "ko2") and not answers(pod, "mlp4")

    # the next sync only retries what failed
    again = converge({"pod-0": pod.url}, second)
    assert [(o.action.verb, o.action.name) for o in again.outcomes] == [("load", "gone")]
    assert pod.process.pid == pid and pod.process.poll() is None  # never restarted


@pytest.fixture
def three_pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Three pods of one ModelDeployment with spec.lora {maxLoras: 2}: pod name -> base URL."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(serve_config.LORA_RUNTIME_UPDATES_ENV, "true")
        servers = start_servers([POD_ARGS] * 3, tmp_path_factory.mktemp("pods"))
    yield {f"pod-{i}": server.url for i, server in enumerate(servers)}
    for server in servers:
        assert server.stop() == 0


def converge_until_still(bases: dict[str, str], want: dict[str, str], slots: int) -> sync.Synced:
    """Syncs until one has nothing to do (a move takes two: load on the new pod, then unload
    from the old one)."""
    for _ in range(4):
        synced = converge(bases, want, slots)
        assert [o.error for o in synced.outcomes if o.error] == []
        if not synced.outcomes:
            return synced
    raise AssertionError(f"still moving adapters after 4 syncs: {synced.outcomes}")


def where(bases: dict[str, str], want: dict[str, str], slots: int) -> dict[str, list[str]]:
    synced = converge_until_still(bases, want, slots)
    status = placement.statuses(want, synced.pods, synced.outcomes)
    assert placement.condition(status, synced.plan, len(bases), 1).status == "True"
    return {s.name: s.pods for s in status}


def ask(url: str, model: str, times: int) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for _ in range(times):
        assert client.completions.create(model=model, prompt="Hi", max_tokens=1).choices


def test_the_hot_adapter_goes_to_every_pod_and_the_cold_ones_to_one_each(
    three_pods: dict[str, str], adapter_dirs: dict[str, str]
) -> None:
    slots = 2  # --max-cpu-loras, the runtime's default: --max-loras
    before = where(three_pods, adapter_dirs, slots)
    # before any traffic: as many copies as the slots allow (6 for 4 adapters), none left out
    assert all(before.values()) and sum(len(pods) for pods in before.values()) == 6

    # qv8 asked for 12 times as often as each of the others, on the pods that hold each
    for name, pods in before.items():
        ask(three_pods[pods[0]], name, 12 if name == "qv8" else 1)
    counted = {name: 0.0 for name in adapter_dirs}
    for base in three_pods.values():  # what the operator reads: the runtime's own counter
        for name, count in asyncio.run(requests_by_adapter(base)).items():
            counted[name] += count
    assert counted == {name: (12.0 if name == "qv8" else 1.0) for name in adapter_dirs}

    after = where(three_pods, adapter_dirs, slots)
    assert after["qv8"] == sorted(three_pods)  # hot: on every pod
    assert all(len(after[name]) == 1 for name in adapter_dirs if name != "qv8")  # cold: one
    for name, pods in after.items():  # each served where status says, and only there
        for pod, base in three_pods.items():
            if pod in pods:
                ask(base, name, 1)
            else:
                with pytest.raises(openai.NotFoundError):
                    ask(base, name, 1)
    assert where(three_pods, adapter_dirs, slots) == after  # stable: the next sync moves nothing


async def requests_by_adapter(base: str) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        return await pod_api.requests_by_adapter(client, base)
