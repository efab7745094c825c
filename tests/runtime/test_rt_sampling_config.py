"""SamplingParams and EngineConfig validation; stop-string and streaming rules."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.sampling import (
    SamplingParams,
    find_stop,
    num_emittable_chars,
    stop_search_start,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be"),
        ({"logprobs": -1}, "logprobs must be"),
        ({"stop": ("",)}, "stop must not contain empty"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token ids"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "is_greedy", "top_k"),
    [({"temperature": 0}, True, 0), ({"top_k": -1}, False, 0), ({"top_k": 5}, False, 5)],
)
def test_sampling_params_derived(kwargs: dict[str, Any], is_greedy: bool, top_k: int) -> None:
    params = SamplingParams(**kwargs)
    assert params.is_greedy is is_greedy and params.effective_top_k == top_k


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "fp8"}, "quantization must be one of"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"device": "tpu"}, "device must be one of"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be in"),
        ({"kv_cache_memory": 0}, "kv_cache_memory must be > 0"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority"),
    ],
)
def test_engine_config_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **kwargs)


@pytest.mark.parametrize(
    ("text", "stops", "start", "expected"),
    [
        ("hello world", ("world",), 0, 6),
        ("hello world", ("xyz",), 0, None),
        ("a stop b STOP", ("STOP", "stop"), 0, 2),  # earliest wins
        ("stop here", ("stop",), 1, None),  # before the search start
    ],
)
def test_find_stop(text: str, stops: tuple[str, ...], start: int, expected: int | None) -> None:
    assert find_stop(text, stops, start) == expected


def test_stop_search_start_reaches_back_for_split_stops() -> None:
    assert stop_search_start(10, ("abcd",)) == 7
    assert stop_search_start(1, ("abcd",)) == 0
    assert stop_search_start(10, ()) == 10


@pytest.mark.parametrize(
    ("text", "stops", "is_finished", "expected"),
    [
        ("hello", (), False, 5),
        ("hello\ufffd", (), False, 5),  # half a character: wait for the next token
        ("hello wo", ("world",), False, 6),  # "wo" could become "world": held back
        ("hello wx", ("world",), False, 8),
        ("hello wo", ("world",), True, 8),  # finished: everything goes out
    ],
)
def test_num_emittable_chars(
    text: str, stops: tuple[str, ...], is_finished: bool, expected: int
) -> None:
    assert num_emittable_chars(text, stops, is_finished) == expected
