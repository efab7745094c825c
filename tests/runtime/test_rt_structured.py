"""Grammar-constrained decoding on the engine with tiny-llama: the batch mask, compilation off
the step (a sequence waits while others run), termination, aborts and compile failures."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import pytest
import torch

from kvpilot.runtime.engine.engine import Engine, RequestOutput
from kvpilot.runtime.engine.grammar import GrammarCompiler, GrammarError, new_matcher
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.structured import choice_spec, json_schema_spec, regex_spec
from kvpilot.runtime.layers.grammar_mask import GrammarMasker, unpack_bitmask

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine()


def run(engine: Engine, timeout_s: float = 120) -> dict[str, list[RequestOutput]]:
    """Step until every request finished (a step is empty while grammars compile)."""
    outputs: dict[str, list[RequestOutput]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish its requests")


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(out.new_text for out in outputs)


def test_unpacked_bitmask_is_llguidance_mask(engine: Engine) -> None:
    template = engine.grammar_compiler.compile(json_schema_spec(SCHEMA, "t")).result()
    matcher = new_matcher(template)
    for token in engine.tokenizer.encode('{"ok":true')[1:]:  # without BOS
        expected = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        packed = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        allowed = unpack_bitmask(packed[None], 4096, torch.arange(32, dtype=torch.int32))[0]
        assert torch.equal(allowed, expected[:4096] > 0)
        assert 0 < int(allowed.sum()) < 4096
        assert matcher.consume_token(token), matcher.get_error()


@pytest.mark.parametrize("is_parallel", [False, True])
def test_mask_touches_only_constrained_rows(engine: Engine, is_parallel: bool) -> None:
    """The same on the engine's thread and on llguidance's executor (machines with 4+ CPUs)."""
    template = engine.grammar_compiler.compile(regex_spec("[0-9]", "t")).result()
    logits = torch.randn(3, 4096)
    before = logits.clone()
    masker = GrammarMasker(4096, torch.device("cpu"))
    masker.is_parallel = is_parallel
    masker.apply(logits, [None, new_matcher(template), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    digits = {engine.tokenizer.hf.token_to_id(str(d)) for d in range(10)} - {None}
    allowed = set(torch.nonzero(logits[1] > float("-inf")).flatten().tolist())
    assert digits <= allowed and len(allowed) < 40
    assert torch.equal(logits[1][list(allowed)], before[1][list(allowed)])


def test_compiles_are_cached_by_spec_and_failures_name_the_cause(engine: Engine) -> None:
    compiler = engine.grammar_compiler
    first = compiler.compile(json_schema_spec(SCHEMA, "guided_json"))
    again = compiler.compile(json_schema_spec(json.dumps(SCHEMA), "response_format"))
    assert first is again  # the field it came from is not part of the key
    with pytest.raises(GrammarError, match="unclosed character class"):
        compiler.compile(regex_spec("a[", "guided_regex")).result()
    with pytest.raises(GrammarError, match="objectx"):
        compiler.compile(json_schema_spec({"type": "objectx"}, "guided_json")).result()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_grammars(engine: Engine, temperature: float) -> None:
    params: dict[str, Any] = {"max_tokens": 60, "temperature": temperature, "seed": 3}
    ids = {
        "json": engine.add_request(
            "The list", SamplingParams(**params, grammar=json_schema_spec(SCHEMA, "j"))
        ),
        "regex": engine.add_request(
            "The list", SamplingParams(**params, grammar=regex_spec(r"[a-z]{2}-[0-9]{3}", "r"))
        ),
        "choice": engine.add_request(
            "The list", SamplingParams(**params, grammar=choice_spec(["alpha", "beta"], "c"))
        ),
        # Without a grammar (and EOS ignored, which a sampled tiny-llama may draw) it runs on.
        "free": engine.add_request("The list", SamplingParams(**params, ignore_eos=True)),
    }
    outputs = run(engine)
    texts = {name: text_of(outputs[rid]) for name, rid in ids.items()}
    reasons = {name: outputs[rid][-1].finish_reason for name, rid in ids.items()}
    assert json.loads(texts["json"]).keys() == {"ok", "n"}
    assert re.fullmatch(r"[a-z]{2}-[0-9]{3}", texts["regex"])
    assert texts["choice"] in ("alpha", "beta")  # the grammar's last token is kept
    assert reasons["json"] == reasons["regex"] == reasons["choice"] == "stop"
    assert reasons["free"] == "length"  # only the grammar ended the others


class GatedPool(ThreadPoolExecutor):
    """A real one-thread pool whose first task waits for `gate`: compiles wait behind it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.gate = threading.Event()
        self.submit(self.gate.wait)


def test_a_compiling_sequence_waits_without_stalling_others(engine: Engine) -> None:
    pool = GatedPool()
    original = engine.grammar_compiler
    engine.grammar_compiler = GrammarCompiler(original.tokenizer, pool)
    try:
        spec = regex_spec("(yes|no)", "g")
        waiting = engine.add_request("The list", SamplingParams(max_tokens=8, grammar=spec))
        free = engine.add_request("The list", SamplingParams(max_tokens=8, ignore_eos=True))
        outputs: dict[str, list[RequestOutput]] = {}
        for _ in range(8):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        assert outputs[free][-1].finished and waiting not in outputs
        assert engine.stats().num_waiting == 1 and engine.has_unfinished_requests()
        pool.gate.set()
        outputs = run(engine)
        assert text_of(outputs[waiting]) in ("yes", "no")
    finally:
        pool.gate.set()
        engine.grammar_compiler = original


def test_abort_while_compiling_finishes_the_request(engine: Engine) -> None:
    pool = GatedPool()
    original = engine.grammar_compiler
    engine.grammar_compiler = GrammarCompiler(original.tokenizer, pool)
    try:
        request_id = engine.add_request("x", SamplingParams(grammar=regex_spec("a+", "g")))
        engine.abort(request_id)
        [out] = engine.step()
        assert (out.request_id, out.finished, out.finish_reason) == (request_id, True, "abort")
        pool.gate.set()
        pool.shutdown(wait=True)  # the compile finished: the aborted sequence must not come back
        assert not engine.has_unfinished_requests() and engine.step() == []
    finally:
        pool.gate.set()
        engine.grammar_compiler = original


def test_a_grammar_that_does_not_compile_aborts_its_request(engine: Engine) -> None:
    request_id = engine.add_request("x", SamplingParams(grammar=regex_spec("(", "g")))
    outputs = run(engine)
    assert outputs[request_id][-1].finish_reason == "abort"
    assert outputs[request_id][-1].num_output_tokens == 0


def test_llguidance_tokenizer_covers_the_model_vocabulary(engine: Engine) -> None:
    tokenizer = engine.grammar_compiler.tokenizer
    assert isinstance(tokenizer, llguidance.LLTokenizer)
    assert tokenizer.vocab_size == engine.model_config.vocab_size
    assert set(tokenizer.eos_tokens) == set(engine.tokenizer.eos_token_ids)
