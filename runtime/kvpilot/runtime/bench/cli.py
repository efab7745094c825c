"""`kvpilot bench`: load-test any OpenAI-compatible endpoint (kvpilot, vLLM, TGI ...).

    kvpilot bench --base-url http://127.0.0.1:8000 --num-prompts 200 --concurrency 8 \\
        --input-len 256 --output-len 128 --goodput ttft:500 tpot:50 \\
        --price-per-gpu-hour 2.5 --result-json out/bench.json --plot-dir out/

Synthetic prompts are --input-len tokens long, counted by the model's tokenizer: --tokenizer DIR
(a local model directory), else the server's POST /tokenize (vLLM and kvpilot answer it).

Several tenants in one run, each with its own key, load, priority and shape, reported per tenant
(requests, 429s, TTFT, TPOT, tokens and each one's share; fields left out come from the flags):

    kvpilot bench --base-url http://gateway:8080 --tokenizer DIR --num-prompts 100 \\
        --tenant name=chat,key=sk-c,rate=1,priority=0,input-len=64,output-len=16 \\
        --tenant name=batch,key=sk-b,concurrency=16,priority=5,input-len=256,output-len=64

or --tenants FILE (YAML or JSON: a list of those mappings).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from .client import Endpoint
from .output import format_summary, result_document, write_json, write_plots
from .runner import Load, run, run_loads
from .stats import Summary, parse_percentiles, parse_slos, summarize
from .tenants import (
    TENANT_FIELDS,
    TenantReport,
    TenantSpec,
    check_tenants,
    contended_window,
    format_tenants,
    load_tenants_file,
    parse_tenant,
    tenant_reports,
)
from .tokens import LocalTokenCounter, ServerTokenCounter, TokenCounter
from .workload import BenchRequest, arrival_times, load_jsonl, synthetic_requests


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None
    chat: bool
    api_key: str | None
    dataset: str | None
    tokenizer: str | None
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    concurrency: int | None  # closed loop when set
    request_rate: float  # open loop otherwise; inf = all at once
    burstiness: float
    max_concurrency: int | None
    seed: int
    temperature: float
    ignore_eos: bool
    slos: dict[str, float]
    percentiles: tuple[float, ...]
    price_per_gpu_hour: float | None
    num_gpus: int
    result_json: str | None
    plot_dir: str | None
    detailed: bool
    progress: bool
    timeout_s: float
    tenants: tuple[TenantSpec, ...] = ()  # several tenants in one run; empty: one, the flags'

    def __post_init__(self) -> None:
        checks = [
            (self.num_prompts >= 1, f"num_prompts must be >= 1, got {self.num_prompts}"),
            (self.concurrency is None or self.concurrency >= 1, "concurrency must be >= 1"),
            (
                self.max_concurrency is None or self.max_concurrency >= 1,
                "max_concurrency must be >= 1",
            ),
            (self.request_rate > 0, f"request_rate must be > 0, got {self.request_rate}"),
            (self.num_gpus >= 1, f"num_gpus must be >= 1, got {self.num_gpus}"),
            (
                self.price_per_gpu_hour is None or self.price_per_gpu_hour >= 0,
                "price_per_gpu_hour must be >= 0",
            ),
            (self.timeout_s > 0, "timeout must be > 0"),
            (
                not (self.tenants and self.dataset),
                "--dataset runs one tenant; give each tenant its shape with input-len and "
                "output-len in --tenant instead",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpilot bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", help='JSONL: {"prompt": ...} or {"messages": [...]}, "max_tokens"')
    p.add_argument(
        "--tokenizer",
        help="local model directory whose tokenizer.json counts the synthetic prompts' tokens "
        "(default: the server's /tokenize)",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="synthetic prompt length in tokens (completions: as the server counts the prompt; "
        "chat: the message content)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=64,
        help="max_tokens per request (with --ignore-eos, exactly this many tokens)",
    )
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary +/- this ratio")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop with N clients")
    mode.add_argument("--request-rate", type=float, default=math.inf, help="open loop, req/s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="vLLM/kvpilot extension")
    p.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS",
    )
    p.add_argument("--percentiles", default="50,95,99")
    p.add_argument("--price-per-gpu-hour", type=float)
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--result-json")
    p.add_argument("--plot-dir")
    p.add_argument("--save-detailed", action="store_true", help="per-request timings in JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    tenants = p.add_mutually_exclusive_group()
    tenants.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="FIELD=VALUE,...",
        help=f"one tenant of a multi-tenant run (repeat it); fields: {', '.join(TENANT_FIELDS)}",
    )
    tenants.add_argument("--tenants", metavar="FILE", help="tenants from YAML or JSON (a list)")
    return p


def default_tenant(config: BenchConfig) -> TenantSpec:
    """What a tenant's fields left out are: the run's own flags."""
    return TenantSpec(
        name="default",
        api_key=config.api_key,
        request_rate=config.request_rate,
        concurrency=config.concurrency,
        priority=None,
        input_len=config.input_len,
        output_len=config.output_len,
        num_prompts=config.num_prompts,
    )


def parse_tenants(texts: list[str], file: str | None, config: BenchConfig) -> list[TenantSpec]:
    defaults = default_tenant(config)
    if file:
        return check_tenants(load_tenants_file(Path(file), defaults))
    return check_tenants([parse_tenant(text, defaults) for text in texts])


def parse_args(argv: list[str]) -> BenchConfig:
    a = build_parser().parse_args(argv)
    config = BenchConfig(
        base_url=a.base_url,
        model=a.model,
        chat=a.api == "chat",
        api_key=a.api_key,
        dataset=a.dataset,
        tokenizer=a.tokenizer,
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.range_ratio,
        concurrency=a.concurrency,
        request_rate=a.request_rate,
        burstiness=a.burstiness,
        max_concurrency=a.max_concurrency,
        seed=a.seed,
        temperature=a.temperature,
        ignore_eos=a.ignore_eos,
        slos=parse_slos(a.goodput),
        percentiles=parse_percentiles(a.percentiles),
        price_per_gpu_hour=a.price_per_gpu_hour,
        num_gpus=a.num_gpus,
        result_json=a.result_json,
        plot_dir=a.plot_dir,
        detailed=a.save_detailed,
        progress=not a.no_progress,
        timeout_s=a.timeout,
    )
    tenants = parse_tenants(a.tenant, a.tenants, config)
    return replace(config, tenants=tuple(tenants)) if tenants else config


def build_requests(config: BenchConfig, model: str) -> list[BenchRequest]:
    if config.dataset:
        return load_jsonl(Path(config.dataset), config.num_prompts, config.chat, config.output_len)
    return synthetic_requests(
        config.num_prompts,
        input_len=config.input_len,
        output_len=config.output_len,
        range_ratio=config.range_ratio,
        seed=config.seed,
        chat=config.chat,
        counter=token_counter(config, model),
    )


def token_counter(config: BenchConfig, model: str) -> TokenCounter:
    if config.tokenizer:
        return LocalTokenCounter(config.tokenizer)
    return ServerTokenCounter(config.base_url, model, probe_key(config), config.timeout_s)


def probe_key(config: BenchConfig) -> str | None:
    """The key that lists models and counts tokens: --api-key, else the first tenant's."""
    return config.api_key or next((t.api_key for t in config.tenants if t.api_key), None)


