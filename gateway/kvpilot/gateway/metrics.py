"""The gateway's Prometheus metrics (its own registry, served on /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.contract import metric_names

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvpilot_gateway_requests", "Requests answered, by requested model, the target that "
            "served (model or provider; 'none' when none did) and status code.",
            ["model", "target", "code"], registry=r,
        )  # fmt: skip
        # md_namespace/md_name, not namespace: Prometheus relabels namespace/pod to the gateway's.
        # The operator's autoscaler reads these three (contract.metric_names) as demand that no
        # replica has seen yet.
        deployment = [
            metric_names.GATEWAY_MD_NAMESPACE_LABEL, metric_names.GATEWAY_MD_NAME_LABEL, "model"
        ]  # fmt: skip
        self.held = Gauge(
            metric_names.GATEWAY_REQUESTS_HELD,
            "Requests held for a model with no ready replica (scale from zero).",
            deployment, registry=r,
        )  # fmt: skip
        self.queued = Gauge(
            metric_names.GATEWAY_REQUESTS_QUEUED,
            "Requests waiting in the fair queue while the model's replicas are saturated.",
            deployment, registry=r,
        )  # fmt: skip
        self.arrived = Counter(
            metric_names.GATEWAY_REQUESTS_ARRIVED.removesuffix("_total"),
            "Requests that reached the fair queue (sent at once, queued, refused or timed out).",
            deployment, registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvpilot_gateway_retries", "Requests retried on another replica, by reason.",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "kvpilot_gateway_fallbacks", "Requests sent to a fallback target, by reason.",
            ["model", "target", "reason"], registry=r,
        )  # fmt: skip
        self.picks = Counter(
            "kvpilot_gateway_picks", "Replicas picked for a request (retries included).",
            ["model", "backend"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvpilot_gateway_upstream_ttft_seconds",
            "From sending a request upstream to its first response byte.",
            ["model", "target"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        # The response cache (cache/policy.py).
        self.cache_hits = Counter(
            "kvpilot_gateway_cache_hits", "Requests answered from the response cache.",
            ["model"], registry=r,
        )  # fmt: skip
        self.cache_misses = Counter(
            "kvpilot_gateway_cache_misses",
            "Cacheable requests sent upstream (not found, or Cache-Control: no-cache).",
            ["model"], registry=r,
        )  # fmt: skip
        self.cache_skips = Counter(
            "kvpilot_gateway_cache_skips", "Requests that left the cache out, by reason "
            "(not_deterministic, unknown_field, request_field, no_store).",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.cache_stores = Counter(
            "kvpilot_gateway_cache_stores", "Answers stored in the response cache.",
            ["model"], registry=r,
        )  # fmt: skip
        self.cache_evictions = Counter(
            "kvpilot_gateway_cache_evictions",
            "Entries that left the response cache (either store), by reason (expired, size).",
            ["reason"], registry=r,
        )  # fmt: skip
        # Cascade rules (routing/cascade_policy.py).
        self.cascade = Counter(
            "kvpilot_gateway_cascade", "Requests a cascade rule sent to another model.",
            ["model", "target", "rule"], registry=r,
        )  # fmt: skip
        # Keys and budgets (budget/policy.py): spend and tokens as settled from the usage.
        self.spend = Counter(
            "kvpilot_gateway_spend", "Spend settled from usage and the model's price per 1M "
            "tokens, by API key (its hash prefix), team and model.",
            ["key_id", "team", "model"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "kvpilot_gateway_tokens", "Tokens settled from usage (input or output), by API key, "
            "team and model.", ["key_id", "team", "model", "kind"], registry=r,
        )  # fmt: skip
        self.budget_refusals = Counter(
            "kvpilot_gateway_budget_refusals", "Requests refused with 429 over a limit, by the "
            "limit's scope (key:ID or team:NAME), unit and window.",
            ["scope", "unit", "window"], registry=r,
        )  # fmt: skip
        self.budget_store_errors = Counter(
            "kvpilot_gateway_budget_store_errors", "Budget store (Redis) failures, by operation "
            "and what the request got (refused: fail closed, admitted: fail open).",
            ["operation", "decision"], registry=r,
        )  # fmt: skip
        self.budget_store_up = Gauge(
            "kvpilot_gateway_budget_store_up",
            "1 while the budget store answered its last call, 0 after a failure.", registry=r,
        )  # fmt: skip
        # Flow control (flow/gate.py), per model, tenant (team, key:ID, or "-" without keys)
        # and priority (-9..9, then "<=-10" and ">=10" as the runtime labels them,
        # contract.priority.label: a header cannot mint label values).
        flow = ["model", "tenant", "priority"]
        self.flow_waiting = Gauge(
            "kvpilot_gateway_flow_waiting",
            "Requests waiting in the fair queue for a saturated model.", flow, registry=r,
        )  # fmt: skip
        self.flow_queue_time = Histogram(
            "kvpilot_gateway_flow_queue_seconds",
            "Time from reaching the fair queue to being sent upstream (0 when there was room).",
            flow, buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.flow_ttft = Histogram(
            "kvpilot_gateway_flow_ttft_seconds",
            "From reaching the fair queue to the answer's first byte (the wait included).",
            flow, buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.flow_tokens = Counter(
            "kvpilot_gateway_flow_tokens", "Tokens served (input or output: the upstream's "
            "usage, else the prompt's estimate and the chunks relayed).", [*flow, "kind"],
            registry=r,
        )  # fmt: skip
        self.flow_refusals = Counter(
            "kvpilot_gateway_flow_refusals",
            "Requests refused (429 unless a fallback took them): the tenant's queue was full.",
            flow, registry=r,
        )  # fmt: skip
