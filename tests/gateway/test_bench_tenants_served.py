"""`kvpilot bench --tenant ...` through a real `kvpilot-gateway` in front of a real tiny-llama
replica (issue 36 item 3): the per-tenant report is computed from the real answers, so it agrees
with what the gateway counted for each tenant: tokens served (from the replica's usage), 429s of
a full tenant queue, and the priority each tenant's requests carried.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.runtime.bench import main as bench_main
from tests.support.gateway_process import GatewayProcess
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow

KEYS = {"sk-bench-batch": "batch", "sk-bench-chat": "chat"}
HEAVY_PROMPTS, LIGHT_PROMPTS = 12, 4


def test_each_tenants_report_agrees_with_the_gateways_count(
    replica: RuntimeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "models": [{"name": MODEL, "backends": [replica.url]}],
        "keys": [{"key": key, "team": team} for key, team in KEYS.items()],
        "teams": [{"name": "batch"}, {"name": "chat"}],
    }
    # one request in flight, two waiting per tenant: the batch tenant's six clients overflow its
    # queue (429s), the chat tenant's one client never does
    gateway = GatewayProcess(config, tmp_path, "--max-in-flight-per-replica", "1",
                             "--max-queued-per-tenant", "2", "--fallback-after", "600")  # fmt: skip
    out = tmp_path / "tenants.json"
    try:
        code = bench_main([
            "--base-url", gateway.url, "--tokenizer", str(TINY), "--ignore-eos", "--no-progress",
            "--result-json", str(out),
            "--tenant", f"name=batch,key=sk-bench-batch,concurrency=6,priority=2,"
                        f"num-prompts={HEAVY_PROMPTS},input-len=24,output-len=6",
            "--tenant", f"name=chat,key=sk-bench-chat,concurrency=1,num-prompts={LIGHT_PROMPTS},"
                        "input-len=12,output-len=4",
        ])  # fmt: skip
        assert code == 0
        printed = capsys.readouterr().out
        tenants = json.loads(out.read_text())["tenants"]
        batch, chat = tenants["batch"], tenants["chat"]
        assert batch["summary"]["num_requests"] == HEAVY_PROMPTS
        assert chat["summary"]["num_requests"] == LIGHT_PROMPTS
        assert chat["summary"]["completed"] == LIGHT_PROMPTS, chat["summary"]["errors"]
        assert chat["num_429"] == 0
        refusals = gateway.metric("kvpilot_gateway_flow_refusals_total", tenant="batch")
        assert batch["num_429"] == refusals > 0
        assert batch["summary"]["failed"] == batch["num_429"]  # every failure was a 429
        for team, report in tenants.items():
            served = gateway.metric("kvpilot_gateway_flow_tokens_total", model=MODEL, tenant=team)
            assert report["tokens"] == served > 0, team
            # the replica's usage: 24 + 6 tokens a batch request, 12 + 4 a chat one (prompts cut
            # to exact lengths by the same tokenizer)
            per_request = {"batch": 30, "chat": 16}[team]
            assert report["tokens"] == per_request * report["summary"]["completed"], team
        assert batch["token_share"] + chat["token_share"] == pytest.approx(1.0)
        # each request's priority reached the gateway: batch sent 2, chat none (its key's 0)
        for team, priority in (("batch", "2"), ("chat", "0")):
            answered = gateway.metric("kvpilot_gateway_flow_ttft_seconds_count",
                                      tenant=team, priority=priority)  # fmt: skip
            assert answered == tenants[team]["summary"]["completed"], team
        assert batch["summary"]["ttft_ms"]["percentiles"]["p95"] > 0
        assert "batch" in printed and "chat" in printed and "contended" in printed
    finally:
        assert gateway.stop() == 0, gateway.log_path.read_text()[-3000:]