def discover_model(config: BenchConfig) -> str:
    root = config.base_url.rstrip("/")
    root = root if root.endswith("/v1") else f"{root}/v1"
    key = probe_key(config)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{root}/models", headers=headers, timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def tenant_load(config: BenchConfig, model: str, tenant: TenantSpec, index: int) -> Load:
    """A tenant's requests (prompts and arrival times of its own seed) at its own endpoint."""
    seed = config.seed + index
    requests = synthetic_requests(
        tenant.num_prompts,
        input_len=tenant.input_len,
        output_len=tenant.output_len,
        range_ratio=config.range_ratio,
        seed=seed,
        chat=config.chat,
        counter=token_counter(config, model),
    )
    endpoint = Endpoint(config.base_url, model, config.chat, tenant.api_key, config.temperature,
                        config.ignore_eos, tenant.priority)  # fmt: skip
    times = None
    if tenant.concurrency is None:
        times = arrival_times(len(requests), tenant.request_rate, config.burstiness, seed)
    return Load(
        endpoint, requests, tenant.concurrency, times, config.max_concurrency, tenant.delay_s
    )


def benchmark_tenants(config: BenchConfig, model: str) -> tuple[Summary, list[TenantReport], dict]:
    """Every tenant at once; the pooled summary, one report per tenant, the JSON document."""
    loads = [tenant_load(config, model, t, i) for i, t in enumerate(config.tenants)]
    per_load, duration = asyncio.run(
        run_loads(loads, timeout_s=config.timeout_s, progress=config.progress)
    )
    by_name = {t.name: rs for t, rs in zip(config.tenants, per_load, strict=True)}
    reports = tenant_reports(list(config.tenants), by_name, duration, config.percentiles)
    pooled = [r for rs in per_load for r in rs]
    summary = summarize(
        pooled,
        duration,
        percentiles=config.percentiles,
        slos=config.slos,
        price_per_gpu_hour=config.price_per_gpu_hour,
        num_gpus=config.num_gpus,
    )
    settings = {k: v for k, v in asdict(config).items() if k not in ("tenants", "api_key")}
    settings.update(model=model, request_rate=str(config.request_rate))
    document = result_document(settings, summary, pooled, config.detailed)
    document["tenants"] = {r.spec.name: r.to_dict() for r in reports}
    document["contended_window_s"] = contended_window(by_name)
    if config.result_json:
        write_json(Path(config.result_json), document)
    if config.plot_dir:
        write_plots(Path(config.plot_dir), pooled)
    return summary, reports, document


