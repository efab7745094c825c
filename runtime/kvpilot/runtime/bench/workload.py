"""What `kvpilot bench` sends and when: prompts (a user's JSONL or synthetic) and arrival times."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.runtime.server.json_text import load_object

from .tokens import TokenCounter, exact_prompt

# Common short English words, the material of synthetic prompts; tokens.py cuts them to an exact
# number of tokens with the model's own tokenizer.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her an are were which this be or "
    "had not but have one all their there been has when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first any "
    "my now such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since "
    "against go came right used take three"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int] | list[dict[str, Any]]  # text or token ids (completions), or messages
    max_tokens: int
    prompt_len: int = 0  # estimate in tokens; the server's usage replaces it when reported


def synthetic_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """Uniform lengths in [mean*(1-r), mean*(1+r)], at least 1 (vLLM's random dataset)."""
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def synthetic_requests(
    n: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    chat: bool,
    counter: TokenCounter,
) -> list[BenchRequest]:
    """Prompts of exactly their drawn length in tokens: a completions prompt as the server counts
    it (special tokens such as BOS included), a chat message's content without them (the chat
    template adds its own)."""
    rng = random.Random(seed)
    inputs = synthetic_lengths(n, input_len, range_ratio, rng)
    outputs = synthetic_lengths(n, output_len, range_ratio, rng)
    requests = []
    for num_in, num_out in zip(inputs, outputs, strict=True):
        # Random words per request: prompts share no prefix, so the prefix cache does not flatter.
        text = exact_prompt(rng, WORDS, num_in, counter, add_special_tokens=not chat)
        prompt: str | list[dict[str, Any]] = [{"role": "user", "content": text}] if chat else text
        requests.append(BenchRequest(prompt=prompt, max_tokens=num_out, prompt_len=num_in))
    return requests


def parse_jsonl_line(line: str, lineno: int, chat: bool, default_max_tokens: int) -> BenchRequest:
    """One JSONL record: {"prompt": str | [token ids]} or {"messages": [...]}, "max_tokens"."""
    record = load_object(line, f"line {lineno}", "an object with 'prompt' or 'messages'")
    max_tokens = record.get("max_tokens", record.get("output_len", default_max_tokens))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"line {lineno}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if isinstance(record.get("messages"), list):
        messages = record["messages"]
        prompt: str | list[int] | list[dict[str, Any]] = messages if chat else _flatten(messages)
    elif isinstance(record.get("prompt"), str):
        prompt = [{"role": "user", "content": record["prompt"]}] if chat else record["prompt"]
    elif _is_token_ids(record.get("prompt")) and not chat:
        prompt = record["prompt"]  # token ids: the exact workload, no re-tokenisation
    else:
        raise ValueError(f"line {lineno}: needs a string 'prompt' (or token ids) or 'messages'")
    return BenchRequest(prompt=prompt, max_tokens=max_tokens)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _flatten(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages)


def load_jsonl(path: Path, n: int, chat: bool, default_max_tokens: int) -> list[BenchRequest]:
    """The first `n` records, cycling through the file when it holds fewer."""
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    records = [parse_jsonl_line(line, i, chat, default_max_tokens) for i, line in lines]
    return [records[i % len(records)] for i in range(n)]


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds) for an open-loop run: gamma inter-arrival gaps as in vLLM.

    burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular. The mean rate is
    `rate` either way (shape k = burstiness, scale = 1 / (rate * k)). rate = inf sends all at once.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times
