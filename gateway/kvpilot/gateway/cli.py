"""`kvpilot-gateway`: the proxy in front of the model servers.

    kvpilot-gateway --config gateway.yaml --port 8080
    kvpilot-gateway --discovery kubernetes [--namespace NS ...] [--kubeconfig FILE] --port 8080

The CLI builds a RouteTable, fills it from the discovery source its flags name (`--config`: the
static file, loaded once; `--discovery kubernetes`: a watch on ModelDeployments and their
runtime pods, kube/discovery.py), and serves the proxy until SIGTERM/SIGINT. A discovery source runs
on the gateway's loop (or hands changes over with `loop.call_soon_threadsafe`) and may supply the
Waker that wakes models from zero; the static file has nothing to wake.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from aiohttp import web

from kvpilot.gateway.budget import setup as budget_setup
from kvpilot.gateway.cache.config import STORES, CacheSettings, CacheSpec, settings_from
from kvpilot.gateway.cache.policy import CachePolicy, build_store
from kvpilot.gateway.cache.scope import SCOPES
from kvpilot.gateway.config import ConfigError, load_cache_spec, load_routes, upstream_api_key
from kvpilot.gateway.edge import GatewayRunner
from kvpilot.gateway.exchange import Policy
from kvpilot.gateway.flow.gate import FlowOptions
from kvpilot.gateway.flow.tenancy import TenancyPolicy
from kvpilot.gateway.flow.vtc import TokenWeights
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.proxy import Gateway, ProxyOptions
from kvpilot.gateway.routing.cascade_policy import CascadePolicy
from kvpilot.gateway.routing.picking import STRATEGIES, PickPolicy
from kvpilot.gateway.routing.routes import RouteTable
from kvpilot.gateway.routing.wake import Waker

log = logging.getLogger("kvpilot.gateway")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot-gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, help="static routes: YAML `models: [...]`")
    parser.add_argument("--discovery", choices=["static", "kubernetes"], default="static",
                        help="static: the --config file; kubernetes: watch ModelDeployments "
                        "and their runtime pods")  # fmt: skip
    add_discovery_arguments(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--strategy", choices=STRATEGIES, default="prefix",
                        help="replica picking: prefix affinity with bounded loads (default), "
                        "least-load, or random (what a Service does)")  # fmt: skip
    parser.add_argument("--prefix-chars", type=int, default=ProxyOptions.prefix_chars,
                        help="prompt characters keying prefix affinity")  # fmt: skip
    parser.add_argument("--load-factor", type=float, default=PickPolicy.load_factor,
                        help="cap on a replica's load, times the mean")  # fmt: skip
    parser.add_argument("--lora-affinity", choices=["on", "off"], default="on",
                        help="prefer the replicas that hold a request's LoRA adapter (default);"
                        " off: pick as for any model, by the strategy alone")  # fmt: skip
    parser.add_argument("--max-attempts", type=int, default=ProxyOptions.max_attempts)
    parser.add_argument("--fallback-after", type=float, default=ProxyOptions.fallback_after_s,
                        help="seconds to wait for a replica before the fallbacks")  # fmt: skip
    parser.add_argument("--max-held", type=int, default=ProxyOptions.max_held_per_model,
                        help="requests held per model at zero replicas before 429")  # fmt: skip
    parser.add_argument("--max-request-body-bytes", type=int,
                        default=ProxyOptions.max_body_bytes)  # fmt: skip
    budget_setup.add_arguments(parser)
    add_flow_arguments(parser)
    parser.add_argument("--cache-store", choices=STORES,
                        help="turn the response cache on with this store (else the config "
                        "file's `cache:`; redis needs --redis-url)")  # fmt: skip
    parser.add_argument("--cache-scope", choices=SCOPES,
                        help="who shares cached answers under API keys: team (default), key, "
                        "or shared (else the config file's cache.scope)")  # fmt: skip
    parser.add_argument("--upstream-api-key-env", metavar="NAME",
                        help="environment variable holding the key sent to the replicas (their "
                        "--api-key); else the config file's upstream.apiKeyEnv")  # fmt: skip
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])  # fmt: skip
    return parser.parse_args(argv)


def build_options(args: argparse.Namespace) -> ProxyOptions:
    numbers = {"--prefix-chars": args.prefix_chars, "--max-attempts": args.max_attempts,
               "--fallback-after": args.fallback_after, "--max-held": args.max_held,
               "--max-request-body-bytes": args.max_request_body_bytes}  # fmt: skip
    for flag, value in numbers.items():
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    policy = PickPolicy(args.strategy, args.load_factor, lora_affinity=args.lora_affinity == "on")
    return ProxyOptions(
        policy=policy,
        prefix_chars=args.prefix_chars,
        max_attempts=args.max_attempts,
        fallback_after_s=args.fallback_after,
        max_held_per_model=args.max_held,
        max_body_bytes=args.max_request_body_bytes,
        upstream_api_key=upstream_api_key(args.upstream_api_key_env, args.config),
        flow=FlowOptions(args.max_in_flight_per_replica, args.max_queued_per_tenant,
                         TokenWeights(args.fair_input_weight, args.fair_output_weight)),
    )  # fmt: skip


def add_flow_arguments(parser: argparse.ArgumentParser) -> None:
    """The fair queue in front of each model's replicas (flow/gate.py)."""
    parser.add_argument("--max-in-flight-per-replica", type=int, default=None,
                        help="a model's replicas count as saturated at this many of this "
                        "gateway's requests each (near their --max-num-seqs); more wait in a "
                        "fair queue per tenant. Default: no limit, nothing waits")  # fmt: skip
    parser.add_argument("--max-queued-per-tenant", type=int,
                        default=FlowOptions.max_waiting_per_tenant,
                        help="requests a tenant may have waiting per model and priority; "
                        "more are refused with 429")  # fmt: skip
    parser.add_argument("--fair-input-weight", type=float, default=TokenWeights.input,
                        help="a prompt token's cost in the fair queue's counters")  # fmt: skip
    parser.add_argument("--fair-output-weight", type=float, default=TokenWeights.output,
                        help="an output token's cost in the fair queue's counters")  # fmt: skip


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """`--namespace` (repeatable) and `--kubeconfig`, for `--discovery kubernetes`."""
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch ModelDeployments only in this namespace (repeat for several; default: all)",
    )
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config, else in-cluster)",
    )


