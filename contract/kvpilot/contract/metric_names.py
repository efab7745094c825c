"""The runtime's metric names that other processes read: the operator's autoscaler (through
Prometheus) and the gateway's load-aware routing (scraping /metrics) query exactly these.

The runtime exports each under kvpilot's name and vLLM's (so vLLM's dashboards, the Inference
Extension and KEDA recipes work unchanged); counters get prometheus_client's `_total` suffix.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeMetric:
    kvpilot: str
    vllm: str

    @property
    def vllm_stored(self) -> str:
        # prometheus_client (>= 0.22) answers a scrape that negotiates OpenMetrics, as Prometheus
        # 2.x does, with `escaping=underscores`: `vllm:x` reaches the TSDB as `vllm_x`.
        return self.vllm.replace(":", "_")

    @property
    def in_prometheus(self) -> tuple[str, str, str]:
        """Every name a Prometheus query may find it under, kvpilot's first."""
        return (self.kvpilot, self.vllm, self.vllm_stored)


REQUESTS_WAITING = RuntimeMetric("kvpilot_requests_waiting", "vllm:num_requests_waiting")
REQUESTS_RUNNING = RuntimeMetric("kvpilot_requests_running", "vllm:num_requests_running")
KV_CACHE_USAGE = RuntimeMetric("kvpilot_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc")
# vLLM's name before 0.9 for the KV usage; the runtime exports it too, a vLLM < 0.9 only it.
KV_CACHE_USAGE_BEFORE_VLLM_09 = "vllm:gpu_cache_usage_perc"
TIME_TO_FIRST_TOKEN = RuntimeMetric(
    "kvpilot_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"
)
# Per request: decode time over output tokens after the first (vLLM v1's histogram), which the
# autoscaler's TPOT SLO reads.
REQUEST_TIME_PER_OUTPUT_TOKEN = RuntimeMetric(
    "kvpilot_request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"
)
REQUEST_SUCCESS = RuntimeMetric("kvpilot_request_success_total", "vllm:request_success_total")
# Requests received (each sequence, counted as it reaches the engine, as request_success counts it
# when it ends): the autoscaler's arrival rate. vLLM has no such counter; the alias is the name it
# would have, and a vLLM pod, exporting neither, leaves the TTFT SLO without arrival rates.
REQUEST_RECEIVED = RuntimeMetric("kvpilot_request_received_total", "vllm:request_received_total")
GENERATION_TOKENS = RuntimeMetric("kvpilot_generation_tokens_total", "vllm:generation_tokens_total")

# The runtime's start-up, one gauge per phase in the order a start runs them, each the seconds it
# added to the start (runtime/kvpilot/runtime/server/startup.py): what a cold start is spent on.
STARTUP_PHASE_SECONDS = "kvpilot_startup_phase_seconds"
STARTUP_PHASES = (
    "interpreter",  # the process created -> `serve` runs (Python, site-packages)
    "imports",  # the server's and the engine's modules (torch) imported
    "http",  # the flags read, the HTTP app built, uvicorn started (/health answers from here)
    "model_located",  # --model as a local directory (hf:// and s3:// fetched), the engine config
    "kernel",  # model config read, hardware chosen, attention kernel loaded (or CUDA set up)
    "weights",  # the weights loaded and the KV cache allocated
    "warmup",  # the rest of the engine (grammar tables), --lora-modules, the step loop started
    "serving",  # /ready answers 200
)
# LoRA adapters in use (vLLM's, exported as vLLM writes it): a gauge whose labels name the adapters
# of the running and the waiting sequences, comma-separated, and max_lora (--max-loras); the value
# is the reading's time (the newest sample wins). The gateway's adapter-aware picking reads it.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# kvpilot only (vLLM counts no request per adapter): requests received per LoRA adapter (one per
# sequence, as REQUEST_RECEIVED), labelled `lora_name`; the operator's adapter placement reads
# each adapter's demand from it. As exposed (a counter's samples end in `_total`).
LORA_REQUESTS_RECEIVED = "kvpilot_lora_requests_received_total"
# kvpilot only: 1 per adapter the runtime has registered (loaded, servable), labelled
# `lora_name`; the gateway prefers the replicas that hold a request's adapter.
LORA_ADAPTER_LOADED = "kvpilot_lora_adapter_loaded"
LORA_NAME_LABEL = "lora_name"

# kvpilot-gateway's demand that no replica has seen yet, which the operator's autoscaler adds to
# the runtime's own figures. Labelled with the ModelDeployment a request is for (`md_namespace`,
# `md_name`, plus the served `model`): Prometheus' relabelling sets `namespace` and `pod` to the
# gateway pod's own. Only routes discovered from ModelDeployments carry them (static config: none).
GATEWAY_MD_NAMESPACE_LABEL = "md_namespace"
GATEWAY_MD_NAME_LABEL = "md_name"
# Requests held for a model with no ready replica (scale from zero), a gauge.
GATEWAY_REQUESTS_HELD = "kvpilot_gateway_requests_held"
# Requests waiting in the fair queue while the model's replicas are saturated (flow control,
# `--max-in-flight-per-replica`), a gauge: the runtime's waiting gauge never sees them.
GATEWAY_REQUESTS_QUEUED = "kvpilot_gateway_requests_queued"
# Requests that reached the fair queue, whether they went at once, waited, were refused or timed
# out (a counter, as exposed): under flow control the runtime's received counter counts only the
# ones let through, capped at the rate the replicas serve.
GATEWAY_REQUESTS_ARRIVED = "kvpilot_gateway_requests_arrived_total"
