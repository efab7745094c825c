"""kvpilot-gateway: what prefix affinity buys over random routing (the proxy's own cost is
bench.gateway_overhead's).

    .venv/bin/python -m bench.gateway_routing [--tenants 16] [--questions 8]
        [--open-questions 8] [--rates R1,R2,...] [--seed 0]

Two real `kvpilot-runtime serve` replicas of tiny-llama and real `kvpilot-gateway` processes
(static config), driven by `kvpilot bench` (streamed, so TTFT is measured at the client).
(a) Shared prefixes: 16 tenants, each with a long system prompt of its own (sized to fit
tiny-llama's 2048-token context) and distinct short questions, shuffled, 16 clients; the gateway
with prefix affinity (CHWBL), least-load and random routing over the two replicas, side by side,
plus one replica with both replicas' KV pools, seeing all the traffic, as the prefix-cache
reference. Each phase uses tenants of its own, so no
phase finds another's prefixes cached; each phase first sends one warm-up question per tenant
through the same route and measures the rest (the steady state of a long-lived deployment, not
each tenant's one-off first prefill). Hit rate: prefix-cache hits / queries (tokens) over both
replicas during the phase (the runtime's vllm:prefix_cache_* counters).
(b) The same workload, open loop: requests arrive as a Poisson process (seeded, so every routing
gets the same arrival times at a rate) at a few offered rates, by default chosen from (a)'s req/s
(half of random's, random's, halfway from random's to prefix's; or --rates), for each routing
over the same two replicas; fresh tenants per (rate, routing), warmed up as in (a) with a closed
loop of one question per tenant. A closed loop of N clients never has more than N requests
queued; arrivals that do not wait for answers let a queue grow when a routing falls behind, which
is the load the published gateway comparisons measure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import server_common
from bench.report import markdown_table, write_section
from kvpilot.runtime.bench.cli import benchmark, parse_args
from kvpilot.runtime.bench.stats import Summary
from kvpilot.runtime.bench.tokens import LocalTokenCounter

MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"
MAX_MODEL_LEN = 2048
SYSTEM_TOKENS = 1000  # per tenant, as the workload; + question + output < 2048
QUESTION_TOKENS = 32
OUTPUT_TOKENS = 16
# The KV pool is the scarce resource, as it is for real models on GPUs: 24 MiB = ~12k tokens per
# replica holds ~3/4 of the 16 tenants' prefixes (16k tokens), the two pools together all of them
# with room for the running requests. Random routing brings every tenant to both replicas, which
# then evict each other's prefixes; affinity keeps each tenant's on one. (At 40 MiB one pool
# held every prefix: random routing lost only each tenant's first request per replica.)
KV_CACHE_MIB = 24
KV_BYTES_PER_TOKEN = 2048  # tiny-llama, fp32
STRATEGIES = ("prefix", "least-load", "random")


@contextmanager
def runtime_replicas(count: int, limits: list[str]) -> Iterator[list[str]]:
    """`count` `kvpilot-runtime serve` processes of tiny-llama (bench.server_common's); their base
    URLs once all are ready."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # steadier on a shared CPU (server_throughput)
    with ExitStack() as stack:
        urls = [stack.enter_context(server_common.runtime_server(MODEL, *limits, env=env))[0]
                for _ in range(count)]  # fmt: skip
        yield urls


@contextmanager
def gateway(backends: list[str], strategy: str, workdir: Path, *flags: str) -> Iterator[str]:
    """A `kvpilot-gateway` process routing model `tiny` to `backends` with `strategy` (more CLI
    `flags` if given); its base URL."""
    config = {"models": [{"name": "tiny", "backends": backends}]}
    with server_common.gateway_server(config, workdir, "--strategy", strategy, *flags) as url:
        yield url


def run_bench(url: str, *args: str) -> Summary:
    config = parse_args(["--base-url", url, "--model", "tiny", "--no-progress", "--tokenizer",
                         str(MODEL), *args])  # fmt: skip
    summary, _ = benchmark(config)
    if summary.failed:
        raise RuntimeError(f"{summary.failed} requests failed: {summary.errors}")
    return summary


def text_pool() -> list[str]:
    """Words of text every machine has (the pydoc topics), to cut tenant prompts from."""
    from pydoc_data.topics import topics

    return " ".join(topics[k] for k in sorted(topics)).split()


def cut(words: list[str], start: int, num_tokens: int, tokens: LocalTokenCounter) -> str:
    """Words from `start` adding up to about `num_tokens` tokens."""
    end = start + num_tokens // 2
    while tokens.count(" ".join(words[start:end]), False) < num_tokens:
        end += 8
    return " ".join(words[start:end])


@dataclass(frozen=True)
class Workload:
    warmup: Path  # one question per tenant: each tenant has been seen once before the measure
    measured: Path


def tenant_workload(phase: int, tenants: int, questions: int, workdir: Path) -> Workload:
    """Chat records: every tenant's system prompt (its own text, distinct per phase) with
    distinct short questions, shuffled: the first question of each tenant warms up, the other
    `questions` are measured. The figures are the steady state a long-lived deployment sees,
    not each tenant's one-off first prefill."""
    words, tokens = text_pool(), LocalTokenCounter(MODEL)
    stride = len(words) // (4 * tenants + 1)
    rng = random.Random(phase)
    warmup: list[dict[str, object]] = []
    measured: list[dict[str, object]] = []
    for tenant in range(tenants):
        offset = rng.randrange(len(words) - 2 * stride)
        system = f"Tenant {phase}-{tenant}. " + cut(words, offset, SYSTEM_TOKENS, tokens)
        for q in range(questions + 1):
            start = rng.randrange(len(words) - 100)
            question = f"Question {q}: " + cut(words, start, QUESTION_TOKENS, tokens) + "?"
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            (measured if q else warmup).append({"messages": messages, "max_tokens": OUTPUT_TOKENS})
    rng.shuffle(measured)
    paths = Workload(workdir / f"warmup-{phase}.jsonl", workdir / f"measured-{phase}.jsonl")
    for path, records in ((paths.warmup, warmup), (paths.measured, measured)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:request_success_total")  # fmt: skip


def replica_counters(url: str) -> dict[str, float]:
    """The prefix cache's hits and queries (tokens) and the requests served, of one replica."""
    counters = dict.fromkeys(COUNTERS, 0.0)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in counters:
                counters[sample.name] += sample.value
    return counters


@dataclass(frozen=True)
class Phase:
    name: str
    summary: Summary
    hit_rate: float
    served: list[int]  # requests per replica


def closed_loop_load(clients: int) -> list[str]:
    return ["--concurrency", str(clients)]


def poisson_load(rate: float, seed: int) -> list[str]:
    """Poisson arrivals at `rate` req/s (burstiness 1), no cap on requests in flight; the seed
    fixes the arrival times, so every routing at this rate gets the same ones."""
    return ["--request-rate", str(rate), "--burstiness", "1", "--seed", str(seed)]


def run_chat(url: str, dataset: Path, load: list[str]) -> Summary:
    count = sum(1 for _ in dataset.open())
    return run_bench(url, "--api", "chat", "--dataset", str(dataset), "--num-prompts", str(count),
                     *load)  # fmt: skip


def run_phase(
    name: str, url: str, replicas: list[str], workload: Workload, tenants: int,
    load: list[str] | None = None,
) -> Phase:  # fmt: skip
    """Warm up through the same route (a closed loop of `tenants` clients), then measure under
    `load` (the same closed loop by default): counters and latencies of the measured part only."""
    run_chat(url, workload.warmup, closed_loop_load(tenants))
    before = [replica_counters(r) for r in replicas]
    summary = run_chat(url, workload.measured, load or closed_loop_load(tenants))
    after = [replica_counters(r) for r in replicas]
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    hits, queries = (sum(d[k] for d in delta) for k in COUNTERS[:2])
    served = [int(d["vllm:request_success_total"]) for d in delta]
    return Phase(name, summary, hits / queries if queries else 0.0, served)


def measure_prefix(replicas: list[str], workdir: Path, tenants: int, questions: int) -> list[Phase]:
    phases = []
    for index, strategy in enumerate(STRATEGIES, start=1):
        workload = tenant_workload(index, tenants, questions, workdir)
        with gateway(replicas, strategy, workdir) as url:
            phases.append(run_phase(strategy, url, replicas, workload, tenants))
    return phases


def sweep_rates(random_rps: float, prefix_rps: float) -> list[float]:
    """The open loop's offered rates (req/s, one decimal) from the closed loop's req/s: half of
    random's (neither routing loaded), random's (random at its capacity, prefix below it) and
    halfway to prefix's (random past its capacity, prefix not yet). Where prefix was not faster
    the last two coincide, and the sweep has two rates."""
    rates = [random_rps / 2, random_rps, (random_rps + max(prefix_rps, random_rps)) / 2]
    return sorted({round(r, 1) for r in rates if round(r, 1) > 0})


@dataclass(frozen=True)
class OpenPhase:
    rate: float  # offered, req/s
    phase: Phase


def measure_open_loop(
    replicas: list[str], workdir: Path, args: argparse.Namespace, rates: list[float]
) -> list[OpenPhase]:
    """Every routing at every rate, each on tenants of its own (workload phases 4 on; (a) and the
    reference use 0-3, so no run finds another's prefixes cached)."""
    results = []
    for index, (rate, strategy) in enumerate(
        ((r, s) for r in rates for s in STRATEGIES), start=len(STRATEGIES) + 1
    ):
        workload = tenant_workload(index, args.tenants, args.open_questions, workdir)
        with gateway(replicas, strategy, workdir) as url:
            load = poisson_load(rate, args.seed)
            phase = run_phase(strategy, url, replicas, workload, args.tenants, load)
        results.append(OpenPhase(rate, phase))
    return results


def measure_reference(limits: list[str], workdir: Path, tenants: int, questions: int) -> Phase:
    """One replica with the KV pool of both, seeing all the traffic: the hit rate a cache that
    every request reaches gets from the same memory."""
    workload = tenant_workload(0, tenants, questions, workdir)
    with runtime_replicas(1, limits) as (url,):
        return run_phase("one replica alone, both pools", url, [url], workload, tenants)


PREFIX_COLUMNS = ["routing", "TTFT p95 (ms)", "TTFT p50 (ms)", "req/s", "requests per replica",
                  "prefix-cache hit rate", "hit rate / one replica's"]  # fmt: skip


def pool_tokens(args: argparse.Namespace) -> int:
    """The tokens one replica's KV pool holds (at the pinned dtype's bytes per token)."""
    return args.kv_cache_mib * 1024**2 // KV_BYTES_PER_TOKEN


def held_share(args: argparse.Namespace) -> float:
    """The share of all tenants' system prompts one replica's KV pool can hold."""
    return pool_tokens(args) / (SYSTEM_TOKENS * args.tenants)


def p95(summary: Summary) -> float:
    return summary.ttft_ms.percentiles["p95"]


def p50(summary: Summary) -> float:
    return summary.ttft_ms.percentiles["p50"]


def workload_words(args: argparse.Namespace, questions: int) -> str:
    return (
        f"{args.tenants} tenants x {questions} questions (after one warm-up question per tenant "
        f"through the same route, {args.tenants} clients in a closed loop, not counted: the "
        f"steady state), system prompts of ~{SYSTEM_TOKENS} tokens, questions of "
        f"~{QUESTION_TOKENS} tokens, {OUTPUT_TOKENS} output tokens, chat, streamed"
    )


def report_closed(args: argparse.Namespace, phases: list[Phase]) -> str:
    reference = phases[-1].hit_rate
    rows = [[p.name, f"{p95(p.summary):.1f}", f"{p50(p.summary):.1f}",
             f"{p.summary.request_throughput:.2f}", " / ".join(map(str, p.served)),
             f"{100 * p.hit_rate:.1f}%", f"{p.hit_rate / reference:.2f}" if reference else "-"]
            for p in phases]  # fmt: skip
    ratio = p95(by_name(phases, "random").summary) / p95(by_name(phases, "prefix").summary)
    return (
        f"(a) Shared prefixes, closed loop: {workload_words(args, args.questions)}; measured with "
        f"{args.tenants} clients in a closed loop (a client sends its next question when its "
        f"last is answered), two replicas with a {args.kv_cache_mib} MiB KV pool each "
        f"(~{pool_tokens(args) // 1000}k tokens, {held_share(args):.0%} of the tenants' "
        "prefixes; together they hold them all); the last row: one replica with both pools "
        "seeing all the traffic, the hit-rate reference.\n\n"
        + markdown_table(PREFIX_COLUMNS, rows)
        + f"\n\nTTFT p95, random / prefix affinity: {ratio:.2f}x (goal >= 3x)\n\n"
    )


def by_name(phases: list[Phase], name: str) -> Phase:
    return next(p for p in phases if p.name == name)


OPEN_COLUMNS = ["offered req/s", "routing", "TTFT p95 (ms)", "TTFT p50 (ms)", "req/s achieved",
                "requests per replica", "prefix-cache hit rate"]  # fmt: skip


def report_open(args: argparse.Namespace, rates: list[float], runs: list[OpenPhase]) -> str:
    rows = [[f"{r.rate:.1f}", r.phase.name, f"{p95(r.phase.summary):.1f}",
             f"{p50(r.phase.summary):.1f}", f"{r.phase.summary.request_throughput:.2f}",
             " / ".join(map(str, r.phase.served)), f"{100 * r.phase.hit_rate:.1f}%"]
            for r in runs]  # fmt: skip
    ratios = [[f"{rate:.1f}", f"{ratio:.2f}x", "met" if ratio >= 3 else "not met"]
              for rate, ratio in p95_ratios(rates, runs)]  # fmt: skip
    chosen = "given with --rates" if args.rates else (
        "half of random's closed-loop req/s in (a), random's, and halfway from random's to "
        "prefix's"
    )  # fmt: skip
    return (
        f"(b) Shared prefixes, open loop: the workload of (a) ({args.tenants} tenants x "
        f"{args.open_questions} measured questions, fresh tenants for every row, warmed up as in "
        "(a)), but the measured questions arrive as a Poisson process at the offered rate "
        f"(seed {args.seed}: every routing gets the same arrival times at a rate), whether or "
        "not earlier ones were answered, so a routing that falls behind builds a queue; same two "
        f"replicas. Offered rates: {chosen}. Above a routing's capacity its queue grows for as "
        f"long as the run lasts ({args.tenants * args.open_questions} requests), so those rows' "
        "TTFT depends on the run's length, not only on the rate.\n\n"
        + markdown_table(OPEN_COLUMNS, rows)
        + "\n\n"
        + markdown_table(["offered req/s", "TTFT p95, random / prefix", "goal >= 3x"], ratios)
        + "\n"
    )


def p95_ratios(rates: list[float], runs: list[OpenPhase]) -> list[tuple[float, float]]:
    def at(rate: float, name: str) -> float:
        return p95(next(r.phase.summary for r in runs if r.rate == rate and r.phase.name == name))

    return [(rate, at(rate, "random") / at(rate, "prefix")) for rate in rates]


def report(
    args: argparse.Namespace, phases: list[Phase], rates: list[float],
    runs: list[OpenPhase],
) -> str:  # fmt: skip
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"Load average of this machine when the run ended: {load} (other jobs share its cores: "
        "the replicas, the gateway and the client compete with them and with each other, so "
        "wall-clock figures swing from round to round; read the per-round columns before the "
        "ratios).\n\n" + report_closed(args, phases) + report_open(args, rates, runs)
    )


def replica_limits(args: argparse.Namespace, kv_cache_mib: int) -> list[str]:
    # The dtype is pinned so KV_BYTES_PER_TOKEN holds: `--dtype auto` computes (and keeps K/V)
    # in bf16 on a CPU with bf16 units, which halves the bytes per token and lets each pool hold
    # every tenant's prefix, so random routing would lose nothing and the comparison say nothing.
    return ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(args.max_num_seqs),
            "--kv-cache-memory", str(kv_cache_mib * 1024**2), "--dtype", "float32"]  # fmt: skip


