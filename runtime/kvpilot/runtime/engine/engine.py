"""The engine: add requests, step the batch, stream outputs (asyncio driver:
engine/async_engine.py).

Thread model: `step()` runs in one thread (AsyncEngine's worker). `add_request`, `abort` and
`stats` may be called from any thread: they only touch a lock-protected inbox and snapshot.
With tensor_parallel_size > 1 the engine also owns worker processes (engine/worker.py), which
`shutdown()` stops and reaps.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from pathlib import Path

import torch

from kvpilot.contract.checkpoint_quant import (
    check_expected_checkpoint,
    check_prequantized_parallel,
    resolve_quantization,
)
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.draft_model import DraftModelProposer
from kvpilot.runtime.engine.grammar import GrammarCompiler, make_tokenizer
from kvpilot.runtime.engine.kv_offload import KvOffload, build_kv_offload
from kvpilot.runtime.engine.loading import load_models, start_rank_workers
from kvpilot.runtime.engine.lora_registry import LoraRegistry
from kvpilot.runtime.engine.lora_slots import LoraRequest, LoraSlots
from kvpilot.runtime.engine.output_processor import (
    RequestOutput,
    RequestState,
    finish_reason_for_token,
    make_output,
    stop_reason_for_token,
    update_text,
)
from kvpilot.runtime.engine.parallel import check_tensor_parallel, row_parallel_inputs
from kvpilot.runtime.engine.prompt_followers import PromptFollowers
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.scheduler import ScheduledSequence, Scheduler
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.engine.sequence_grammars import CompilingSequences, InboxEntry, grammar_end
from kvpilot.runtime.engine.sizing import (
    Hardware,
    resolve_hardware,
    resolve_max_model_len,
)
from kvpilot.runtime.engine.spec_step import SpecStep
from kvpilot.runtime.engine.stats import EngineStats, SpecDecodeCounts
from kvpilot.runtime.engine.waiting_queue import check_priority
from kvpilot.runtime.models.loader import ModelConfig, load_model_config
from kvpilot.runtime.models.tokenizer_files import Tokenizer

NewRequest = tuple[str | list[int], SamplingParams, str]  # (prompt, params, request id)

log = logging.getLogger("kvpilot.engine")


def check_token_ids(prompt_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    """Every token id a request names must index the vocabulary (the sampler indexes with them)."""
    named = {
        "prompt token ids": prompt_ids,
        "stop_token_ids": params.stop_token_ids,
        "logit_bias token ids": [token for token, _ in params.logit_bias],
    }
    for name, ids in named.items():
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{name} must be in [0, {vocab_size})")


def lora_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The adapters these sequences run under, each once, sorted."""
    return tuple(sorted({seq.lora.name for seq in seqs if seq.lora is not None}))


def check_checkpoint_quantization(config: EngineConfig, model_config: ModelConfig) -> None:
    """A pre-quantised checkpoint against the flags, before any process starts: a conflicting
    --quantization, a tensor parallelism that would split its groups, or a checkpoint other
    than --expect-checkpoint's kind, is refused (contract/checkpoint_quant.py)."""
    check_expected_checkpoint(config.expect_checkpoint, model_config.checkpoint_quant)
    resolve_quantization(config.quantization, model_config.checkpoint_quant)
    inputs = row_parallel_inputs(model_config)  # a rank's share of each must be whole groups
    check_prequantized_parallel(model_config.checkpoint_quant, config.tensor_parallel_size, inputs)


