"""The detokeniser fed one token at a time (Tokenizer.decode_stream, what the engine streams
with) gives what one decode of the whole output gives, at every token: real text of several
scripts and emoji (byte-fallback tokens), and random ids (special tokens, stray bytes)."""

from __future__ import annotations

import random

import pytest

from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.server_process import TINY

TEXT = (TINY / "eval.txt").read_text()[:4000] + " héllo wörld, 日本語のテキスト 🎉🚀 done.\n\n  x"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(TINY)


def outputs(tokenizer: Tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cuts = [text_ids[start : start + 80] for start in range(0, len(text_ids) - 80, 40)]
    vocab = tokenizer.vocab_size
    return cuts + [[rng.randrange(vocab) for _ in range(60)] for _ in range(60)]


def test_the_streamed_text_is_the_whole_decode_token_by_token(tokenizer: Tokenizer) -> None:
    checked = 0
    for ids in outputs(tokenizer):
        stream, streamed = tokenizer.decode_stream(), ""
        for end in range(1, len(ids) + 1):
            streamed += stream.step(ids[end - 1]) or ""
            whole = tokenizer.decode(ids[:end])
            # A character still incomplete: the stream holds its bytes, decode shows U+FFFD.
            assert whole.startswith(streamed), (ids[:end], streamed, whole)
            if not whole.endswith("\ufffd"):
                assert streamed == whole, (ids[:end], streamed, whole)
                checked += 1
    assert checked > 5000
