"""Cascade rules, the pure part (routing/cascade_policy.py's policy applies them): declarative, per
served name, tried in order before a replica is picked; the first rule whose conditions all hold
sends the request to its target model instead (e.g. short prompts without tools to a small model).

Prompt tokens: the gateway has no tokenizer, so it counts the prompt's UTF-8 bytes (chat: every
string in the messages; token-id prompts: the ids). That is an upper bound on the tokens of the
prompt's text for byte-level BPE and SentencePiece (byte fallback) vocabularies, whose every token
covers at least one byte; the chat template's own tokens are not counted. So a request a
`maxPromptTokens` rule sends to the small model is within the limit; some within it stay big.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.gateway import bodies


@dataclass(frozen=True)
class CascadeRule:
    """Send a request to `target` (a served name) when every condition given holds; a rule
    whose target is None (a ModelDeployment that does not exist yet) never applies."""

    target: str | None
    max_prompt_tokens: int | None = None
    no_tools: bool = False


@dataclass(frozen=True)
class PromptFacts:
    num_prompt_tokens_bound: int  # the prompt's UTF-8 bytes (ids: their count)
    has_tools: bool


def prompt_facts(kind: str, payload: dict[str, Any]) -> PromptFacts:
    if kind == bodies.CHAT:
        tools = payload.get("tools") or payload.get("functions")
        return PromptFacts(num_text_bytes(payload.get("messages")), bool(tools))
    return PromptFacts(num_prompt_units(payload.get("prompt")), False)


def num_text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string in `value` (messages: content, parts, tool-call arguments)."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, dict):
        return sum(num_text_bytes(item) for item in value.values())
    if isinstance(value, list):
        return sum(num_text_bytes(item) for item in value)
    return 0


def num_prompt_units(prompt: Any) -> int:
    """A completions prompt's bound: text bytes, or token ids counted; a batch sums its prompts."""
    if isinstance(prompt, int) and not isinstance(prompt, bool):
        return 1
    if isinstance(prompt, list):
        return sum(num_prompt_units(item) for item in prompt)
    return num_text_bytes(prompt)


def matches(rule: CascadeRule, facts: PromptFacts) -> bool:
    if rule.target is None or (rule.no_tools and facts.has_tools):
        return False
    limit = rule.max_prompt_tokens
    return limit is None or facts.num_prompt_tokens_bound <= limit


def choose(rules: Sequence[CascadeRule], facts: PromptFacts) -> int | None:
    """The index of the first rule that applies, or None."""
    return next((index for index, rule in enumerate(rules) if matches(rule, facts)), None)


def find_cycle(edges: dict[str, list[tuple[int, str]]]) -> list[tuple[str, int, str]] | None:
    """The rules of one cycle among `edges` (model -> [(rule index, target)]) as (model, index,
    target) in order, or None. A request is re-routed once, so a cycle never loops, but it makes
    which model serves depend on where the request entered: a config with one is refused."""
    done: set[str] = set()

    def visit(model: str, path: list[tuple[str, int, str]]) -> list[tuple[str, int, str]] | None:
        on_path = [step[0] for step in path]
        if model in on_path:
            return path[on_path.index(model) :]
        if model in done:
            return None
        for index, target in edges.get(model, []):
            cycle = visit(target, [*path, (model, index, target)])
            if cycle is not None:
                return cycle
        done.add(model)
        return None

    return next((c for c in (visit(m, []) for m in sorted(edges)) if c is not None), None)
