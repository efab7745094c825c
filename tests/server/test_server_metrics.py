"""/metrics: every §3.4 name and vLLM alias, the names the operator reads, vLLM's per-request
phase and token histograms and info gauges, exact queue/running/KV gauges, promtool's lint."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.operator.autoscaling import metrics_reader as operator_metrics
from tests.support.server_process import MODEL, RuntimeServer, wait_for

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

# (kvpilot sample, vLLM alias sample) as they appear in the exposition
PAIRS = [
    ("kvpilot_requests_waiting", "vllm:num_requests_waiting"),
    ("kvpilot_requests_running", "vllm:num_requests_running"),
    ("kvpilot_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
    ("kvpilot_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    ("kvpilot_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    ("kvpilot_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
    ("kvpilot_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
    ("kvpilot_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
    ("kvpilot_prompt_tokens_total", "vllm:prompt_tokens_total"),
    ("kvpilot_generation_tokens_total", "vllm:generation_tokens_total"),
    ("kvpilot_request_received_total", "vllm:request_received_total"),
    ("kvpilot_preemptions_total", "vllm:num_preemptions_total"),
    ("kvpilot_request_queue_time_seconds_count", "vllm:request_queue_time_seconds_count"),
    ("kvpilot_request_prefill_time_seconds_count", "vllm:request_prefill_time_seconds_count"),
    ("kvpilot_request_decode_time_seconds_count", "vllm:request_decode_time_seconds_count"),
    (
        "kvpilot_request_time_per_output_token_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
    ),
    ("kvpilot_request_inference_time_seconds_count", "vllm:request_inference_time_seconds_count"),
    ("kvpilot_request_prompt_tokens_sum", "vllm:request_prompt_tokens_sum"),
    ("kvpilot_request_generation_tokens_sum", "vllm:request_generation_tokens_sum"),
    ("kvpilot_request_generation_tokens_sum", "vllm:request_max_num_generation_tokens_sum"),
    ("kvpilot_kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc"),
    ("kvpilot_iteration_tokens_sum", "vllm:iteration_tokens_total_sum"),
    ("kvpilot_inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"),
]
PHASES = ("queue", "prefill", "decode", "inference")
# Every series vLLM's example Grafana dashboard queries, as written there
# (vllm-project/vllm examples/online_serving/prometheus_grafana/grafana.json), by model_name.
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
NUM_SEQS = 2
NUM_REQUESTS = 6


@pytest.fixture(scope="module")
def small_server(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    return start_server("--max-model-len", "256", "--max-num-seqs", str(NUM_SEQS))


def complete(server: RuntimeServer, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return dict(response.json())


def test_every_name_and_alias_with_model_label(small_server: RuntimeServer) -> None:
    complete(small_server, "hello there", 4)
    text = httpx.get(f"{small_server.url}/metrics").text
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    for ours, alias in PAIRS:
        assert samples[ours].labels.get("model_name") == MODEL, ours
        assert samples[alias].labels.get("model_name") == MODEL, alias
        assert samples[ours].value == samples[alias].value, (ours, alias)
    assert samples["kvpilot_time_to_first_token_seconds_count"].value >= 1


def test_token_counters_match_usage(small_server: RuntimeServer) -> None:
    before = small_server.metrics()
    usage = complete(small_server, "The list of", 7)["usage"]
    after = small_server.metrics()
    assert (
        after["kvpilot_prompt_tokens_total"] - before["kvpilot_prompt_tokens_total"]
        == (usage["prompt_tokens"])
    )
    assert after["kvpilot_generation_tokens_total"] - before["kvpilot_generation_tokens_total"] == 7
    assert after["kvpilot_e2e_request_latency_seconds_count"] == (
        before["kvpilot_e2e_request_latency_seconds_count"] + 1
    )
    # the autoscaler's arrivals: one per request, as the success counter counts its end
    received = "kvpilot_request_received_total"
    assert after[received] == before[received] + 1


async def hold_streams(server: RuntimeServer) -> None:
    """Open NUM_REQUESTS long streams, check the gauges while they queue and run, then drop them."""
    body = {"model": MODEL, "prompt": "The", "max_tokens": 250, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        streams = [client.stream("POST", f"{server.url}/v1/completions", json=body)
                   for _ in range(NUM_REQUESTS)]  # fmt: skip
        responses = [await s.__aenter__() for s in streams]
        assert all(r.status_code == 200 for r in responses)

        def gauges() -> tuple[float, float, float]:
            m = server.metrics()
            return (m["kvpilot_requests_running"], m["kvpilot_requests_waiting"],
                    m["kvpilot_kv_cache_usage_ratio"])  # fmt: skip

        await asyncio.to_thread(
            wait_for, lambda: gauges()[:2] == (NUM_SEQS, NUM_REQUESTS - NUM_SEQS), 30, "queue"
        )
        assert gauges()[2] > 0
        for s in streams:  # disconnect mid-stream: every sequence is aborted
            await s.__aexit__(None, None, None)
    await asyncio.to_thread(wait_for, lambda: gauges() == (0, 0, 0.0), 30, "gauges back to 0")


def test_gauges_are_exact_while_requests_queue_and_run(small_server: RuntimeServer) -> None:
    asyncio.run(hold_streams(small_server))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) absent")
def test_promtool_check_metrics(small_server: RuntimeServer) -> None:
    complete(small_server, "hello", 3)
    text = httpx.get(f"{small_server.url}/metrics").text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=60, check=False)  # fmt: skip
    problems = (result.stdout + result.stderr).strip().splitlines()
    # The vLLM aliases must keep vLLM's colon names (DESIGN.md §3.4), which promtool's lint
    # flags as a style matter; everything else must be clean, and the text must parse.
    colon = re.compile(r"^vllm:\S+ metric names should not contain ':'$")
    # vLLM named this histogram with a counter's suffix; its alias must keep the name
    vllm_total = 'vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix'
    others = [line for line in problems if not colon.match(line) and line != vllm_total]
    assert others == [], others
    assert result.returncode in (0, 3)  # 3: lint findings only (the colons above)


def samples_of(server: RuntimeServer) -> dict[str, list]:
    """Every sample of the exposition by sample name (a name may carry several label sets)."""
    text = httpx.get(f"{server.url}/metrics").text
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def test_names_the_operator_reads_exist(small_server: RuntimeServer) -> None:
    """The other side of the autoscaler's contract (operator/runtime_metrics.py): each name it
    queries in Prometheus (kvpilot's and vLLM's as exported), and its direct scrape of a pod, work
    on a real runtime. The third name of each is Prometheus' escaped storage form, not exported."""
    complete(small_server, "contract", 2)
    found = samples_of(small_server)
    for names in (operator_metrics.WAITING, operator_metrics.RUNNING, operator_metrics.KV_USAGE):
        for name in names[:2]:
            assert [s.labels["model_name"] for s in found[name]] == [MODEL], name
    for name in operator_metrics.TTFT[:2]:
        assert found[f"{name}_bucket"][-1].labels["le"] == "+Inf", name
        assert found[f"{name}_count"][0].value >= 1, name
    url = f"{small_server.url}/metrics"
    pods = asyncio.run(operator_metrics.scrape_pods({"pod-a": url}, {"pod-a": "local"}))
    assert [(p.pod, p.node_type, p.waiting, p.running) for p in pods] == [
        ("pod-a", "local", 0.0, 0.0)
    ]


