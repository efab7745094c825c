"""`kvpilot bench`'s tenants (issue 36 item 3): spec parsing and per-tenant figures, by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvpilot.runtime.bench.cli import main as bench_main
from kvpilot.runtime.bench.cli import parse_args
from kvpilot.runtime.bench.stats import RequestResult
from kvpilot.runtime.bench.tenants import (
    TenantSpec,
    check_tenants,
    contended_window,
    format_tenants,
    load_tenants_file,
    parse_tenant,
    tenant_reports,
)

DEFAULTS = TenantSpec(name="default", api_key="sk-run", request_rate=math.inf, concurrency=None,
                      priority=None, input_len=128, output_len=64, num_prompts=100)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name=batch,key=sk-b,rate=6,priority=5,input-len=256,output-len=64",
         {"name": "batch", "api_key": "sk-b", "request_rate": 6.0, "priority": 5,
          "input_len": 256, "output_len": 64}),
        ("name=chat", {"name": "chat"}),  # everything else: the run's flags
        ("name=chat,concurrency=4,num-prompts=10", {"concurrency": 4, "num_prompts": 10}),
        ("name=urgent, priority=-1", {"priority": -1}),
        ("name=all,rate=inf", {"request_rate": math.inf}),
        ("name=x,input_len=7", {"input_len": 7}),  # the underscore spelling too
        ("name=late,delay=5", {"delay_s": 5.0}),
    ],
)  # fmt: skip
def test_parse_tenant(text: str, expected: dict[str, Any]) -> None:
    tenant = parse_tenant(text, DEFAULTS)
    for attribute, value in expected.items():
        assert getattr(tenant, attribute) == value, attribute
    untouched = {"api_key", "request_rate", "concurrency", "priority", "input_len"} - set(expected)
    for attribute in untouched:
        assert getattr(tenant, attribute) == getattr(DEFAULTS, attribute), attribute


def test_a_tenants_rate_replaces_the_runs_concurrency() -> None:
    closed = TenantSpec(**{**vars(DEFAULTS), "concurrency": 8})
    assert parse_tenant("name=a,rate=2", closed).concurrency is None
    assert parse_tenant("name=a", closed).concurrency == 8


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("key=sk-b,rate=6", "every tenant needs a name"),
        ("name=a,speed=3", "unknown field 'speed'; known: name, key, rate"),
        ("name=a,rate", "'rate' is not FIELD=VALUE"),
        ("name=a,,rate=2", "'' is not FIELD=VALUE"),
        ("name=a,rate=", "'rate=' is not FIELD=VALUE"),
        ("name=a,rate=fast", "tenant 'a': rate must be a number, got 'fast'"),
        ("name=a,priority=1.5", "tenant 'a': priority must be an integer, got '1.5'"),
        ("name=a,rate=0", "tenant 'a': rate must be > 0 req/s"),
        ("name=a,rate=nan", "rate must be > 0"),
        ("name=a,concurrency=0", "concurrency must be >= 1"),
        ("name=a,input-len=0", "input-len must be >= 1"),
        ("name=a,output-len=-2", "output-len must be >= 1"),
        ("name=a,num-prompts=0", "num-prompts must be >= 1"),
        ("name=a,rate=2,concurrency=3", "give rate (open loop) or concurrency (closed loop)"),
        ("name=a,rate=2,rate=3", "rate given twice"),
        ("name=a,delay=-1", "delay must be >= 0 seconds"),
        ("name=a,delay=inf", "delay must be >= 0 seconds"),
    ],
)
def test_bad_tenant_specs_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as error:
        parse_tenant(text, DEFAULTS)
    assert says in str(error.value)


@pytest.mark.parametrize(
    ("content", "names_or_error"),
    [
        ("- {name: a, rate: 2}\n- {name: b, concurrency: 3, priority: 4}\n", ["a", "b"]),
        ('{"tenants": [{"name": "a", "input_len": 9}]}', ["a"]),  # JSON is YAML
        ("tenants: nope\n", "expected a list of tenants"),
        ("[]\n", "expected a list of tenants"),  # none: not a multi-tenant run
        ("", "expected a list of tenants"),
        ("- [a, b]\n", "expected a list of tenants"),
        ("- {name: a, rate: 2}\n  bad: [\n", "not YAML or JSON"),
        ("- {name: a, priority: true}\n", "priority must be an integer"),
        ("- {name: a, priority: 2.0}\n", "priority must be an integer"),
    ],
)
def test_tenants_file(tmp_path: Path, content: str, names_or_error: list[str] | str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(content)
    if isinstance(names_or_error, str):
        with pytest.raises(ValueError) as error:
            load_tenants_file(path, DEFAULTS)
        assert names_or_error in str(error.value)
    else:
        assert [t.name for t in load_tenants_file(path, DEFAULTS)] == names_or_error


def test_tenant_names_are_unique() -> None:
    tenants = [parse_tenant("name=a", DEFAULTS), parse_tenant("name=a,rate=2", DEFAULTS)]
    with pytest.raises(ValueError, match="'a' is given twice"):
        check_tenants(tenants)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tenant", "name=a,rate=x"], "rate must be a number"),
        (["--tenant", "name=a", "--dataset", "d.jsonl"], "--dataset runs one tenant"),
        (["--tenant", "name=a", "--tenant", "name=a"], "'a' is given twice"),
        (["--tenants", "/nonexistent/tenants.yaml"], "No such file"),
    ],
)
def test_the_cli_refuses_bad_tenants(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main(argv) == 2
    assert says in capsys.readouterr().err


def test_tenants_take_the_runs_flags_as_defaults() -> None:
    config = parse_args(["--api-key", "sk-all", "--concurrency", "3", "--input-len", "32",
                         "--tenant", "name=a", "--tenant", "name=b,key=sk-b,rate=2"])  # fmt: skip
    a, b = config.tenants
    assert (a.api_key, a.concurrency, a.input_len, a.priority) == ("sk-all", 3, 32, None)
    assert (b.api_key, b.concurrency, b.request_rate) == ("sk-b", None, 2.0)
    assert parse_args([]).tenants == ()


def ok(start: float, ttft: float, latency: float, prompt: int, output: int) -> RequestResult:
    gaps = [(latency - ttft) / (output - 1)] * (output - 1) if output > 1 else []
    return RequestResult(True, start, prompt, output, ttft, gaps, latency)


def refused(start: float, status: int = 429) -> RequestResult:
    return RequestResult(False, start, error=f"HTTP {status}: queue full")


# Tenant "heavy" ends its last request at 10.0 s, "light" at 4.0 s: the contended window is 4 s.
RESULTS = {
    "heavy": [ok(0.0, 0.1, 1.0, 10, 5), ok(1.0, 0.2, 2.0, 10, 5), ok(5.0, 0.3, 5.0, 20, 10),
              refused(2.0), refused(2.5), refused(3.0, 401)],
    "light": [ok(0.0, 0.5, 1.5, 4, 4), ok(2.0, 0.7, 2.0, 4, 4)],
}  # fmt: skip
SPECS = [parse_tenant("name=heavy,concurrency=4", DEFAULTS),
         parse_tenant("name=light,rate=1,priority=-1", DEFAULTS)]  # fmt: skip


def test_per_tenant_figures_by_hand() -> None:
    assert contended_window(RESULTS) == 4.0
    heavy, light = tenant_reports(SPECS, RESULTS, duration_s=10.0, percentiles=(99.0,))
    assert (heavy.summary.num_requests, heavy.summary.completed, heavy.summary.failed) == (6, 3, 3)
    assert heavy.num_429 == 2 and light.num_429 == 0  # the 401 is an error, not a 429
    assert heavy.tokens == 15 + 15 + 30 and light.tokens == 8 + 8
    assert heavy.token_share == pytest.approx(60 / 76)
    assert light.token_share == pytest.approx(16 / 76)
    # before 4.0 s: heavy's first two (ended 1.0 and 3.0), light's two (1.5 and 4.0)
    assert (heavy.contended_tokens, light.contended_tokens) == (30, 16)
    assert heavy.contended_share == pytest.approx(30 / 46)
    assert heavy.summary.ttft_ms.percentiles["p50"] == pytest.approx(200.0)
    assert set(heavy.summary.ttft_ms.percentiles) == {"p50", "p95", "p99"}
    assert light.summary.ttft_ms.percentiles["p95"] == pytest.approx(690.0)
    # TPOT: (1.0-0.1)/4 = .225, (2.0-0.2)/4 = .45, (5.0-0.3)/9 = .522 s -> median 450 ms
    assert heavy.summary.tpot_ms.percentiles["p50"] == pytest.approx(450.0)
    document = json.loads(json.dumps(heavy.to_dict()))
    assert document["spec"]["api_key"] == "set"  # never the key itself
    assert document["num_429"] == 2 and document["summary"]["completed"] == 3


def test_a_request_streaming_when_the_window_closes_counts_its_part() -> None:
    # chunks at 1.0, 2.0, 3.0, 4.0 s: by 2.5 s the prompt (10) and half of the 8 output tokens
    streaming = ok(0.0, 1.0, 4.0, 10, 8)
    streaming.itl = [1.0, 1.0, 1.0]
    results = {"heavy": [streaming], "light": [ok(0.0, 0.5, 2.5, 2, 2)]}
    assert contended_window(results) == 2.5
    heavy, light = tenant_reports(SPECS, results, duration_s=4.0, percentiles=(50.0,))
    assert (heavy.contended_tokens, light.contended_tokens) == (14, 4)
    assert (heavy.tokens, light.tokens) == (18, 4)


def test_a_tenant_without_answers_has_no_share() -> None:
    results = {"heavy": [refused(0.0)], "light": [refused(0.1)]}
    reports = tenant_reports(SPECS, results, duration_s=1.0, percentiles=(50.0,))
    assert [(r.tokens, r.token_share, r.contended_share) for r in reports] == [(0, 0.0, 0.0)] * 2


def test_the_table_names_each_tenant_and_its_share() -> None:
    reports = tenant_reports(SPECS, RESULTS, duration_s=10.0, percentiles=(50.0,))
    lines = format_tenants(reports, contended_window(RESULTS)).splitlines()
    heavy = next(line for line in lines if line.lstrip().startswith("heavy"))
    light = next(line for line in lines if line.lstrip().startswith("light"))
    assert "4 clients" in heavy and "78.9%" in heavy and "65.2%" in heavy
    assert "1 req/s" in light and " -1 " in light and "21.1%" in light
    assert "first 4.00 s" in lines[-1]