def parse_rates(text: str) -> list[float]:
    """`--rates 5,10.5,20`: req/s, each > 0, in the order the sweep runs them (ascending)."""
    rates = sorted(float(r) for r in text.split(","))
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return rates


def parse_cli(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--questions", type=int, default=8, help="per tenant")
    parser.add_argument("--open-questions", type=int, default=8,
                        help="per tenant, measured in each open-loop run")  # fmt: skip
    parser.add_argument("--rates", type=parse_rates,
                        help="open loop's offered req/s, comma-separated (default: from the "
                        "closed loop's req/s)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the open loop's arrival times")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB,
                        help="each replica's KV pool (tiny-llama fp32: 2 KiB a token)")  # fmt: skip
    return parser.parse_args(argv)


def command_line(args: argparse.Namespace) -> str:
    rates = f" --rates {','.join(f'{r:g}' for r in args.rates)}" if args.rates else ""
    return (f"python -m bench.gateway_routing --tenants {args.tenants} --questions "
            f"{args.questions} --open-questions {args.open_questions} --seed {args.seed}{rates} "
            f"--kv-cache-mib {args.kv_cache_mib}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with runtime_replicas(2, replica_limits(args, args.kv_cache_mib)) as replicas:
            phases = measure_prefix(replicas, workdir, args.tenants, args.questions)
            rates = args.rates or sweep_rates(
                by_name(phases, "random").summary.request_throughput,
                by_name(phases, "prefix").summary.request_throughput,
            )
            runs = measure_open_loop(replicas, workdir, args, rates)
        both_pools = replica_limits(args, 2 * args.kv_cache_mib)
        phases.append(measure_reference(both_pools, workdir, args.tenants, args.questions))
    body = report(args, phases, rates, runs)
    print(body)
    title = "Gateway: prefix-affinity routing"
    write_section("gateway_routing", title, command_line(args), body)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
