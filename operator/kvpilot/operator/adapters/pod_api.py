"""The runtime's adapter API, as vLLM serves it, called on one pod: GET /v1/models (adapters
are the entries with a `parent`, `root` the URI they were loaded from), POST
/v1/load_lora_adapter and /v1/unload_lora_adapter. Thin I/O: each call says what the pod
answered and decides nothing."""

from __future__ import annotations

import httpx

# Loading fetches an hf:// or s3:// adapter first (tens of MB): minutes on a slow link.
LOAD_TIMEOUT_S = 300.0
READ_TIMEOUT_S = 5.0


async def loaded(client: httpx.AsyncClient, base_url: str) -> dict[str, str]:
    """The pod's adapters: name -> URI (httpx.HTTPError when the pod does not answer)."""
    response = await client.get(f"{base_url}/v1/models", timeout=READ_TIMEOUT_S)
    response.raise_for_status()
    cards = response.json().get("data") or []
    return {card["id"]: card.get("root") or "" for card in cards if card.get("parent")}


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
