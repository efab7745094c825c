"""Engine API as the server uses it: sampling options, stops, logprobs, abort, the async driver."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable

import pytest

from kvpilot.runtime.engine.async_engine import AsyncEngine
from kvpilot.runtime.engine.engine import Engine, RequestOutput
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.stats import EngineStats

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

PROMPT = "The for statement is used to iterate over"


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine()


def run(engine: Engine, requests: dict[str, SamplingParams], prompt: str = PROMPT) -> dict:
    for request_id, params in requests.items():
        engine.add_request(prompt, params, request_id)
    outputs: dict[str, list[RequestOutput]] = {r: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine: Engine) -> None:
    params = {
        "a": SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True),
        "b": SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True),
        "c": SamplingParams(max_tokens=20, temperature=1.0, seed=12, ignore_eos=True),
    }
    out = run(engine, params)
    assert tokens(out["a"]) == tokens(out["b"]) != tokens(out["c"])
    assert tokens(run(engine, {"d": params["a"]})["d"]) == tokens(out["a"])


def test_top_k_one_is_greedy(engine: Engine) -> None:
    out = run(
        engine,
        {
            "greedy": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            "topk": SamplingParams(max_tokens=12, temperature=5.0, top_k=1, ignore_eos=True),
            "topp": SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, ignore_eos=True),
        },
    )
    assert tokens(out["greedy"]) == tokens(out["topk"]) == tokens(out["topp"])


def test_max_tokens_text_and_usage(engine: Engine) -> None:
    outs = run(engine, {"r": SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)})["r"]
    final = outs[-1]
    assert final.finished and final.finish_reason == "length"
    assert final.num_output_tokens == 7 == len(tokens(outs))
    assert final.num_prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert text(outs) == engine.tokenizer.decode(tokens(outs))
    assert all(not o.finished for o in outs[:-1])


def test_stop_string_cuts_the_text(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = text(run(engine, {"full": greedy})["full"])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    stopped = run(engine, {"s": SamplingParams(max_tokens=30, temperature=0, stop=(stop,))})["s"]
    assert stopped[-1].finish_reason == "stop"
    assert text(stopped) == full[: full.index(stop)]


def test_stop_token_id_ends_the_request(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reference = tokens(run(engine, {"g": greedy})["g"])
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(reference[3],))
    got = run(engine, {"s": params})["s"]
    assert tokens(got) == reference[: reference.index(reference[3]) + 1]
    assert got[-1].finish_reason == "stop"


def test_logprobs_are_a_distribution_top_n(engine: Engine) -> None:
    outs = run(engine, {"l": SamplingParams(max_tokens=5, temperature=0, logprobs=3)})["l"]
    entries = [entry for o in outs for entry in (o.logprobs or [])]
    assert len(entries) == len(tokens(outs))
    for token, entry in zip(tokens(outs), entries, strict=True):
        assert token in entry and 3 <= len(entry) <= 4
        assert max(entry.values()) == entry[token]  # greedy picks the most likely token
        assert all(v <= 0 for v in entry.values()) and sum(map(math.exp, entry.values())) <= 1.0001


def test_abort_frees_blocks_and_reports(engine: Engine) -> None:
    engine.add_request(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), "x")
    engine.step()
    assert engine.stats().num_running == 1 and engine.stats().kv_cache_usage > 0
    engine.abort("x")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("x", True, "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([5] * 600, "prompt has 600 tokens, max_model_len is 512"),
        ([1, 99999], r"prompt token ids must be in \[0, 4096\)"),
    ],
)
def test_prompt_validation(engine: Engine, prompt: str | list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams())


def test_tokenizer_surface(engine: Engine) -> None:
    tok = engine.tokenizer
    assert tok.chat_template and "<|assistant|>" in tok.chat_template
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"
    assert len(tok.eos_token_ids) == 2
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    assert engine.served_name == "tiny-llama" and engine.max_model_len == 512


def test_async_engine_streams_and_aborts_on_cancel(engine: Engine) -> None:
    async def scenario() -> tuple[list[RequestOutput], EngineStats, list[int]]:
        driver = AsyncEngine(engine)
        steps: list[int] = []
        driver.add_step_listener(lambda outs, stats: steps.append(stats.num_running))
        await driver.start()
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        streamed = [o async for o in driver.generate(PROMPT, params, "a1")]
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        agen = driver.generate(PROMPT, long, "a2")
        await agen.__anext__()
        await agen.aclose()  # the consumer went away: the request must be aborted
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        stats = driver.stats()
        await driver.stop()
        return streamed, stats, steps

    streamed, stats, steps = asyncio.run(scenario())
    assert sum(len(o.new_token_ids) for o in streamed) == 6 and streamed[-1].finished
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert steps and max(steps) >= 1


def test_async_engine_builds_the_engine_on_the_thread_that_steps_it(
    make_engine: Callable[..., Engine],
) -> None:
    """One OS thread runs every torch op of the engine, its load included: a second thread
    with an OpenMP team of its own halves CPU decode speed (engine/async_engine.py says why)."""
    threads: dict[str, int] = {}

    def build() -> Engine:
        threads["build"] = threading.get_ident()
        return make_engine()

    async def scenario() -> list[RequestOutput]:
        driver = await AsyncEngine.create(build)

        def on_step(*_: object) -> None:
            threads.setdefault("step", threading.get_ident())

        driver.add_step_listener(on_step)
        await driver.start()
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        outputs = [o async for o in driver.generate(PROMPT, params, "t1")]
        await driver.stop()
        return outputs

    outputs = asyncio.run(scenario())
    assert outputs[-1].finished
    assert threads["build"] == threads["step"] != threading.get_ident()


def test_async_engine_create_raises_what_the_build_raises() -> None:
    def build() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(AsyncEngine.create(build))


def test_async_engine_concurrent_streams_equal_sync_results(engine: Engine) -> None:
    prompts = [PROMPT, "def f(x):", "The with statement", "Classes provide a means"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = {
        str(i): tokens(run(engine, {str(i): params}, p)[str(i)]) for i, p in enumerate(prompts)
    }

    async def consume(driver: AsyncEngine, prompt: str, request_id: str) -> list[int]:
        return [
            t
            async for out in driver.generate(prompt, params, request_id)
            for t in out.new_token_ids
        ]

    async def scenario() -> list[list[int]]:
        driver = AsyncEngine(engine)
        await driver.start()
        results = await asyncio.gather(
            *(consume(driver, p, f"c{i}") for i, p in enumerate(prompts))
        )
        with pytest.raises(ValueError, match="prompt is empty"):
            await anext(driver.generate("", params, "bad"))
        await driver.stop()
        return list(results)

    got = asyncio.run(scenario())
    assert got == [expected[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    ("kv_cache_memory", "message"),
    [
        # More than the machine has: refused before any allocation, naming the flag.
        (2**50, r"--kv-cache-memory 1048576\.00 GiB cannot fit: the memory this process may use"),
        # Room for less than one sequence of max_model_len: the pool's own check.
        (2**12, r"holds 0 blocks; one sequence of max_model_len 512 needs 32"),
    ],
)
def test_a_kv_cache_memory_the_engine_cannot_use_is_refused_at_start(
    make_engine: Callable[..., Engine], kv_cache_memory: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(kv_cache_memory=kv_cache_memory)
