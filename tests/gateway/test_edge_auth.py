"""Trust at the edge (issue 40 items 1, 2, 6, 9, 10) with real processes: a `kvpilot-runtime serve`
replica of tiny-llama that checks an API key (`--api-key`, served as `locked`), and real
`kvpilot-gateway` processes in front of it with the response cache on.

- Without gateway keys the client's key is the replica's to check: a cached answer is only ever
  given to the credential it was stored for (no key, a wrong key: 401, never a hit).
- With gateway keys the gateway sends the replicas its own key (`upstream.apiKeyEnv` or
  `--upstream-api-key-env`), so gateway keys and a runtime `--api-key` combine; cached answers are
  shared per team by default (`--cache-scope key`: per key), and a hit counts against the key's
  limits (its rpm_limit; refused when the request would not fit its budget) but spends no tokens.
- `Authorization: bearer KEY` (any case of the scheme) is accepted by the gateway and the runtime;
  `"max_tokens": null` is the runtime's 16 also through a token-limited key.
- A header with a bare line feed is a 400 that quotes nothing, and one log line, not a traceback.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.gateway.bodies import COMPLETIONS
from kvpilot.gateway.usage import prompt_tokens_bound
from tests.support.gateway_process import GatewayProcess, start_servers
from tests.support.server_process import RuntimeServer, wait_for

pytestmark = pytest.mark.slow

KEY = "sk-runtime-locked-7f3a"  # the replica's --api-key
LOCKED = "locked"
BODY = {"model": LOCKED, "prompt": "secret tenant question", "max_tokens": 8, "temperature": 0}
SPENT_PROMPT, SPENT_MAX = "Spent on one answer", 16
SPENT_BODY = {"model": LOCKED, "prompt": SPENT_PROMPT, "max_tokens": SPENT_MAX, "temperature": 0,
              "ignore_eos": True}  # fmt: skip
# Room for one request's reservation and 32 tokens more: one answer of SPENT_BODY (~22 tokens)
# leaves room for its reservation, two do not.
SPENT_LIMIT = prompt_tokens_bound(SPENT_BODY, COMPLETIONS) + SPENT_MAX + 32
BIG = {"unit": "total_tokens", "limit": 1_000_000, "window": "30d"}
KEYS = [
    {"key": "sk-team-a-one", "team": "a", "limits": [BIG]},
    {"key": "sk-team-a-two", "team": "a", "limits": [BIG]},
    {"key": "sk-team-b-one", "team": "b", "limits": [BIG]},
    {"key": "sk-rpm-three", "team": "r", "rpm_limit": 3},
    {"key": "sk-spent-one", "team": "s",
     "limits": [{"unit": "total_tokens", "limit": SPENT_LIMIT, "window": "30d"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeServer]:
    args = ["--max-model-len", "2048", "--max-num-seqs", "16", "--served-name", LOCKED,
            "--api-key", KEY]  # fmt: skip
    (server,) = start_servers([args], tmp_path_factory.mktemp("locked"))
    yield server
    server.stop()


def config(replica: RuntimeServer, **extra: Any) -> dict[str, Any]:
    return {"models": [{"name": LOCKED, "backends": [replica.url]}],
            "cache": {"enabled": True}, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def open_gateway(
    replica: RuntimeServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """No gateway keys: the client's Authorization goes to the replica, which checks it."""
    process = GatewayProcess(config(replica), tmp_path_factory.mktemp("open"))
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def keyed_gateway(
    replica: RuntimeServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """Gateway keys, and the replica's key from the config's upstream.apiKeyEnv."""
    keyed = config(replica, keys=KEYS, upstream={"apiKeyEnv": "RUNTIME_KEY"})
    process = GatewayProcess(keyed, tmp_path_factory.mktemp("keyed"), RUNTIME_KEY=KEY)
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


def post(url: str, authorization: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization else {}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def served(replica: RuntimeServer) -> float:
    """Requests the replica answered (the runtime's own counter)."""
    return sum(v for k, v in replica.metrics().items()
               if k.startswith("kvpilot_request_success_total"))  # fmt: skip


def wait_served(replica: RuntimeServer, count: float) -> None:
    wait_for(lambda: served(replica) >= count, 30, f"{replica.url} served {count} requests")


def test_the_cache_never_answers_a_request_the_replica_would_refuse(
    replica: RuntimeServer, open_gateway: GatewayProcess
) -> None:
    """Item 1, as the issue reproduces it: no key 401; the right key 200 (miss); then no key or
    a wrong key got `200 x-kvpilot-cache: hit`. Now only the same credential hits."""
    assert post(open_gateway.url, None, BODY).status_code == 401
    before = served(replica)
    first = post(open_gateway.url, f"Bearer {KEY}", BODY)
    assert (first.status_code, first.headers["x-kvpilot-cache"]) == (200, "miss")
    wait_served(replica, before + 1)
    for refused in (None, "Bearer wrong", f"Bearer {KEY}x", KEY):
        answer = post(open_gateway.url, refused, BODY)
        assert answer.status_code == 401, (refused, answer.text)
        assert answer.headers.get("x-kvpilot-cache") != "hit"
    for same in (f"Bearer {KEY}", f"bearer {KEY}"):  # the scheme in any case: one credential
        hit = post(open_gateway.url, same, BODY)
        assert (hit.status_code, hit.headers["x-kvpilot-cache"]) == (200, "hit")
        assert hit.json()["choices"] == first.json()["choices"]
    assert served(replica) == before + 1


def test_gateway_keys_and_a_runtime_api_key_combine_and_teams_share_the_cache(
    replica: RuntimeServer, keyed_gateway: GatewayProcess
) -> None:
    """Items 2 and 10: the gateway sends the replica its own key (every request was 401); one
    team's keys share cached answers, another team's never sees them (header or latency)."""
    body = {**BODY, "prompt": "a question of team a"}
    before = served(replica)
    first = post(keyed_gateway.url, "Bearer sk-team-a-one", body)
    assert (first.status_code, first.headers["x-kvpilot-cache"]) == (200, "miss"), first.text
    wait_served(replica, before + 1)
    mate = post(keyed_gateway.url, "bearer sk-team-a-two", body)  # item 9: any case
    assert (mate.status_code, mate.headers["x-kvpilot-cache"]) == (200, "hit")
    other = post(keyed_gateway.url, "Bearer sk-team-b-one", body)
    assert (other.status_code, other.headers["x-kvpilot-cache"]) == (200, "miss")
    wait_served(replica, before + 2)
    assert post(keyed_gateway.url, "Bearer sk-team-b-one", body).headers["x-kvpilot-cache"] == (
        "hit")  # fmt: skip
    assert served(replica) == before + 2
    assert KEY not in keyed_gateway.log_path.read_text()


def test_a_per_key_scope_and_the_upstream_key_from_a_flag(
    replica: RuntimeServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    flags = ("--cache-scope", "key", "--upstream-api-key-env", "RUNTIME_KEY")
    process = GatewayProcess(config(replica, keys=KEYS), tmp_path_factory.mktemp("per-key"),
                             *flags, RUNTIME_KEY=KEY)  # fmt: skip
    try:
        body = {**BODY, "prompt": "a question for one key"}
        states = [post(process.url, f"Bearer {key}", body).headers["x-kvpilot-cache"]
                  for key in ("sk-team-a-one", "sk-team-a-two", "sk-team-a-one")]  # fmt: skip
        assert states == ["miss", "miss", "hit"]
    finally:
        assert process.stop() == 0, process.log_path.read_text()[-3000:]


def test_hits_count_against_the_rpm_limit_and_a_key_over_its_budget_is_refused(
    replica: RuntimeServer, keyed_gateway: GatewayProcess
) -> None:
    """Item 10: hits skipped budgets and rpm_limit. Now a hit is one request (rpm_limit 3: the
    4th is refused) that spends no tokens, admitted only when the request would fit the key's
    budget."""
    body = {**BODY, "prompt": "the rate limit counts hits"}
    answers = [post(keyed_gateway.url, "Bearer sk-rpm-three", body) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers.get("x-kvpilot-cache") for a in answers[:3]] == ["miss", "hit", "hit"]
    assert answers[3].json()["error"]["code"] == "rate_limit_exceeded"
    assert "Retry-After" in answers[3].headers

    spent = "Bearer sk-spent-one"
    states = [post(keyed_gateway.url, spent, SPENT_BODY) for _ in range(3)]
    assert [(a.status_code, a.headers["x-kvpilot-cache"]) for a in states] == [
        (200, "miss"), (200, "hit"), (200, "hit")]  # fmt: skip
    assert states[0].json()["usage"]["completion_tokens"] == SPENT_MAX  # hits spent nothing
    other = post(keyed_gateway.url, spent, {**SPENT_BODY, "prompt": "Spent on two answers"})
    assert other.status_code == 200  # now no room is left for one more such request...
    over = post(keyed_gateway.url, spent, SPENT_BODY)
    assert over.status_code == 429, over.text  # ...so the cached prompt is refused too
    assert over.headers.get("x-kvpilot-cache") != "hit"


def test_bearer_in_any_case_and_a_null_max_tokens_as_the_runtime_reads_them(
    replica: RuntimeServer, keyed_gateway: GatewayProcess
) -> None:
    """Item 9: `bearer KEY` was a 401 (runtime and gateway); `"max_tokens": null` was sent
    upstream as 1024 by a token-limited key, where the runtime alone generates its default 16."""
    body = {"model": LOCKED, "prompt": "Count with me:", "max_tokens": None, "temperature": 0,
            "ignore_eos": True, "cache": False}  # fmt: skip
    runtime_body = {k: v for k, v in body.items() if k != "cache"}
    for scheme in ("bearer", "BEARER"):
        direct = post(replica.url, f"{scheme} {KEY}", runtime_body)
        assert direct.status_code == 200, direct.text
        assert direct.json()["usage"]["completion_tokens"] == 16
    through = post(keyed_gateway.url, "bearer sk-team-a-one", body)
    assert through.status_code == 200, through.text
    assert through.json()["usage"]["completion_tokens"] == 16


def raw_request(port: int, head: bytes) -> bytes:
    """`head` and a 2-byte body as they are, over a plain socket; what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"Content-Length: 2\r\n\r\n{}")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


INJECTED = f"Authorization: Bearer {KEY}\nX-Injected: yes\r\n".encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + INJECTED


def lines_since(path: Path, start: int) -> list[str]:
    return path.read_text()[start:].splitlines()


def test_a_header_with_a_bare_line_feed_is_a_400_that_quotes_nothing(
    replica: RuntimeServer, open_gateway: GatewayProcess
) -> None:
    """Item 6: the 400 body and a logged traceback quoted the whole header, key included."""
    start = len(open_gateway.log_path.read_text())
    answer = raw_request(open_gateway.port, HEAD)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
    assert KEY.encode() not in answer
    assert b'"code": "malformed_request"' in body
    wait_for(lambda: bool(lines_since(open_gateway.log_path, start)), 10, "the log line")
    logged = lines_since(open_gateway.log_path, start)
    assert len(logged) == 1 and "malformed_request" in logged[0], logged
    assert KEY not in open_gateway.log_path.read_text()
    assert "Traceback" not in open_gateway.log_path.read_text()
    # the runtime (uvicorn) answers it alike: a 400 without the key, and no traceback
    runtime_answer = raw_request(replica.port, HEAD)
    assert b" 400 " in runtime_answer.split(b"\r\n")[0] and KEY.encode() not in runtime_answer
    assert KEY not in replica.log_path.read_text()
    assert "Traceback" not in replica.log_path.read_text()
