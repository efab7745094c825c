"""Several tenants in one `kvpilot bench` run (issue 36 item 3): each with its own API key, load
(an open-loop rate or a closed loop of clients), `priority` and prompt shape; reported per tenant.

A tenant is `--tenant name=batch,key=sk-b,rate=6,priority=5,input-len=256,output-len=64`
(repeated; `delay=S` starts a tenant S seconds late), or one entry of a `--tenants FILE` (YAML
or JSON: a list of such mappings, or {"tenants": [...]}). Fields a tenant leaves out come from
the run's own flags (--api-key, --request-rate / --concurrency, --input-len, --output-len,
--num-prompts); `priority` left out is not sent at all (a server under fcfs refuses any other
than 0).

Shares of tokens: a tenant's tokens are prompt + output tokens of its answered requests (what the
gateway's fair queue counts, unweighted). Over the whole run a light tenant's share depends on
when each tenant runs out of requests, so the report gives a second share, **contended**: the
tokens of requests answered before the first tenant finished, the window where every tenant
still had work (the one a fairness goal is about), each request counted as far as it had
streamed by then (`served_by`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .stats import RequestResult, Summary, summarize

# spec field -> (TenantSpec attribute, type)
_FIELDS: dict[str, tuple[str, type]] = {
    "name": ("name", str),
    "key": ("api_key", str),
    "rate": ("request_rate", float),
    "concurrency": ("concurrency", int),
    "priority": ("priority", int),
    "input-len": ("input_len", int),
    "output-len": ("output_len", int),
    "num-prompts": ("num_prompts", int),
    "delay": ("delay_s", float),
}
TENANT_FIELDS = tuple(_FIELDS)


@dataclass(frozen=True)
class TenantSpec:
    name: str
    api_key: str | None
    request_rate: float  # open loop, req/s (inf: all at once); unused when concurrency is set
    concurrency: int | None  # closed loop of this many clients
    priority: int | None  # vLLM's `priority` field; None: not sent
    input_len: int
    output_len: int
    num_prompts: int
    delay_s: float = 0.0  # starts this long after the run (another tenant builds a queue first)

    def __post_init__(self) -> None:
        where = f"tenant {self.name!r}"
        checks = [
            (bool(self.name) and "," not in self.name, "tenant needs a name (name=...)"),
            (self.request_rate > 0, f"{where}: rate must be > 0 req/s, got {self.request_rate}"),
            (
                self.concurrency is None or self.concurrency >= 1,
                f"{where}: concurrency must be >= 1, got {self.concurrency}",
            ),
            (self.input_len >= 1, f"{where}: input-len must be >= 1, got {self.input_len}"),
            (self.output_len >= 1, f"{where}: output-len must be >= 1, got {self.output_len}"),
            (self.num_prompts >= 1, f"{where}: num-prompts must be >= 1, got {self.num_prompts}"),
            (
                0 <= self.delay_s < math.inf,
                f"{where}: delay must be >= 0 seconds, got {self.delay_s}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def describe_load(self) -> str:
        if self.concurrency is not None:
            return f"{self.concurrency} clients"
        return "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g} req/s"


def _convert(name: str, value: object, kind: type, where: str) -> Any:
    if kind is str:
        return str(value)
    if isinstance(value, bool) or (kind is int and isinstance(value, float)):
        raise ValueError(f"{where}: {name} must be {'an integer' if kind is int else 'a number'}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"{where}: {name} must be {expected}, got {value!r}") from None


def tenant_from_mapping(entry: Mapping[str, object], defaults: TenantSpec) -> TenantSpec:
    """One tenant from its fields (`input-len` or `input_len`), the rest from `defaults`."""
    fields_given = {str(k).replace("_", "-"): v for k, v in entry.items()}
    where = f"tenant {fields_given.get('name', '(no name)')!r}"
    unknown = sorted(set(fields_given) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(_FIELDS)}")
    if "name" not in fields_given:
        raise ValueError(f"every tenant needs a name (name=...); got {dict(entry)}")
    if "rate" in fields_given and "concurrency" in fields_given:
        raise ValueError(f"{where}: give rate (open loop) or concurrency (closed loop), not both")
    values = {
        _FIELDS[name][0]: _convert(name, value, _FIELDS[name][1], where)
        for name, value in fields_given.items()
    }
    if "rate" in fields_given:
        values["concurrency"] = None  # its own rate replaces a --concurrency default
    return replace(defaults, **values)


def parse_tenant(text: str, defaults: TenantSpec) -> TenantSpec:
    """`name=batch,key=sk-b,rate=6,priority=5` -> TenantSpec (ValueError naming what is wrong)."""
    entry: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise ValueError(
                f"--tenant {text!r}: {part!r} is not FIELD=VALUE (fields: {', '.join(_FIELDS)})"
            )
        if name in entry:
            raise ValueError(f"--tenant {text!r}: {name} given twice")
        entry[name] = value.strip()
    return tenant_from_mapping(entry, defaults)


def load_tenants_file(path: Path, defaults: TenantSpec) -> list[TenantSpec]:
    """A YAML (or JSON, which YAML reads) list of tenant mappings, or {"tenants": [...]}."""
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"--tenants {path}: not YAML or JSON: {exc}") from exc
    entries = document.get("tenants") if isinstance(document, dict) else document
    if (
        not entries
        or not isinstance(entries, list)
        or not all(isinstance(e, dict) for e in entries)
    ):
        raise ValueError(
            f"--tenants {path}: expected a list of tenants (mappings with {', '.join(_FIELDS)}), "
            "or {tenants: [...]}"
        )
    return [tenant_from_mapping(entry, defaults) for entry in entries]


def check_tenants(tenants: list[TenantSpec]) -> list[TenantSpec]:
    names = [t.name for t in tenants]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tenant names must be unique; {repeated[0]!r} is given twice")
    return tenants


@dataclass(frozen=True)
class TenantReport:
    spec: TenantSpec
    summary: Summary
    num_429: int  # refused with 429 (a full tenant queue, a rate or budget limit)
    tokens: int  # prompt + output tokens of the tenant's answered requests
    token_share: float  # of every tenant's tokens, whole run
    contended_tokens: int  # served before the first tenant finished (served_by)
    contended_share: float

    def to_dict(self) -> dict[str, Any]:
        spec = {f.name: getattr(self.spec, f.name) for f in fields(self.spec)}
        spec["api_key"] = "set" if self.spec.api_key else None  # never a secret in a result file
        spec["request_rate"] = str(self.spec.request_rate)  # inf is no JSON number
        return {
            "spec": spec,
            "summary": self.summary.to_dict(),
            "num_429": self.num_429,
            "tokens": self.tokens,
            "token_share": self.token_share,
            "contended_tokens": self.contended_tokens,
            "contended_share": self.contended_share,
        }


_EPSILON_S = 1e-9  # a chunk at the window's very end is in it, whatever the float sums say


def finished_at(result: RequestResult) -> float:
    """Seconds since the run started when the request ended (answered or failed)."""
    return result.start + result.latency if result.success else result.start


def contended_window(results: Mapping[str, list[RequestResult]]) -> float:
    """When the first tenant ended its last request: until then every tenant had work."""
    ends = [max(map(finished_at, rs)) for rs in results.values() if rs]
    return min(ends) if ends else 0.0


def served_by(result: RequestResult, until: float) -> float:
    """Tokens `result` was served by `until` (seconds since the run started): its prompt once
    its first chunk came, its output tokens spread evenly over its chunks, as they came. A
    request still streaming at `until` counts its part, so a tenant with requests in flight
    when the window closes is not under-counted."""
    if not result.success:
        return 0.0
    times = result.chunk_times()
    if times[0] > until + _EPSILON_S:
        return 0.0
    arrived = sum(t <= until + _EPSILON_S for t in times)
    return result.prompt_len + result.output_len * arrived / len(times)


def _tokens(results: list[RequestResult], until: float = math.inf) -> int:
    return round(sum(served_by(r, until) for r in results))


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def tenant_reports(
    specs: list[TenantSpec],
    results: Mapping[str, list[RequestResult]],
    duration_s: float,
    percentiles: tuple[float, ...],
) -> list[TenantReport]:
    """Per tenant: `kvpilot bench`'s summary of its own requests, its 429s and its token shares."""
    window = contended_window(results)
    tokens = {s.name: _tokens(results[s.name]) for s in specs}
    contended = {s.name: _tokens(results[s.name], window) for s in specs}
    wanted = tuple(sorted({*percentiles, 50.0, 95.0}))
    return [
        TenantReport(
            spec=s,
            summary=summarize(results[s.name], duration_s, percentiles=wanted),
            num_429=sum(r.error.startswith("HTTP 429") for r in results[s.name]),
            tokens=tokens[s.name],
            token_share=_share(tokens[s.name], sum(tokens.values())),
            contended_tokens=contended[s.name],
            contended_share=_share(contended[s.name], sum(contended.values())),
        )
        for s in specs
    ]


def format_tenants(reports: list[TenantReport], window_s: float) -> str:
    header = ("tenant", "load", "prio", "req", "ok", "err", "429", "TTFT p50", "TTFT p95",
              "TPOT p50", "out tok", "tokens", "share", "contended")  # fmt: skip
    rows = [header]
    for r in reports:
        s = r.summary
        rows.append((
            r.spec.name, r.spec.describe_load(),
            "-" if r.spec.priority is None else str(r.spec.priority),
            str(s.num_requests), str(s.completed), str(s.failed), str(r.num_429),
            f"{s.ttft_ms.percentiles['p50']:.1f}", f"{s.ttft_ms.percentiles['p95']:.1f}",
            f"{s.tpot_ms.percentiles['p50']:.1f}", str(s.total_output_tokens), str(r.tokens),
            f"{r.token_share:.1%}", f"{r.contended_share:.1%}",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    title = " kvpilot bench: per tenant (ms; tokens = prompt + output) "
    return "\n".join([
        f"{title:=^{len(lines[0])}}", *lines,
        f"contended = requests answered in the first {window_s:.2f} s, while every tenant had "
        "work (until the first one finished)",
    ])  # fmt: skip