class Engine:
    def __init__(
        self, config: EngineConfig, on_phase: Callable[[str], None] = lambda _: None
    ) -> None:
        """`on_phase`: told "kernel" once the hardware and attention kernel are chosen and
        "weights" once the weights and KV pools are loaded (the server's start-up phases)."""
        self.config = config
        model_dir = Path(config.model)
        self.model_config = load_model_config(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.served_name = config.served_name or model_dir.resolve().name
        tp = config.tensor_parallel_size
        check_tensor_parallel(self.model_config, tp)  # before any process starts
        check_checkpoint_quantization(config, self.model_config)
        self._use_hardware(resolve_hardware(config, self.model_config))
        on_phase("kernel")
        torch.set_num_threads(self.num_threads)  # process-wide: rank 0 from here on
        # A draft model runs whole on rank 0, beside its shard of the served model (vLLM's
        # draft_tensor_parallel_size 1): a draft is small, and its steps need no all-reduce.
        self.speculative = config.speculative()
        self.workers = (
            start_rank_workers(config, self.model_config, self.hardware) if tp > 1 else None
        )
        try:
            self._load()
        except BaseException:
            self.shutdown()
            raise
        on_phase("weights")
        self.block_manager = BlockManager(self.num_kv_blocks, config.enable_prefix_caching)
        self.kv_offload: KvOffload | None = None
        if config.kv_offloading_size is not None:
            self.kv_offload = build_kv_offload(
                config, self.hardware, self.runner, config.kv_offloading_size
            )
            self.block_manager.lower = self.kv_offload
        if isinstance(self.proposer, DraftModelProposer):  # its KV follows the blocks' hashes
            self.proposer.blocks = self.block_manager
        self.lora_registry = (
            LoraRegistry(self.model_config, config.max_lora_rank, config.num_cpu_loras)
            if config.enable_lora
            else None
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            LoraSlots(config.max_loras) if config.enable_lora else None,
            policy=config.scheduling_policy,
        )
        self._init_requests()
        self._snapshot = self._make_stats()

    def _use_hardware(self, hardware: Hardware) -> None:
        """The choices, as the attributes /version and the start-up log read (server_state)."""
        self.hardware = hardware
        self.device = hardware.device
        self.dtype = hardware.dtype
        self.kv_dtype = hardware.kv_dtype
        self.cpu_has_bf16 = hardware.cpu_has_bf16
        self.cpu_has_int8_dot = hardware.cpu_has_int8_dot
        self.int8_kernel = hardware.int8_kernel
        self.attention_backend = hardware.attention_backend
        self.attention_source = hardware.attention_source
        self.num_threads = hardware.num_threads

    def _init_requests(self) -> None:
        """Where requests wait on their way into the batch (the inbox is any thread's)."""
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._inbox: list[InboxEntry] = []
        self._aborts: list[str] = []
        self.followers = PromptFollowers()
        self.on_work: Callable[[], None] = lambda: None  # a compiled sequence joined the inbox
        self.compiling = CompilingSequences(self._lock, self._join_inbox, self._wake)
        self.grammar_compiler = GrammarCompiler(
            make_tokenizer(
                self.tokenizer.hf.to_str(),
                self.model_config.vocab_size,
                self.tokenizer.eos_token_ids,
            )
        )
        self.spec_decode = SpecDecodeCounts()
        self.spec_step = SpecStep(self.speculative, self.max_model_len, self.spec_decode)

    def _join_inbox(self, entry: InboxEntry) -> None:  # `compiling` holds the lock
        self._inbox.append(entry)

    def _wake(self) -> None:  # a compiled sequence joined the inbox; AsyncEngine sets on_work
        self.on_work()

    def _load(self) -> None:
        """Rank 0's models and KV pools (engine/loading.py); the workers load theirs alongside."""
        eos = tuple(self.tokenizer.eos_token_ids)
        loaded = load_models(
            self.config, self.model_config, self.hardware, self.max_model_len, self.speculative,
            self.workers, eos,
        )  # fmt: skip
        self.runner, self.proposer = loaded.runner, loaded.proposer
        self.weight_bytes = loaded.weight_bytes
        self.num_kv_blocks = loaded.kv_pool.num_blocks
        self.kv_budget_source = loaded.kv_pool.budget.source

    def shutdown(self) -> None:
        """Stop and reap the tensor-parallel workers, if any; idempotent. A single-process
        engine needs no shutdown, but calling it does no harm."""
        if self.workers is not None:
            self.workers.shutdown()
        if hasattr(self, "grammar_compiler"):  # absent when loading failed
            self.grammar_compiler.shutdown()
        kv_offload = getattr(self, "kv_offload", None)  # absent when loading failed
        if kv_offload is not None:  # writes what the disk tier has queued
            kv_offload.close()

    # -- requests (any thread) --------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoraRequest | None = None,
    ) -> str:
        return self.add_requests([(prompt, params, request_id or uuid.uuid4().hex)], lora)[0]

    def add_requests(
        self, requests: Collection[NewRequest], lora: LoraRequest | None = None
    ) -> list[str]:
        """Add several requests at once, all or none, all under the LoRA adapter `lora` (None:
        the base model; see `lora_request`). A request whose prompt equals an earlier
        one's in the same call (n > 1 choices of one prompt) waits until that one's prompt is in
        the cache, then reads it from there rather than computing it again."""
        if lora is not None and self.lora_registry is None:
            raise ValueError(
                "a request names a LoRA adapter but the engine runs without --enable-lora"
            )
        seqs = [self._make_sequence(prompt, params, rid) for prompt, params, rid in requests]
        for seq in seqs:
            seq.lora = lora
        leaders: dict[tuple[int, ...], str] = {}
        entries: list[InboxEntry] = []
        for seq in seqs:
            leader = leaders.setdefault(tuple(seq.token_ids), seq.request_id)
            # Only a sequence that can read the cache gains from waiting for its leader.
            can_share = self.config.enable_prefix_caching and not seq.wants_prompt_logprobs
            is_follower = leader != seq.request_id and can_share
            entries.append((seq, leader if is_follower else None))
        with self._lock:
            ids = [seq.request_id for seq in seqs]
            if len(set(ids)) != len(ids) or any(self._is_known(i) for i in ids):
                raise ValueError(f"request ids {ids} collide with each other or one in use")
            self._inbox += [e for e in entries if e[0].params.grammar is None]
            to_compile = [e for e in entries if e[0].params.grammar is not None]
            self.compiling.hold(to_compile)
        # A grammar compiles off the step (as vLLM's WAITING_FOR_FSM): its sequence joins the
        # inbox once compiled, so other sequences never wait for it.
        for waiting, _ in to_compile:
            self.compiling.compile(waiting, self.grammar_compiler)
        return ids

    def _make_sequence(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> Sequence:
        if not prompt:
            raise ValueError("prompt is empty")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_token_ids(token_ids, params, self.model_config.vocab_size)
        check_priority(params.priority, self.config.scheduling_policy)
        if len(token_ids) + 1 > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, max_model_len is {self.max_model_len}"
            )
        return Sequence(request_id, token_ids, params)

    def _is_known(self, request_id: str) -> bool:
        return (
            request_id in self._states
            or request_id in self.compiling
            or any(s.request_id == request_id for s, _ in self._inbox)
        )

    # -- LoRA adapters (any thread; loading reads files: keep it off an event loop) ---------------

    def load_lora(self, name: str, path: str, uri: str | None = None) -> LoraRequest:
        """Register the PEFT adapter at `path` as `name` (lora_files.LoraError if it cannot run);
        `uri`: where it was fetched from, if it was."""
        return self._loras().load(name, path, uri)

    def unload_lora(self, name: str) -> None:
        self._loras().unload(name)

    def lora_request(self, name: str) -> LoraRequest:
        """What `add_requests` takes to run under adapter `name` (LoraNotFoundError if unknown)."""
        return self._loras().request_for(name)

    def _loaded_lora_names(self) -> tuple[str, ...]:
        if self.lora_registry is None:
            return ()
        return tuple(sorted(entry.name for entry in self.lora_registry.adapters()))

    def _loras(self) -> LoraRegistry:
        if self.lora_registry is None:
            raise ValueError("LoRA adapters need the engine started with --enable-lora")
        return self.lora_registry

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts or self._states or self.compiling)

    def has_steppable_work(self) -> bool:
        """Unfinished requests that a step can advance (not those whose grammar compiles)."""
        with self._lock:
            return bool(self._inbox or self._aborts or self._states)

    def stats(self) -> EngineStats:
        with self._lock:
            snapshot = self._snapshot
            num_waiting = snapshot.num_waiting + len(self._inbox) + len(self.compiling)
            return replace(snapshot, num_waiting=num_waiting)

    def _make_stats(self, num_step_tokens: int = 0) -> EngineStats:
        bm = self.block_manager
        # Every step: the adapter names walk the whole queue, so only a LoRA server pays for it.
        lora_on = self.config.enable_lora
        slots = self.scheduler.lora_slots
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_total_blocks=bm.num_total_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage(),
            prefix_cache_queries=bm.num_queried_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            preemptions_by_reason=tuple(self.scheduler.preemptions.items()),
            num_step_tokens=num_step_tokens,
            spec_decode_drafts=self.spec_decode.drafts,
            spec_decode_draft_tokens=self.spec_decode.draft_tokens,
            spec_decode_accepted_tokens=self.spec_decode.accepted_tokens,
            running_lora_adapters=lora_names(self.scheduler.running) if lora_on else (),
            waiting_lora_adapters=lora_names(self.scheduler.waiting) if lora_on else (),
            max_lora=self.config.max_loras if lora_on else 0,
            lora_loads=slots.num_loads if slots is not None else 0,
            lora_evictions=slots.num_evictions if slots is not None else 0,
            loaded_lora_adapters=self._loaded_lora_names(),
            kv_offload=None
            if self.kv_offload is None
            else self.kv_offload.stats(bm.num_lower_queried_tokens, bm.num_lower_hit_tokens),
        )

    # -- the step loop (one thread) ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        if self.proposer is not None:
            self.spec_step.propose(self.proposer, self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.proposer is not None:
            for seq in batch.preempted:  # its blocks are gone: a draft's KV with them
                self.proposer.release(seq.request_id)
        self._transfer_tier_blocks()
        num_step_tokens = sum(item.num_new_tokens for item in batch.scheduled)
        self.runner.load_loras(batch.lora_loads)
        if batch.scheduled:
            started = time.monotonic()
            if self.proposer is not None:
                self.proposer.fill(batch.scheduled)
            for item in batch.scheduled:
                item.seq.times.on_scheduled(started)
            result = self.runner.execute(batch.scheduled)
            self.scheduler.update_after_step(batch)
            done = time.monotonic()
            for item, _, _ in result.samples:
                item.seq.times.on_token(done)
            for request_id, scored in result.prompt_logprobs.items():
                self._states[request_id].add_prompt_logprobs(scored)
            for item, tokens, logprobs in result.samples:
                outputs.append(self._on_tokens(item, tokens, logprobs))
                if item.num_draft_tokens:  # the accepted proposals' KV counts from here
                    self.scheduler.accept_drafts(item, len(tokens) - 1)
                    self.spec_step.count_drafts(item, len(tokens) - 1)
            if self.proposer is not None:
                self.spec_step.measure(
                    batch.scheduled, result.samples, num_step_tokens, done - started
                )
        for seq in self.followers.release(self._states):
            outputs += self._schedule(seq, at_front=True)
        with self._lock:
            self._snapshot = self._make_stats(num_step_tokens)
        return outputs

    def _transfer_tier_blocks(self) -> None:
        """Evicted blocks out to the KV tiers and tier hits into the pool, before the step."""
        if self.kv_offload is not None:
            self.kv_offload.transfer(*self.block_manager.take_transfers())

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
            compiling = self.compiling.cancel(aborts)
        outputs: list[RequestOutput] = []
        for seq in compiling:
            seq.finish("abort")
            outputs.append(make_output(RequestState(seq), is_finished=True))
        for seq, leader in inbox:
            if seq.is_finished:  # its grammar did not compile
                outputs.append(make_output(RequestState(seq), is_finished=True))
            elif leader is not None and leader in self._states:
                self._states[seq.request_id] = RequestState(seq)
                self.followers.hold(leader, seq)
            else:
                outputs += self._schedule(seq)
        for request_id in aborts:
            state = self._states.get(request_id)
            if state is not None:
                outputs.append(self._finish(state, "abort"))
        return outputs

    def _schedule(self, seq: Sequence, at_front: bool = False) -> list[RequestOutput]:
        try:
            self.scheduler.add(seq, at_front)
            self._states[seq.request_id] = RequestState(seq)
            return []
        except ValueError:
            seq.finish("abort")  # cannot ever fit the pool; report instead of hanging
            self._states.pop(seq.request_id, None)
            return [make_output(RequestState(seq), is_finished=True)]

    def _on_tokens(
        self,
        item: ScheduledSequence,
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
    ) -> RequestOutput:
        """The step's new tokens of one sequence (several when proposals were accepted), up
        to the first that finishes it; one output for them all."""
        state = self._states[item.seq.request_id]
        for token_id, token_logprobs in zip(token_ids, logprobs, strict=True):
            reason = self._on_token(state, token_id, token_logprobs)
            if reason is not None:
                return self._finish(state, reason)
        return make_output(state, is_finished=False)

    def _on_token(
        self, state: RequestState, token_id: int, logprobs: dict[int, float] | None
    ) -> str | None:
        """Append one token; the finish reason it brings, if any."""
        seq = state.seq
        seq.append_token(token_id)
        if logprobs is not None:
            state.pending_logprobs.append(logprobs)
        if seq.grammar is not None:
            seq.grammar.consume_token(token_id)
        eos_token_ids = self.tokenizer.eos_token_ids
        reason = finish_reason_for_token(seq, token_id, eos_token_ids, self.max_model_len)
        if reason == "stop":
            seq.stop_reason = stop_reason_for_token(seq.params, token_id, eos_token_ids)
        reason = update_text(state, self.tokenizer, reason)
        if reason is None and seq.grammar is not None and seq.grammar.is_stopped():
            # The grammar is complete: this token is part of the output, unlike an EOS, so the
            # text was updated as for a running sequence.
            reason = grammar_end(seq)
        return reason

    def _finish(self, state: RequestState, reason: str) -> RequestOutput:
        self.scheduler.finish(state.seq, reason)
        self.runner.release(state.seq.request_id)
        if self.proposer is not None:
            self.proposer.release(state.seq.request_id)
        del self._states[state.seq.request_id]
        return make_output(state, is_finished=True)