@pytest.mark.parametrize("series", VLLM_DASHBOARD_SERIES)
def test_vllm_dashboard_series_exist(small_server: RuntimeServer, series: str) -> None:
    complete(small_server, "for the dashboard", 3)
    found = samples_of(small_server)
    assert series in found, series
    assert {s.labels["model_name"] for s in found[series]} == {MODEL}


def test_cache_config_and_lora_info_as_vllm_exposes_them(small_server: RuntimeServer) -> None:
    found = samples_of(small_server)
    [cache] = found["vllm:cache_config_info"]
    total_blocks = int(found["kvpilot_kv_cache_total_blocks"][0].value)
    assert cache.value == 1
    assert cache.labels["model_name"] == MODEL and cache.labels["engine"] == "0"
    assert cache.labels["block_size"] == str(BLOCK_SIZE)
    assert cache.labels["num_gpu_blocks"] == str(total_blocks) and total_blocks > 0
    assert cache.labels["cache_dtype"] == "auto"
    assert cache.labels["enable_prefix_caching"] == "True"
    [lora] = found["vllm:lora_requests_info"]
    assert lora.labels == {
        "model_name": MODEL,
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert abs(lora.value - time.time()) < 60  # the reading's time: the picker takes the newest


def test_phase_and_token_histograms_of_one_request(small_server: RuntimeServer) -> None:
    """One request moves each per-request histogram by exactly one observation whose values
    fit together: prefill + decode = inference, queue + inference within e2e, token sums equal
    the usage, and the steps ran exactly the uncached prompt plus every token but the last."""
    before = small_server.metrics()
    usage = complete(small_server, "Once upon a midnight dreary, while I", 9)["usage"]
    after = small_server.metrics()

    def delta(name: str) -> float:
        return after[f"vllm:{name}"] - before.get(f"vllm:{name}", 0.0)

    for phase in PHASES:
        assert delta(f"request_{phase}_time_seconds_count") == 1, phase
    prefill, decode = (
        delta("request_prefill_time_seconds_sum"),
        delta("request_decode_time_seconds_sum"),
    )
    inference = delta("request_inference_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert abs(prefill + decode - inference) < 1e-6
    queue = delta("request_queue_time_seconds_sum")
    assert queue >= 0 and queue + inference <= delta("e2e_request_latency_seconds_sum")
    assert delta("request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert delta("request_generation_tokens_sum") == usage["completion_tokens"] == 9
    assert delta("request_generation_tokens_count") == 1
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert delta("iteration_tokens_total_sum") == usage["prompt_tokens"] - cached + 9 - 1
    assert delta("iteration_tokens_total_count") == 9  # one prefill step, eight decode steps
    assert (
        delta("time_per_output_token_seconds_count")
        == 8
        == delta("inter_token_latency_seconds_count")
    )
    # One request's TPOT: its decode time over the 8 tokens after its first (vLLM v1's)
    assert delta("request_time_per_output_token_seconds_count") == 1
    assert delta("request_time_per_output_token_seconds_sum") == pytest.approx(decode / 8)