def start_discovery(
    args: argparse.Namespace, table: RouteTable
) -> tuple[Waker | None, Callable[[], None]]:
    """Fill `table` from the source the flags name: the Waker of a source that can wake models,
    and the function that stops the source."""
    if args.discovery == "kubernetes":
        if args.config is not None:
            raise ValueError("--config is for --discovery static; give one or the other")
        # Imported here: the Kubernetes client is most of the start-up of a static gateway.
        from kvpilot.gateway.kube import discovery

        loop = asyncio.get_running_loop()
        stop, waker = discovery.start_kubernetes_discovery(
            table, loop, args.namespace, args.kubeconfig
        )
        return waker, stop
    if args.config is None:
        raise ValueError("give --config FILE (static routes) or --discovery kubernetes")
    table.replace_all(load_routes(args.config))
    return None, lambda: None


def cache_settings(args: argparse.Namespace) -> CacheSettings:
    spec = load_cache_spec(args.config) if args.config is not None else CacheSpec()
    redis_url = args.redis_url or budget_setup.read_settings(args.config).redis_url
    return settings_from(spec, args.cache_store, redis_url, args.cache_scope)


def build_policies(
    table: RouteTable, settings: CacheSettings, metrics: GatewayMetrics, upstream_key: bool
) -> tuple[list[Policy], CachePolicy]:
    """In order: cascade (may re-route), then the cache (keyed on the routed model); serve()
    puts the keys policy before them and the budget after."""
    cache = CachePolicy(settings, build_store(settings, metrics), metrics, upstream_key)
    return [CascadePolicy(table, metrics), cache], cache


async def serve(args: argparse.Namespace, options: ProxyOptions) -> None:
    table = RouteTable()
    settings = cache_settings(args)
    waker, stop_discovery = start_discovery(args, table)
    metrics = GatewayMetrics()
    budgets = budget_setup.build(args, table, metrics)
    upstream_key = options.upstream_api_key is not None
    cascade_and_cache, cache = build_policies(table, settings, metrics, upstream_key)
    # keys, tenancy (its priority), cascade, cache, budget (issue 16); a hit answers before the
    # budget, which counts it as a request and refuses it over a limit (cache.gate, issue 40)
    policies: list[Policy] = ([budgets.keys, TenancyPolicy(), *cascade_and_cache, budgets.budget]
                if budgets is not None else [TenancyPolicy(), *cascade_and_cache])  # fmt: skip
    if budgets is not None:
        cache.gate = budgets.budget
    gateway = Gateway(table, options, waker, metrics, policies)
    app = gateway.app()
    if budgets is not None:
        app.cleanup_ctx.append(budgets.running)
        gateway.readiness.append(budgets.unready)
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("kvpilot-gateway on %s:%d routing %s", args.host, args.port, table.models())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await cache.close()
    stop_discovery()


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (the gateway extra brings it; not on Windows), as
    uvicorn runs the runtime: less CPU per relayed chunk than asyncio's loop, which every stream
    pays once per token; asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    try:
        options = build_options(args)
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(serve(args, options))
    except (ConfigError, ValueError) as error:
        sys.exit(f"kvpilot-gateway: {error}")


if __name__ == "__main__":
    main()
