"""The runtime's adapter API, as vLLM serves it, called on one pod: GET /v1/models (adapters
are the entries with a `parent`, `root` the URI they were loaded from), POST
/v1/load_lora_adapter and /v1/unload_lora_adapter; and each adapter's requests so far from its
/metrics (metric_names.LORA_REQUESTS_RECEIVED). Thin I/O: each call says what the pod answered
and decides nothing."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract import metric_names

# Loading fetches an hf:// or s3:// adapter first (tens of MB): minutes on a slow link.
LOAD_TIMEOUT_S = 300.0
READ_TIMEOUT_S = 5.0


async def loaded(client: httpx.AsyncClient, base_url: str) -> dict[str, str]:
    """The pod's adapters: name -> URI (httpx.HTTPError when the pod does not answer)."""
    response = await client.get(f"{base_url}/v1/models", timeout=READ_TIMEOUT_S)
    response.raise_for_status()
    cards = response.json().get("data") or []
    return {card["id"]: card.get("root") or "" for card in cards if card.get("parent")}


async def requests_by_adapter(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The pod's requests per adapter since it started (httpx.HTTPError when it does not
    answer; {} from a runtime that does not count them, e.g. vLLM)."""
    response = await client.get(f"{base_url}/metrics", timeout=READ_TIMEOUT_S)
    response.raise_for_status()
    return parse_requests_by_adapter(response.text)


def parse_requests_by_adapter(text: str) -> dict[str, float]:
    """adapter -> requests, from a /metrics text (only its LORA_REQUESTS_RECEIVED lines are
    parsed: the rest runs to hundreds of lines)."""
    name = metric_names.LORA_REQUESTS_RECEIVED
    lines = "\n".join(line for line in text.splitlines() if line.startswith(name + "{"))
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(lines):
        for sample in family.samples:
            adapter = sample.labels.get(metric_names.LORA_NAME_LABEL, "")
            counts[adapter] = counts.get(adapter, 0.0) + sample.value
    return counts


async def load(client: httpx.AsyncClient, base_url: str, name: str, uri: str) -> str | None:
    """Load adapter `name` from `uri`; None when loaded, else the pod's reason."""
    body = {"lora_name": name, "lora_path": uri}
    return await _post(client, f"{base_url}/v1/load_lora_adapter", body, LOAD_TIMEOUT_S)


async def unload(client: httpx.AsyncClient, base_url: str, name: str) -> str | None:
    """Unload adapter `name`; None when unloaded (or already gone), else the pod's reason."""
    error = await _post(
        client, f"{base_url}/v1/unload_lora_adapter", {"lora_name": name}, READ_TIMEOUT_S
    )
    return None if error is not None and error.startswith("404") else error


async def _post(
    client: httpx.AsyncClient, url: str, body: dict[str, str], timeout_s: float
) -> str | None:
    try:
        response = await client.post(url, json=body, timeout=timeout_s)
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"
    if response.is_success:
        return None
    return f"{response.status_code} {_message(response)}"


def _message(response: httpx.Response) -> str:
    """The OpenAI-style error's message, else the body's text."""
    try:
        error = response.json().get("error") or {}
        return str(error.get("message") or response.text)
    except ValueError:
        return response.text
