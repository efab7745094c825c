"""LoRA adapters through a real server and the official openai client: an adapter named as the
`model` answers as transformers + peft does, /v1/models lists adapters with their parent, vLLM's
load/unload endpoints with their bodies and status codes, the 404 and 400 bodies, and
vllm:lora_requests_info; adapters named by hf:// and s3:// URIs, fetched from the dev model
servers (olah as the Hugging Face hub, SeaweedFS as S3), at start and through the endpoint."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from safetensors.torch import save_file

from bench.reference.lora import MIXED_ADAPTERS, load_base, make_adapter, reference_logprobs
from hack.devcluster.modelsources import make_hf_mirror, s3_client, upload_model
from kvpilot.contract import metric_names
from kvpilot.gateway.routing import lora_affinity
from kvpilot.operator.adapters import pod_api
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support import model_sources
from tests.support.model_sources import S3Endpoint, hf_env, s3_env
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes

PROMPT = [1, 9, 33, 17, 400, 12, 88, 1001, 7, 7, 7] * 3  # each adapter changes its output
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    base = load_base()
    root = tmp_path_factory.mktemp("adapters")
    made = {
        spec.name: (root / spec.name, make_adapter(base, spec, root / spec.name))
        for spec in MIXED_ADAPTERS
    }
    made["base"] = (Path(), base)
    return made


@pytest.fixture(scope="module")
def lora_server(
    start_server: Callable[..., RuntimeServer], adapters: dict[str, tuple[Path, Any]]
) -> Iterator[RuntimeServer]:
    with pytest.MonkeyPatch.context() as env:  # the server process inherits it
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        server = start_server(
            "--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--attention-backend", "sdpa",  # no wait on the paged kernel's build lock
            "--dtype", "float32",  # as the reference computes
            "--lora-modules", f"qv8={adapters['qv8'][0]}",
        )  # fmt: skip
    yield server


def client_of(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def greedy_text(model: Any) -> str:
    """transformers + peft's greedy continuation of PROMPT, as the server's text."""
    tokens: list[int] = []
    for _ in range(NUM_TOKENS):  # teacher-forced one more token each time: greedy decoding
        tokens.append(int(reference_logprobs(model, PROMPT, [*tokens, 0])[-1].argmax()))
    return Tokenizer(TINY).decode(tokens)


def completion_text(client: OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return out.choices[0].text


def test_an_adapter_named_as_the_model_answers_as_peft_does(
    lora_server: RuntimeServer, adapters: dict[str, tuple[Path, Any]]
) -> None:
    client = client_of(lora_server)
    got = completion_text(client, "qv8")
    assert got == greedy_text(adapters["qv8"][1])
    assert completion_text(client, MODEL) == greedy_text(adapters["base"][1]) != got


def test_models_lists_adapters_with_their_parent(
    lora_server: RuntimeServer, adapters: dict[str, tuple[Path, Any]]
) -> None:
    cards = {card.id: card for card in client_of(lora_server).models.list().data}
    assert cards["qv8"].model_extra == {
        "root": str(adapters["qv8"][0]), "parent": MODEL, "max_model_len": 256,
    } | {}  # fmt: skip
    assert cards[MODEL].model_extra["parent"] is None  # type: ignore[index]


def post(server: RuntimeServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_load_serve_and_unload_over_http(
    lora_server: RuntimeServer, adapters: dict[str, tuple[Path, Any]]
) -> None:
    path = str(adapters["mlp4"][0])
    loaded = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "mlp4", "lora_path": path})
    assert (loaded.status_code, loaded.text) == (
        200, "Success: LoRA adapter 'mlp4' added successfully.",
    )  # fmt: skip
    client = client_of(lora_server)
    assert completion_text(client, "mlp4") == greedy_text(adapters["mlp4"][1])
    again = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "mlp4", "lora_path": path})
    assert again.status_code == 400
    assert "has already been loaded" in again.json()["error"]["message"]
    gone = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "mlp4"})
    assert (gone.status_code, gone.text) == (
        200, "Success: LoRA adapter 'mlp4' removed successfully.",
    )  # fmt: skip
    missing = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "mlp4"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'mlp4' cannot be found."
    with pytest.raises(openai.NotFoundError) as info:
        completion_text(client, "mlp4")
    assert info.value.code == "model_not_found"
    assert "mlp4" not in {card.id for card in client.models.list().data}


def wrong_shapes_adapter(path: Path) -> str:
    """An adapter trained for a base whose MLP is 1024 wide (tiny-llama's is 688)."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    prefix = "base_model.model.model.layers.0.mlp.down_proj"
    tensors = {
        f"{prefix}.lora_A.weight": torch.ones(4, 1024),
        f"{prefix}.lora_B.weight": torch.ones(256, 4),
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_adapters_that_cannot_run_are_400s_naming_the_cause(
    lora_server: RuntimeServer, adapters: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    cases = [
        ("all16", str(adapters["all16"][0]), "rank r=16 is above --max-lora-rank 8"),
        ("wide", wrong_shapes_adapter(tmp_path / "wide"), "layers.0.down_proj: lora_A [4, 1024]"),
        ("nowhere", str(tmp_path / "nowhere"), "no adapter_config.json"),
        (MODEL, str(adapters["ko2"][0]), "is the base model's name"),
    ]
    for name, path, message in cases:
        answer = post(lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert answer.status_code == 400, name
        assert message in answer.json()["error"]["message"], name
    incomplete = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert incomplete.status_code == 400
    assert "lora_path" in incomplete.json()["error"]["message"]


def test_unknown_model_is_404_model_not_found(lora_server: RuntimeServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        completion_text(client_of(lora_server), "no-such-adapter")
    assert info.value.code == "model_not_found"


def test_lora_requests_info_reports_max_loras(lora_server: RuntimeServer) -> None:
    samples = lora_server.metrics()
    key = next(k for k in samples if k.startswith("vllm:lora_requests_info"))
    assert "('max_lora', '2')" in key
    assert samples[key] > 1.7e9  # the time of the reading


def test_requests_per_adapter_and_the_adapters_held_are_counted_as_the_operator_reads_them(
    lora_server: RuntimeServer,
) -> None:
    """The runtime's side of the contract the operator's placement (pod_api) and the gateway's
    picking (lora_affinity) read: requests per adapter, one per sequence, and each adapter held."""
    before = pod_api.parse_requests_by_adapter(metrics_text(lora_server)).get("qv8", 0.0)
    client = client_of(lora_server)
    client.completions.create(model="qv8", prompt="Hello", max_tokens=1, n=2)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)  # the base: not counted
    text = metrics_text(lora_server)
    assert pod_api.parse_requests_by_adapter(text)["qv8"] == before + 2
    state = lora_affinity.parse_lora_info(text)
    assert state is not None and state.loaded is not None and "qv8" in state.loaded
    assert f'{metric_names.LORA_ADAPTER_LOADED}{{lora_name="qv8",model_name="{MODEL}"}} 1.0' in text


def metrics_text(server: RuntimeServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


# -- adapters from hf:// and s3:// ---------------------------------------------------------------

HF_ADAPTERS = {"qv8": "kvpilot/lora-qv8", "ko2": "kvpilot/lora-ko2"}


@pytest.fixture(scope="module")
def adapter_hub(
    tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, tuple[Path, Any]]
) -> Iterator[str]:
    """HF_ENDPOINT of a hub (olah, offline) serving the qv8 and ko2 adapters as HF_ADAPTERS."""
    state = tmp_path_factory.mktemp("adapter-hub")
    for name, repo_id in HF_ADAPTERS.items():
        make_hf_mirror(adapters[name][0], state / "hf-mirrors", repo_id)
    with model_sources.hf_hub(state) as url:
        yield url


@pytest.fixture(scope="module")
def s3_adapters(s3_endpoint: S3Endpoint, adapters: dict[str, tuple[Path, Any]]) -> str:
    """s3://BUCKET/PREFIX under which qv8/ and ko2/ are uploaded (a prefix new to the store)."""
    prefix = f"lora-{uuid.uuid4().hex[:8]}"
    client = s3_client(s3_endpoint)
    for name in HF_ADAPTERS:
        upload_model(client, s3_endpoint.bucket, adapters[name][0], f"{prefix}/{name}/")
    return f"s3://{s3_endpoint.bucket}/{prefix}"


@pytest.fixture(scope="module")
def remote_lora_server(
    start_server: Callable[..., RuntimeServer],
    tmp_path_factory: pytest.TempPathFactory,
    adapter_hub: str,
    s3_endpoint: S3Endpoint,
    s3_adapters: str,
) -> RuntimeServer:
    env = hf_env(adapter_hub, tmp_path_factory.mktemp("hf-home")) | s3_env(s3_endpoint)
    with pytest.MonkeyPatch.context() as patch:  # the server process inherits it
        for key, value in env.items():
            patch.setenv(key, value)
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        return start_server(
            "--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--attention-backend", "sdpa", "--dtype", "float32",
            "--lora-modules", f"hf-qv8=hf://{HF_ADAPTERS['qv8']}", f"s3-qv8={s3_adapters}/qv8",
        )  # fmt: skip


def test_lora_modules_from_hf_and_s3_answer_as_peft_does(
    remote_lora_server: RuntimeServer, adapters: dict[str, tuple[Path, Any]], s3_adapters: str
) -> None:
    client = client_of(remote_lora_server)
    expected = greedy_text(adapters["qv8"][1])
    assert completion_text(client, "hf-qv8") == completion_text(client, "s3-qv8") == expected
    roots = {card.id: card.model_extra["root"] for card in client.models.list().data}  # type: ignore[index]
    assert roots["hf-qv8"] == f"hf://{HF_ADAPTERS['qv8']}"
    assert roots["s3-qv8"] == f"{s3_adapters}/qv8"


@pytest.mark.parametrize("scheme", ["hf", "s3"])
def test_load_lora_adapter_fetches_an_hf_or_s3_path(
    remote_lora_server: RuntimeServer,
    adapters: dict[str, tuple[Path, Any]],
    s3_adapters: str,
    scheme: str,
) -> None:
    """vLLM's load body takes a path or a Hub repo id as lora_path; here a URI either way."""
    path = f"hf://{HF_ADAPTERS['ko2']}" if scheme == "hf" else f"{s3_adapters}/ko2"
    name = f"{scheme}-ko2"
    loaded = post(
        remote_lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
    )
    assert (loaded.status_code, loaded.text) == (
        200, f"Success: LoRA adapter '{name}' added successfully.",
    )  # fmt: skip
    assert completion_text(client_of(remote_lora_server), name) == greedy_text(adapters["ko2"][1])


def test_remote_paths_that_cannot_be_fetched_are_400s_naming_the_uri(
    remote_lora_server: RuntimeServer, s3_adapters: str
) -> None:
    cases = [
        (f"{s3_adapters}/missing", "no objects under"),
        ("hf://kvpilot/no-such-adapter", "hf://kvpilot/no-such-adapter"),
    ]
    for path, message in cases:
        body = {"lora_name": "missing", "lora_path": path}
        answer = post(remote_lora_server, "/v1/load_lora_adapter", body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert path in error["message"] and message in error["message"], error
        assert error["param"] == "lora_path"
