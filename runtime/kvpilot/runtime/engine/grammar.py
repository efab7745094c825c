"""Grammar specs compiled with llguidance, off the engine step and cached (vLLM's approach).

llguidance (Rust, no transformers dependency) builds a matcher from the checkpoint's own
tokenizer.json. Compiling runs on a small thread pool: llguidance drops the GIL while it builds,
so neither the engine step nor the server's event loop waits for it. Compiled matchers are
templates cached by spec; each sequence advances its own deep copy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import llguidance
from llguidance import LLMatcher

from kvpilot.runtime.engine.structured import GrammarSpec

# Compact JSON (no optional whitespace): a weak model cannot loop on blanks, and the output is
# what json.dumps(..., separators=(",", ":")) would write.
JSON_OPTIONS: llguidance._lib.JsonCompileOptions = {"whitespace_flexible": False}
CACHE_SIZE = 256
COMPILE_THREADS = 2


class GrammarError(ValueError):
    """The spec does not compile; the message says why (llguidance's own words)."""


def to_llguidance(spec: GrammarSpec) -> str:
    """The spec in llguidance's grammar format; ValueError for text that is not even parseable."""
    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    if spec.kind == "grammar":  # vLLM's `grammar` field: Lark, or GBNF converted to Lark
        return llguidance.grammar_from("grammar", spec.text)
    return LLMatcher.grammar_from_lark(spec.text)


def make_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of the checkpoint's tokenizer; `vocab_size` is the model's (the logits'
    width), which may exceed the tokenizer's: the extra ids are never allowed."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)


class GrammarCompiler:
    """Compiles specs on a thread pool; `compile` returns a future of a template matcher, cached
    by spec (the most recent CACHE_SIZE specs), a failure as GrammarError in the future."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        pool: Executor | None = None,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = pool or ThreadPoolExecutor(COMPILE_THREADS, "kvpilot-grammar")
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Future[LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Future[LLMatcher]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self.pool.submit(self._build, spec)
            self._cache[spec] = future
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _build(self, spec: GrammarSpec) -> LLMatcher:
        try:
            grammar = to_llguidance(spec)
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(template: LLMatcher) -> LLMatcher:
    """A sequence's own matcher, at the grammar's start."""
    return template.deep_copy()
