"""Synthetic prompts of an exact length in tokens, counted by the model's own tokenizer.

Two counters, one contract (`count(text) -> tokens`): a local tokenizer directory read with the
`tokenizers` library (`--tokenizer`), or the served model's `POST /tokenize` in vLLM's shape
({"model", "prompt", "add_special_tokens"} -> {"count", "max_model_len", "tokens"}), which vLLM
and the kvpilot runtime both answer.

A prompt is random words (no shared prefix across requests) cut to the word count whose text
has exactly the target number of tokens. Words are whole pre-tokens in every BPE and
SentencePiece tokenizer, so the count grows with each word, and a binary search over the prefix
length needs ~log2(N) counts; where the last word would overshoot, short words are tried in its
place.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx

MAX_FILL_TRIES = 64


class TokenCounter(Protocol):
    def count(self, text: str, add_special_tokens: bool) -> int:
        """Tokens in `text`; with special tokens as the completions endpoint adds them."""
        ...


class LocalTokenCounter:
    """A tokenizer.json from a local model directory (`--tokenizer DIR`)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        file = file / "tokenizer.json" if file.is_dir() else file
        if not file.is_file():
            raise ValueError(
                f"--tokenizer {path}: no tokenizer.json there; give the model's local directory "
                "(or its tokenizer.json)"
            )
        self.tokenizer = Tokenizer.from_file(str(file))

    def count(self, text: str, add_special_tokens: bool) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


class ServerTokenCounter:
    """The served model's `POST /tokenize` (vLLM's endpoint, at the server's root)."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float) -> None:
        root = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url, self.model = f"{root}/tokenize", model
        self.client = httpx.Client(headers=headers, timeout=timeout_s)

    def count(self, text: str, add_special_tokens: bool) -> int:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        response = self.client.post(self.url, json=body)
        if response.status_code in (404, 405):
            raise ValueError(
                f"{self.url} answered {response.status_code}: this server cannot count tokens; "
                "pass --tokenizer with the model's local directory"
            )
        if response.status_code != 200:
            raise ValueError(f"{self.url} answered {response.status_code}: {response.text[:300]}")
        return int(response.json()["count"])


def fit_prompt(
    words: Sequence[str],
    target: int,
    counter: TokenCounter,
    add_special_tokens: bool,
    vocabulary: Sequence[str] = (),
) -> str:
    """The longest prefix of `words` within `target` tokens, topped up to exactly `target` with
    the shortest words of `vocabulary` (default: `words`); ValueError if `words` are too few or
    no top-up lands on the target."""

    def count(parts: Sequence[str]) -> int:
        return counter.count(" ".join(parts), add_special_tokens)

    if count(words) < target:
        raise ValueError(f"{len(words)} words make fewer than {target} tokens")
    low, high = 0, len(words)  # count(words[:low]) <= target < count(words[:high]) or exact
    while high - low > 1:
        middle = (low + high) // 2
        if count(words[:middle]) <= target:
            low = middle
        else:
            high = middle
    chosen = list(words[:high] if count(words[:high]) == target else words[:low])
    fillers = sorted(set(vocabulary or words), key=lambda w: (len(w), w))[:MAX_FILL_TRIES]
    for _ in range(MAX_FILL_TRIES):
        if chosen and count(chosen) == target:  # an empty prompt is no prompt, whatever it counts
            return " ".join(chosen)
        extra = next((w for w in fillers if count([*chosen, w]) <= target), None)
        if extra is None:
            break
        chosen.append(extra)
    specials = " with the tokenizer's special tokens (e.g. BOS)" if add_special_tokens else ""
    raise ValueError(f"cannot make a prompt of exactly {target} tokens{specials} from these words")


def exact_prompt(
    rng: random.Random,
    vocabulary: Sequence[str],
    target: int,
    counter: TokenCounter,
    add_special_tokens: bool,
) -> str:
    """Random words of exactly `target` tokens (each word is at least one token, so `target`
    words always suffice)."""
    words = [rng.choice(vocabulary) for _ in range(max(target, 1))]
    return fit_prompt(words, target, counter, add_special_tokens, vocabulary)
