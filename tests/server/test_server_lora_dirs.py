"""Adapters the runtime reads without fetching them, through a real server: an hf:// adapter
found in --lora-cache-dir (the operator's model cache), and pvc://CLAIM/PATH under
--lora-claims (where the operator mounts the claim), at start and through vLLM's load
endpoint. No hub answers here, so an adapter that is not in the cache is a 400 naming its URI."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from bench.reference.lora import MIXED_ADAPTERS, load_base, make_adapter
from kvpilot.contract.adapter_cache import entry_name
from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts a runtime process

CACHED = "hf://kvpilot/lora-cached"
PROMPT = [1, 9, 33, 17, 400, 12, 88, 1001, 7, 7, 7] * 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A plain directory per adapter, the cache holding qv8 as CACHED's entry, and a claim
    `loras` holding every adapter under tenant/."""
    base, root = load_base(), tmp_path_factory.mktemp("lora-dirs")
    for spec in MIXED_ADAPTERS:  # answers are compared between paths, not to a reference
        make_adapter(base, spec, root / "plain" / spec.name)
    shutil.copytree(root / "plain" / "qv8", root / "cache" / entry_name(CACHED))
    shutil.copytree(root / "plain", root / "claims" / "loras" / "tenant")
    return {"plain": root / "plain", "cache": root / "cache", "claims": root / "claims"}


@pytest.fixture(scope="module")
def server(start_server: Callable[..., RuntimeServer], dirs: dict[str, Path]) -> RuntimeServer:
    with pytest.MonkeyPatch.context() as env:  # the server process inherits it
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a fetch fails
        return start_server(
            "--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--attention-backend", "sdpa", "--dtype", "float32",
            f"--lora-cache-dir={dirs['cache']}", f"--lora-claims=loras={dirs['claims'] / 'loras'}",
            "--lora-modules", f"qv8={dirs['plain'] / 'qv8'}", "pvc-ko2=pvc://loras/tenant/ko2",
        )  # fmt: skip


def text(server: RuntimeServer, model: str) -> str:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def load(server: RuntimeServer, name: str, path: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)


def roots(server: RuntimeServer) -> dict[str, str]:
    cards = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["root"] for card in cards}


def test_an_adapter_in_the_cache_is_read_from_it_and_keeps_its_uri(server: RuntimeServer) -> None:
    loaded = load(server, "cached", CACHED)
    assert loaded.status_code == 200, loaded.text
    assert text(server, "cached") == text(server, "qv8") != text(server, MODEL)
    assert roots(server)["cached"] == CACHED  # what the operator asked for, not the entry


def test_a_pvc_adapter_is_read_under_its_claims_mount(
    server: RuntimeServer, dirs: dict[str, Path]
) -> None:
    assert roots(server)["pvc-ko2"] == "pvc://loras/tenant/ko2"  # --lora-modules at start
    loaded = load(server, "pvc-qv8", "pvc://loras/tenant/qv8")
    assert loaded.status_code == 200, loaded.text
    assert text(server, "pvc-qv8") == text(server, "qv8")
    assert text(server, "pvc-ko2") != text(server, "qv8")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("hf://kvpilot/not-cached", "hf://kvpilot/not-cached"),  # not in the cache: fetched
        ("pvc://loras/../etc", "may not contain '..'"),
        ("pvc://loras/tenant/none", "pvc://loras/tenant/none"),
        ("pvc://unmounted/qv8", "claim 'unmounted' is not mounted in this pod"),
    ],
)
def test_adapters_it_cannot_read_are_400s_naming_the_uri(
    server: RuntimeServer, path: str, message: str
) -> None:
    answer = load(server, "missing", path)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["param"] == "lora_path", error
