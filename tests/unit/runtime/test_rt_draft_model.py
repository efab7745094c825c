"""What a draft model must share with the served model before it may propose for it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.runtime.draft_model import check_draft, check_draft_positions
from kvpilot.runtime.loader import ModelConfig, load_model_config
from tests.support.reference_models import TINY_LLAMA

SERVED = load_model_config(TINY_LLAMA)  # 4096 output rows, 2048 positions
VOCAB = {"<s>": 0, "the": 1, "and": 2}
DRAFT_DIR = Path("/models/draft")


@pytest.mark.parametrize(
    ("draft", "draft_vocab", "error"),
    [
        (replace(SERVED, num_layers=1, hidden_size=64), VOCAB, None),
        (replace(SERVED, vocab_size=4000), VOCAB, None),  # fewer output rows: ids it can make
        (SERVED, {**VOCAB, "the": 2, "and": 1}, "has another tokenizer than the served model"),
        (SERVED, {**VOCAB, "or": 3}, r"another tokenizer .*\(4 vs 3 tokens"),
        (replace(SERVED, vocab_size=5000), VOCAB, "5000 output rows, more than the served"),
    ],
)
def test_a_draft_shares_the_served_models_tokenizer(
    draft: ModelConfig, draft_vocab: dict[str, int], error: str | None
) -> None:
    if error is None:
        check_draft(DRAFT_DIR, draft, draft_vocab, SERVED, VOCAB)
        return
    with pytest.raises(ValueError, match=error):
        check_draft(DRAFT_DIR, draft, draft_vocab, SERVED, VOCAB)


@pytest.mark.parametrize(("max_model_len", "fits"), [(2048, True), (2049, False)])
def test_a_draft_must_reach_max_model_len(max_model_len: int, fits: bool) -> None:
    if fits:
        check_draft_positions(DRAFT_DIR, SERVED, max_model_len)
        return
    with pytest.raises(ValueError, match="handles 2048 positions, fewer than --max-model-len 2049"):
        check_draft_positions(DRAFT_DIR, SERVED, max_model_len)
