"""kvpilot-gateway: the first requests' latency from zero replicas, and where the time goes.

    python -m bench.gateway_scale_from_zero [--requests 8]

On the dev cluster (real operator, real runtime pod on the `local` pool, the chart's
kvpilot-gateway pods watching the cluster, reached through their Service: the path
tests/e2e/test_gateway_scale_from_zero.py drives, set up by the same hack.closedloop helpers), a
tiny-llama ModelDeployment with minReplicas 0 idles down to no pod; then `--requests` streamed
requests arrive at once and are held by the gateway while it wakes the model. While they wait, the
pod's status is polled (every ~0.25 s; its own timestamps have 1 s resolution) to split the first
token's latency into: wake (request -> pod created: the gateway's wake annotation, the operator's
decision), pod start (created -> container running: scheduling and, on a real node, the image
pull), model load (running -> Ready: the runtime imports, loads the weights and passes its
readiness probe) and first token (Ready -> first streamed token: discovery sees the pod, the held
requests go to it, prefill). Every held request must be served: the number lost is reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from bench.report import markdown_table, write_section
from hack import closedloop
from hack.devcluster import DevCluster, procs

NAME = "tiny-zero-bench"
IDLE_S = 10  # scaleToZeroIdleSeconds
FALLBACK_AFTER_S = 600  # the CRD's most; no fallback is configured: the requests wait for the pod
OUTPUT_TOKENS = 16


@dataclass
class Held:
    """One held request: when its first token and its end came, relative to the send."""

    first_token_s: float | None = None
    done_s: float | None = None
    completion_tokens: int = 0  # from the stream's usage chunk
    error: str = ""


@dataclass
class PodMarks:
    """When the woken pod was first seen created, running and Ready, relative to the send."""

    created_s: float | None = None
    running_s: float | None = None
    ready_s: float | None = None
    name: str = ""
    polls: list[float] = field(default_factory=list)


def pods(cluster: DevCluster) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "pods", "-l", f"kvpilot.dev/model={NAME}", "-o", "json", check=False
    )
    return list(json.loads(out.stdout)["items"]) if out.returncode == 0 else []


def replicas(cluster: DevCluster) -> int | None:
    out = cluster.kubectl("get", "modeldeployment", NAME, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout).get("status", {}).get("replicas")


def is_running(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return any("running" in (s.get("state") or {}) for s in statuses)


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def one_request(url: str, index: int, sent: float) -> Held:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    held = Held()
    try:
        stream = client.completions.create(
            model=NAME, prompt=f"Request {index}: once upon a time", max_tokens=OUTPUT_TOKENS,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and held.first_token_s is None:
                held.first_token_s = time.monotonic() - sent
            if chunk.usage is not None:
                held.completion_tokens = chunk.usage.completion_tokens
        held.done_s = time.monotonic() - sent
    except openai.OpenAIError as error:
        held.error = f"{type(error).__name__}: {error}"
    return held


def watch_pod(cluster: DevCluster, sent: float, requests: list[Future[Held]]) -> PodMarks:
    """Poll the model's pods until every request is done; when each phase was first seen."""
    marks = PodMarks()
    while not all(r.done() for r in requests):
        seen = pods(cluster)
        now = time.monotonic() - sent
        marks.polls.append(now)
        if seen and marks.created_s is None:
            marks.created_s, marks.name = now, seen[0]["metadata"]["name"]
        if any(is_running(p) for p in seen) and marks.running_s is None:
            marks.running_s = now
        if any(is_ready(p) for p in seen) and marks.ready_s is None:
            marks.ready_s = now
        time.sleep(0.25)
    return marks


def measure(cluster: DevCluster, url: str, num_requests: int) -> tuple[list[Held], PodMarks]:
    at_zero = procs.wait_for(lambda: replicas(cluster) == 0 and not pods(cluster), 900, 1.0)
    if not at_zero:
        raise RuntimeError(f"{NAME} did not scale to zero within 900 s")
    with ThreadPoolExecutor(num_requests) as pool:
        sent = time.monotonic()
        futures = [pool.submit(one_request, url, i, sent) for i in range(num_requests)]
        marks = watch_pod(cluster, sent, futures)
        return [f.result() for f in futures], marks


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def report(held: list[Held], marks: PodMarks) -> str:
    firsts = [h.first_token_s for h in held if h.first_token_s is not None]
    first = min(firsts) if firsts else None
    lost = [h for h in held if h.error or h.completion_tokens != OUTPUT_TOKENS]
    rows = [
        ["wake: requests sent -> pod created", seconds(marks.created_s)],
        ["pod start: created -> container running", seconds(between(marks.created_s,
                                                                      marks.running_s))],
        ["model load: running -> Ready", seconds(between(marks.running_s, marks.ready_s))],
        ["first token: Ready -> first streamed token", seconds(between(marks.ready_s, first))],
        ["first token from zero (total)", seconds(first)],
        ["last held request's first token", seconds(max(firsts) if firsts else None)],
        ["held requests served / sent", f"{len(held) - len(lost)} / {len(held)}"],
        ["held requests lost", str(len(lost))],
    ]  # fmt: skip
    errors = "".join(f"\n- {h.error or f'{h.completion_tokens} tokens'}" for h in lost)
    poll = max((b - a for a, b in zip(marks.polls, marks.polls[1:], strict=False)), default=0.0)
    return (
        "tiny-llama on the dev cluster's `local` pool, reached through the chart's gateway Service "
        "(the runtime and gateway pods run as local processes on this "
        "machine's shared 2-core CPU, so pod start has no image pull and model load is torch's "
        f"import plus tiny weights), `scaleToZeroIdleSeconds: {IDLE_S}`, {len(held)} streamed "
        f"requests of {OUTPUT_TOKENS} tokens sent at once while the model had no pod "
        f"(pod {marks.name}; phases as polled, the longest gap between two polls "
        f"{poll:.1f} s).\n\n" + markdown_table(["phase", "time"], rows) + errors + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=8, help="held at once")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvpilot-bench-zero-"))
    cluster = DevCluster(work / "cluster")
    try:
        cluster.up()
        url = closedloop.start_zero_gateway(cluster, NAME, IDLE_S, FALLBACK_AFTER_S)
        held, marks = measure(cluster, url, args.requests)
    finally:
        cluster.down()
    body = report(held, marks)
    print(body)
    command = f"python -m bench.gateway_scale_from_zero --requests {args.requests}"
    write_section("gateway_scale_from_zero", "Gateway: scale from zero", command, body)
    return 1 if any(h.error or h.completion_tokens != OUTPUT_TOKENS for h in held) else 0


if __name__ == "__main__":
    sys.exit(main())
