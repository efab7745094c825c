"""What the runtime's start-up imports: nothing that serving does not need (issue 33 item 4).

Every replica pays each import at every start, on the path to Ready. torch itself is most of
it (docs/benchmarks.md, cold start); what else creeps in is caught here. torch's compiler stack
(torch._dynamo) was 5.4 s of a 7.8 s import on 2 cores, pulled in by llguidance.torch, which
compiles a function at import time (grammar_mask uses llguidance's numpy helpers instead).

The check runs the server's own start-up in a fresh interpreter: its modules imported, the HTTP
app built and the model loaded on the engine's thread as `serve` does (ServerState.load), then
lists sys.modules. Import graphs are read from what Python loaded, not from the source, so a
heavy module that another library imports on our behalf counts too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.server_process import TINY

pytestmark = pytest.mark.slow  # loads a model in a fresh interpreter

# Module-name prefixes the serve path must not load, each with why it is not needed.
NOT_ON_THE_SERVE_PATH = {
    "torch._dynamo": "torch.compile's tracer (seconds to import); the runtime compiles nothing",
    "torch._inductor": "torch.compile's code generator",
    "sympy": "symbolic shapes for torch.compile",
    "transformers": "the tokenizer is `tokenizers`, the chat template jinja2, weights safetensors",
    "huggingface_hub": "only an hf:// model is fetched with it (contract/fetch.py, imported then)",
    "boto3": "only an s3:// model is fetched with it",
    "llguidance.torch": "compiles a function at import; grammar_mask uses llguidance.numpy",
    "jinja2": "the chat template's engine: imported at the first chat request (chat_template.py)",
    "kubernetes": "the operator's and the gateway's client, not the runtime's",
    "kvpilot.operator": "another process",
    "kvpilot.gateway": "another process",
    "scipy": "nothing on the serve path computes with it",
    "pandas": "nothing on the serve path computes with it",
    "matplotlib": "the benchmarks' plots",
}

PROBE = """
import asyncio, json, sys
from kvpilot.contract.serve_config import parse_args
from kvpilot.runtime.server.app import build_app
from kvpilot.runtime.server.lifecycle import ServerState

async def start_and_stop(state):
    await state.load()
    await state.close()

state = ServerState(parse_args(sys.argv[1:]))
build_app(state)
asyncio.run(start_and_stop(state))
if state.load_error is not None:
    sys.exit(state.load_error)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_modules(*serve_args: str) -> list[str]:
    """sys.modules of a fresh interpreter once the server has started (and stopped) its engine."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *serve_args],
        capture_output=True,
        text=True,
        check=False,  # the assertion below shows the probe's error output
        timeout=300,  # a bound: torch's import alone has taken 30 s on this machine under load
    )
    assert result.returncode == 0, result.stderr[-3000:]
    modules: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return modules


def test_the_serve_path_loads_nothing_it_does_not_serve_with() -> None:
    modules = loaded_modules("--model", str(TINY), "--max-model-len", "256")
    assert "kvpilot.runtime.engine.engine" in modules  # the probe did start an engine
    found = {
        prefix: why
        for prefix, why in NOT_ON_THE_SERVE_PATH.items()
        if any(m == prefix or m.startswith(prefix + ".") for m in modules)
    }
    assert found == {}, f"the serve path imports modules it does not need: {found}"
