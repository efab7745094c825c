"""The engine's sequences and their grammars: compiled off the step before a sequence joins the
batch (vLLM's WAITING_FOR_FSM), and the finish a complete grammar brings."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future

from llguidance import LLMatcher

from kvpilot.runtime.engine.grammar import GrammarCompiler, new_matcher
from kvpilot.runtime.engine.sequence import Sequence

InboxEntry = tuple[Sequence, str | None]  # a sequence and its leader's request id (n > 1)

log = logging.getLogger("kvpilot.engine")


class CompilingSequences:
    """The sequences whose grammar is compiling, by request id: each joins the engine's inbox
    once its grammar is ready, so the batch never waits for a compile.

    The engine's lock guards them with its inbox, so a sequence is always in exactly one of the
    two: the caller holds it for every method but `compile`, whose callback, on a compile
    thread, takes it itself."""

    def __init__(
        self,
        lock: threading.Lock,
        join_inbox: Callable[[InboxEntry], None],
        wake: Callable[[], None],
    ) -> None:
        self._lock = lock
        self._join_inbox = join_inbox
        self._wake = wake  # the step loop: a sequence joined the inbox
        self._waiting: dict[str, InboxEntry] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, entries: Collection[InboxEntry]) -> None:
        for entry in entries:
            self._waiting[entry[0].request_id] = entry

    def cancel(self, request_ids: Collection[str]) -> list[Sequence]:
        """The aborted ones among them, no longer waiting; a compile that ends later drops them."""
        return [self._waiting.pop(r)[0] for r in request_ids if r in self._waiting]

    def compile(self, seq: Sequence, compiler: GrammarCompiler) -> None:
        """Without the lock: a cached grammar calls back at once, on this thread."""
        assert seq.params.grammar is not None
        future = compiler.compile(seq.params.grammar)
        future.add_done_callback(lambda done: self._on_compiled(seq, done))

    def _on_compiled(self, seq: Sequence, future: Future[LLMatcher]) -> None:
        """On a compile thread (or at once, for a cached grammar): the sequence joins the inbox
        with its own matcher, or finished as aborted when the grammar does not compile."""
        error = future.exception()
        if error is None:
            seq.grammar = new_matcher(future.result())
        else:  # the server compiles before it submits, so only direct engine users get here
            log.warning("request %s: grammar does not compile: %s", seq.request_id, error)
            seq.finish("abort")
        with self._lock:
            waiting = self._waiting.pop(seq.request_id, None)
            if waiting is None:
                return  # aborted meanwhile
            self._join_inbox(waiting)
        self._wake()


def grammar_end(seq: Sequence) -> str:
    """Why a sequence whose grammar is complete finishes: `stop`, or `abort` if the matcher
    refused a token (the mask makes that a bug)."""
    if seq.grammar is not None and seq.grammar.is_error():
        log.error("request %s: grammar matcher failed: %s", seq.request_id, seq.grammar.get_error())
        return "abort"
    return "stop"
