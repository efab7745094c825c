"""Adapter-aware routing through real processes: a gateway in front of two tiny-llama replicas
with LoRA, one holding adapters qv8 and mlp4, the other only mlp4, asked with the official openai
client. An adapter is routed to its base model's replicas; once the gateway has read which
adapters each replica holds (kvpilot_lora_adapter_loaded), the one that lacks it is not tried (it
would answer 404); a replica running the adapter is preferred over the prompt's own replica; an
unknown adapter is the gateway's 404."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from bench.reference.lora import MIXED_ADAPTERS
from kvpilot.contract import serve_config
from kvpilot.gateway.routing.picking import ring_order
from tests.support.adapters import write_adapters
from tests.support.gateway_process import GatewayProcess, start_servers
from tests.support.server_process import MODEL, RuntimeServer, wait_for

pytestmark = pytest.mark.slow  # starts runtime and gateway processes

ARGS = ["--max-model-len", "2048", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--attention-backend", "sdpa"]  # fmt: skip


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    wanted = [spec for spec in MIXED_ADAPTERS if spec.name in ("qv8", "mlp4")]
    return write_adapters(wanted, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, adapter_dirs: dict[str, Path]
) -> Iterator[list[RuntimeServer]]:
    both = [
        f"--lora-modules=qv8={adapter_dirs['qv8']}",
        f"--lora-modules=mlp4={adapter_dirs['mlp4']}",
    ]
    only_mlp4 = [f"--lora-modules=mlp4={adapter_dirs['mlp4']}"]
    with pytest.MonkeyPatch.context() as env:  # the processes inherit it
        env.setenv(serve_config.LORA_RUNTIME_UPDATES_ENV, "true")
        started = start_servers([ARGS + both, ARGS + only_mlp4], tmp_path_factory.mktemp("lora"))
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def gateway(
    replicas: list[RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    config = {
        "models": [
            {"name": MODEL, "backends": [r.url for r in replicas], "adapters": ["qv8", "mlp4"]}
        ]
    }
    process = GatewayProcess(config, tmp_path_factory.mktemp("gateway"))
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


def client_of(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def backend_of(gateway: GatewayProcess, model: str, prompt: str) -> str:
    """Which replica answered `prompt` for `model` through the gateway (its URL)."""
    raw = client_of(gateway.url).completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=2
    )
    assert raw.parse().choices[0].text
    return raw.headers["x-kvpilot-backend"]


def homed_on(replica: RuntimeServer, replicas: list[RuntimeServer], count: int) -> list[str]:
    """Prompts whose ring walk starts at `replica` (where the prefix strategy sends them)."""
    names = tuple(sorted(r.url for r in replicas))
    prompts = (f"prompt {i}: tell me about tea" for i in range(1000))
    return [p for p in prompts if ring_order(p, names)[0] == replica.url][:count]


def test_models_lists_the_adapters_and_an_unknown_one_is_a_404(gateway: GatewayProcess) -> None:
    client = client_of(gateway.url)
    assert {m.id for m in client.models.list().data} == {MODEL, "qv8", "mlp4"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_an_adapter_one_replica_lacks_goes_to_the_one_that_holds_it(
    gateway: GatewayProcess, replicas: list[RuntimeServer]
) -> None:
    holder, other = replicas
    prompts = homed_on(other, replicas, 4)  # the prefix strategy alone would try `other` first

    def retries() -> float:
        return gateway.metric("kvpilot_gateway_retries_total", reason="adapter_not_loaded")

    def straight_to_holder() -> bool:
        before = retries()
        return backend_of(gateway, "qv8", prompts[0]) == holder.url and retries() == before

    # until its first scrape of `other` (every 2 s) the gateway may try it and take its 404
    wait_for(straight_to_holder, 30, "the gateway to know which replica holds qv8")
    before = retries()
    assert [backend_of(gateway, "qv8", p) for p in prompts[1:]] == [holder.url] * 3
    assert retries() == before  # `other` was never asked


def running_adapters(replica: RuntimeServer) -> str:
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    return line.split('running_lora_adapters="', 1)[1].split('"', 1)[0]


def test_a_replica_running_the_adapter_is_preferred_over_the_prompts_own(
    gateway: GatewayProcess, replicas: list[RuntimeServer]
) -> None:
    home, busy = replicas  # both hold mlp4; `busy` runs it, `home` is where the prompt hashes
    (prompt,) = homed_on(home, replicas, 1)
    assert backend_of(gateway, MODEL, prompt) == home.url  # the base model: the ring decides
    stop = threading.Event()

    def keep_running() -> None:  # mlp4 in `busy`'s batch for as long as the test needs
        client = client_of(busy.url)
        while not stop.is_set():
            for _ in client.completions.create(
                model="mlp4", prompt="a", max_tokens=1500, stream=True,
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                if stop.is_set():
                    break

    worker = threading.Thread(target=keep_running, daemon=True)
    worker.start()
    try:
        wait_for(lambda: "mlp4" in running_adapters(busy), 60, "mlp4 running on the busy replica")
        # the gateway reads it at its next scrape (every 2 s): from then on mlp4 goes to `busy`
        wait_for(lambda: backend_of(gateway, "mlp4", prompt) == busy.url, 30, "mlp4 to busy")
        assert [backend_of(gateway, "mlp4", prompt) for _ in range(3)] == [busy.url] * 3
        assert backend_of(gateway, MODEL, prompt) == home.url  # the base model is not moved
    finally:
        stop.set()
        worker.join(timeout=120)
