"""`kvpilot bench` results as a text table, a JSON document and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .stats import RequestResult, Summary, throughput_timeline

LATENCIES = (
    ("ttft_ms", "Time to first token"),
    ("tpot_ms", "Time per output token"),
    ("itl_ms", "Inter-token latency"),
    ("e2el_ms", "End-to-end latency"),
)


def format_summary(summary: Summary, title: str = "kvpilot bench") -> str:
    rows: list[tuple[str, Any]] = [
        ("Successful requests", summary.completed),
        ("Failed requests", summary.failed),
        ("Benchmark duration (s)", f"{summary.duration_s:.2f}"),
        ("Total input tokens", summary.total_input_tokens),
        ("Total generated tokens", summary.total_output_tokens),
        ("Request throughput (req/s)", f"{summary.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{summary.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{summary.total_token_throughput:.2f}"),
    ]
    if summary.request_goodput is not None:
        rows.append(("Request goodput (req/s)", f"{summary.request_goodput:.2f}"))
    if summary.cost_per_1k_requests is not None:
        rows.append(("Cost per 1,000 requests", f"{summary.cost_per_1k_requests:.4f}"))
    for key, label in LATENCIES:
        dist = getattr(summary, key)
        rows.append((f"Mean {label} (ms)", f"{dist.mean:.2f}"))
        rows.append((f"Median {label} (ms)", f"{dist.median:.2f}"))
        rows += [(f"{p.upper()} {label} (ms)", f"{v:.2f}") for p, v in dist.percentiles.items()]
    lines = [f"{title:=^60}"] + [f"{name:<45}{value:>15}" for name, value in rows]
    lines += [f"error x{count}: {text}" for text, count in summary.errors.items()]
    return "\n".join([*lines, "=" * 60])


def result_document(
    config: dict[str, Any], summary: Summary, results: list[RequestResult], detailed: bool
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "config": config,
        "summary": summary.to_dict(),
        "throughput_timeline_tok_s": throughput_timeline(results),
    }
    if detailed:
        doc["requests"] = [vars(r) for r in results]
    return doc


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_plots(directory: Path, results: list[RequestResult]) -> list[Path]:
    """latency_cdf.png (TTFT, TPOT, ITL, E2EL) and throughput.png (output tok/s per second)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.success]
    series = {
        "ttft_ms": [r.ttft for r in ok],
        "tpot_ms": [t for r in ok if (t := r.tpot()) is not None],
        "itl_ms": [g for r in ok for g in r.itl],
        "e2el_ms": [r.latency for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, LATENCIES, strict=True):
        values = np.sort(np.asarray(series[key], dtype=float) * 1000.0)
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        ax.set(title=label, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = directory / "latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)
    timeline = throughput_timeline(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(np.arange(len(timeline)), timeline, drawstyle="steps-post")
    ax.set(title="Output throughput over time", xlabel="seconds since start", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tput = directory / "throughput.png"
    fig.savefig(tput, dpi=100)
    plt.close(fig)
    return [cdf, tput]
