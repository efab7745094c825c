"""bench.engine_prequant's like-with-like baseline: the engine's own int4 with exactly the
matrices a checkpoint keeps 16-bit put back in bf16, and their description in the table."""

from __future__ import annotations

import pytest

from bench.engine_common import MODEL
from bench.engine_prequant import describe, kept_16_bit, make_engine, weight_slots
from kvpilot.runtime.layers.quant import DenseWeight, Int4Weight

LAYERS = 2
ATTENTION = {f"{i}.{m}" for i in range(LAYERS) for m in ("qkv", "o")}
MLP = {f"{i}.{m}" for i in range(LAYERS) for m in ("gate_up", "down")}


@pytest.mark.parametrize(
    ("names", "words"),
    [
        ({"embedding"}, "embedding"),
        ({"embedding", "lm_head"}, "embedding and lm_head"),
        ({"embedding", "lm_head", *MLP}, "embedding, lm_head and MLP"),
        ({"embedding", "0.down"}, "embedding and some MLP"),
        (ATTENTION | MLP, "attention and MLP"),
    ],
)
def test_describe_names_what_is_kept(names: set[str], words: str) -> None:
    assert describe(frozenset(names), LAYERS) == words


def test_the_baseline_puts_back_exactly_what_is_named() -> None:
    kept = frozenset({"embedding", "0.gate_up", "1.down"})
    engine = make_engine(MODEL, "int4", kept)
    try:
        assert kept_16_bit(engine) == kept
        for name, (holder, attr) in weight_slots(engine).items():
            if name == "lm_head":  # tied: still the own int4 embedding's matrix
                assert isinstance(getattr(holder, attr), Int4Weight)
                continue
            assert isinstance(getattr(holder, attr), DenseWeight if name in kept else Int4Weight)
    finally:
        engine.shutdown()


def test_a_fresh_process_times_the_engines_start_not_its_imports() -> None:
    """The start timed inside a new interpreter: less than the child's whole life (its imports
    take seconds), and more than nothing."""
    import time

    from bench.engine_prequant import fresh_load_seconds

    began = time.perf_counter()
    seconds = fresh_load_seconds(MODEL, "int4")
    assert 0 < seconds < (time.perf_counter() - began) / 2