def benchmark(config: BenchConfig) -> tuple[Summary, dict]:
    """Run the benchmark `config` describes; returns the summary and the JSON document."""
    model = config.model or discover_model(config)
    if config.tenants:
        summary, _, document = benchmark_tenants(config, model)
        return summary, document
    endpoint = Endpoint(
        config.base_url, model, config.chat, config.api_key, config.temperature, config.ignore_eos
    )
    requests = build_requests(config, model)
    times = None
    if config.concurrency is None:
        times = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)
    results, duration = asyncio.run(
        run(
            endpoint,
            requests,
            concurrency=config.concurrency,
            times=times,
            max_concurrency=config.max_concurrency,
            timeout_s=config.timeout_s,
            progress=config.progress,
        )
    )
    summary = summarize(
        results,
        duration,
        percentiles=config.percentiles,
        slos=config.slos,
        price_per_gpu_hour=config.price_per_gpu_hour,
        num_gpus=config.num_gpus,
    )
    settings = {**asdict(config), "model": model, "request_rate": str(config.request_rate)}
    document = result_document(settings, summary, results, config.detailed)
    if config.result_json:
        write_json(Path(config.result_json), document)
    if config.plot_dir:
        write_plots(Path(config.plot_dir), results)
    return summary, document


def describe(error: Exception) -> str:
    """The error, with the URL it happened at where httpx has one: a refused connection says
    only "[Errno 111] Connection refused"."""
    if not isinstance(error, httpx.TransportError):
        return str(error)
    try:
        url = error.request.url
    except RuntimeError:  # raised before any request was made
        return str(error)
    reason = str(error) or type(error).__name__
    return f"cannot reach {url}: {reason} (is the server up? --base-url says where it is)"


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        if config.tenants:
            model = config.model or discover_model(config)
            summary, reports, document = benchmark_tenants(config, model)
        else:
            summary, _ = benchmark(config)
    except (ValueError, OSError, httpx.HTTPError) as exc:
        print(f"kvpilot bench: {describe(exc)}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if config.tenants:
        print(format_tenants(reports, document["contended_window_s"]))
    return 0 if summary.completed else 1
