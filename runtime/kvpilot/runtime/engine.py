"""The engine: add requests, step the batch, stream outputs (asyncio driver: async_engine.py).

Thread model: `step()` runs in one thread (AsyncEngine's worker). `add_request`, `abort` and
`stats` may be called from any thread: they only touch a lock-protected inbox and snapshot.
With tensor_parallel_size > 1 the engine also owns worker processes (worker.py), which
`shutdown()` stops and reaps.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import torch
from llguidance import LLMatcher

from kvpilot.runtime import machine, machine_probe, memory, speculative
from kvpilot.runtime.block_manager import BlockManager
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.draft_model import DraftModelProposer, load_draft
from kvpilot.runtime.engine_sizing import model_facts, resolve_device, resolve_max_model_len
from kvpilot.runtime.engine_stats import EngineStats, SpecDecodeCounts
from kvpilot.runtime.grammar import GrammarCompiler, make_tokenizer, new_matcher
from kvpilot.runtime.layers import flashinfer_attention, paged_kernel
from kvpilot.runtime.layers.attention import resolve_attention_backend
from kvpilot.runtime.layers.kv_cache import resolve_kv_cache_dtype
from kvpilot.runtime.layers.quant import resolve_int8_kernel
from kvpilot.runtime.loader import load_model_config, resolve_dtype
from kvpilot.runtime.model_runner import ModelRunner, load_model
from kvpilot.runtime.output_processor import (
    RequestOutput,
    RequestState,
    finish_reason_for_token,
    make_output,
    stop_reason_for_token,
    update_text,
)
from kvpilot.runtime.parallel import TPGroup, check_tensor_parallel, rank_device
from kvpilot.runtime.sampling import SamplingParams
from kvpilot.runtime.scheduler import ScheduledSequence, Scheduler
from kvpilot.runtime.sequence import Sequence
from kvpilot.runtime.spec_governor import Governor
from kvpilot.runtime.tokenizer import Tokenizer
from kvpilot.runtime.worker import WorkerArgs, WorkerPool, start_workers

__all__ = ["Engine", "NewRequest", "RequestOutput"]

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


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        self.model_config = load_model_config(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.served_name = config.served_name or model_dir.resolve().name
        tp = config.tensor_parallel_size
        check_tensor_parallel(self.model_config, tp)  # before any process starts
        self.device = resolve_device(config.device)
        if tp > 1:
            self.device = rank_device(self.device, 0, tp)
        # Read before the weights load, which take their share of it (subtracted in the budget).
        self.usable_memory = machine_probe.usable_memory() if self.device.type == "cpu" else None
        cpu_flags = machine_probe.cpu_flags()  # /proc/cpuinfo, read once
        self.cpu_has_bf16 = machine.cpu_supports_bf16(cpu_flags)
        dtype = resolve_dtype(
            config.dtype, self.model_config.torch_dtype, self.device, self.cpu_has_bf16
        )
        self.dtype = dtype
        # Before the weights load: an unsupported KV dtype fails in a second, not a minute.
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, self.device)
        self.cpu_has_int8_dot = machine.cpu_supports_int8_dot(cpu_flags)
        self.int8_kernel = resolve_int8_kernel(
            config.int8_kernel, self.device, self.cpu_has_int8_dot
        )
        self.attention_backend, self.attention_source = resolve_attention_backend(
            config.attention_backend, self.device, self.kv_dtype == dtype,
            paged_kernel.unavailable_reason,
            lambda: flashinfer_attention.unavailable_reason(
                self.device, dtype, self.model_config.head_dim, self.kv_dtype
            ),
        )  # fmt: skip
        if self.attention_backend == "flashinfer":  # /version and the log name the release
            self.attention_source += f" (flashinfer-python {flashinfer_attention.version()})"
        # Each rank, this one included, computes with its share of the threads torch was given.
        # Process-wide: this process is rank 0 of the group from here on.
        self.num_threads = machine.threads_per_rank(torch.get_num_threads(), tp)
        torch.set_num_threads(self.num_threads)
        # A draft model runs whole on rank 0, beside its shard of the served model (vLLM's
        # draft_tensor_parallel_size 1): a draft is small, and its steps need no all-reduce.
        self.speculative = config.speculative()
        self.workers = self._start_workers(dtype) if tp > 1 else None
        try:
            self._load(model_dir, dtype)
        except BaseException:
            self.shutdown()
            raise
        self.block_manager = BlockManager(self.num_kv_blocks, config.enable_prefix_caching)
        if isinstance(self.proposer, DraftModelProposer):  # its KV follows the blocks' hashes
            self.proposer.blocks = self.block_manager
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._inbox: list[tuple[Sequence, str | None]] = []  # (sequence, leader's request id)
        self._followers: dict[str, list[Sequence]] = {}  # leader id -> sequences held for it
        self._aborts: list[str] = []
        # Sequences whose grammar is compiling (vLLM's WAITING_FOR_FSM): they join the inbox
        # when it is ready, so the batch never waits for a compile.
        self._compiling: dict[str, tuple[Sequence, str | None]] = {}  # as in the inbox
        self.on_work: Callable[[], None] = lambda: None  # a compiled sequence joined the inbox
        self.grammar_compiler = GrammarCompiler(
            make_tokenizer(
                self.tokenizer.hf.to_str(),
                self.model_config.vocab_size,
                self.tokenizer.eos_token_ids,
            )
        )
        self.spec_decode = SpecDecodeCounts()
        self.governor = Governor()
        self._drafted: list[Sequence] = []  # the sequences given proposals this step
        self._snapshot = self._make_stats()

    def _start_workers(self, dtype: torch.dtype) -> WorkerPool:
        args = WorkerArgs(
            model_dir=Path(self.config.model),
            model_config=self.model_config,
            quantization=self.config.quantization,
            int8_kernel=self.int8_kernel,
            attention_backend=self.attention_backend,
            dtype=dtype,
            device=self.device,
            seed=self.config.seed,
            group=TPGroup(0, self.config.tensor_parallel_size),
            init_method="",  # chosen by start_workers
            parent_pid=os.getpid(),
            num_threads=self.num_threads,
        )
        return start_workers(args)

    def _load(self, model_dir: Path, dtype: torch.dtype) -> None:
        """This rank's shard of the model and KV pool; with workers, theirs alongside."""
        group = TPGroup(0, self.config.tensor_parallel_size)
        model = load_model(
            model_dir,
            self.model_config,
            self.config.quantization,
            dtype,
            self.device,
            group,
            self.int8_kernel,
        )
        if self.workers is not None:
            self.workers.join_group(group, self.device)
        self.weight_bytes = model.weight_bytes()  # per rank
        eos = tuple(self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(
            model, self.device, self.config.seed, self.workers, eos, self.attention_backend
        )
        self.proposer = self._load_proposer(model_dir, dtype)
        self.num_kv_blocks = self._num_kv_blocks(self.kv_dtype)
        self.runner.allocate_kv_cache(self.num_kv_blocks, self.kv_dtype)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.runner.allocate_kv_cache(self.num_kv_blocks, self.kv_dtype)

    def _load_proposer(self, model_dir: Path, dtype: torch.dtype) -> speculative.Proposer | None:
        """Where proposals come from (speculative decoding), None when it is off. A draft
        model's weights count with the served model's in the memory budget."""
        config = self.speculative
        if config is None:
            return None
        if config.model is None:
            return speculative.NgramProposer(config)
        draft = load_draft(
            Path(config.model), model_dir, self.max_model_len, dtype,
            self.device, self.config.seed, self.attention_backend, self.kv_dtype,
        )  # fmt: skip
        self.weight_bytes += draft.runner.model.weight_bytes()
        return draft

    def shutdown(self) -> None:
        """Stop and reap the tensor-parallel workers, if any; idempotent. A single-process
        engine needs no shutdown, but calling it does no harm."""
        if self.workers is not None:
            self.workers.shutdown()
        if hasattr(self, "grammar_compiler"):  # absent when loading failed
            self.grammar_compiler.shutdown()

    def _num_kv_blocks(self, kv_dtype: torch.dtype) -> int:
        """Pool size from the shared memory arithmetic (DESIGN.md §3.3), at the bytes of the
        KV storage dtype: fp8 holds twice the blocks of bf16 in the same budget. The budget is
        per rank (per GPU), and so is the pool: each rank caches only its own KV heads. Rank 0
        sizes it for every rank, so the ranks' GPUs are taken to be alike (one per replica type);
        rank 0 is the fullest, with the draft model's weights and whole KV cache if there is one."""
        kv_bytes = torch.tensor([], dtype=kv_dtype).element_size()
        rank_facts = model_facts(self.runner.model.cfg)  # this rank's share of the KV heads
        # A draft model's KV cache has as many blocks as the served model's: the budget holds
        # both, so each block costs (1 + draft_share) of the served model's bytes.
        draft_facts = None
        if isinstance(self.proposer, DraftModelProposer):
            draft_facts = model_facts(self.proposer.model_config)
        draft_share = memory.draft_kv_share(rank_facts, draft_facts, kv_bytes)
        budget = self._kv_budget(rank_facts, kv_bytes, 1 + draft_share)
        num_blocks = memory.num_kv_blocks(rank_facts, kv_bytes, budget / (1 + draft_share))
        needed = -(-self.max_model_len // memory.BLOCK_SIZE)
        if num_blocks < needed:
            raise ValueError(
                f"KV-cache budget of {budget / 2**20:.1f} MiB ({self.kv_budget_source}) holds "
                f"{num_blocks} blocks; one sequence of max_model_len {self.max_model_len} needs "
                f"{needed}: pass a smaller --max-model-len or a larger --kv-cache-memory"
            )
        return num_blocks

    def _kv_budget(self, facts: memory.ModelFacts, kv_bytes: int, kv_scale: float = 1.0) -> float:
        """Bytes for the pool, with where they come from in `kv_budget_source` (logged);
        `kv_scale`: bytes per token as a multiple of `facts`' (a draft model's cache too)."""
        utilization = self.config.gpu_memory_utilization
        total = None
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
        if self.config.kv_cache_memory is not None:
            self._check_kv_cache_memory(self.config.kv_cache_memory, total)
            self.kv_budget_source = "--kv-cache-memory"
            return self.config.kv_cache_memory
        if total is not None:
            self.kv_budget_source = f"{utilization:g} of {memory.gib(total):.1f} GiB GPU memory"
            return memory.kv_budget_bytes(total, utilization, self.weight_bytes)
        if self.usable_memory is None:
            raise ValueError(
                "cannot tell how much memory this process may use (no cgroup memory limit, no "
                "MemAvailable in /proc/meminfo): pass --kv-cache-memory BYTES"
            )
        tokens = -(-self.max_model_len // memory.BLOCK_SIZE) * memory.BLOCK_SIZE
        demand = memory.kv_cache_bytes(facts, kv_bytes, tokens, self.config.max_num_seqs)
        demand = int(demand * kv_scale)
        budget = memory.host_kv_budget_bytes(
            self.usable_memory, utilization, self.weight_bytes, demand
        )
        usable = f"{utilization:g} of {memory.gib(self.usable_memory):.1f} GiB usable memory"
        self.kv_budget_source = (
            f"max_num_seqs x max_model_len, under {usable}"
            if budget >= demand
            else f"{usable}, less weights and overhead"
        )
        return budget

    def _check_kv_cache_memory(self, requested: int, gpu_total: int | None) -> None:
        """A --kv-cache-memory larger than the device can hold beside the weights fails here,
        saying so, not as an allocator error naming no flag (CPU) or a CUDA OOM."""
        if gpu_total is not None:
            where = f"GPU {self.device} memory"
            capacity: float | None = gpu_total
        else:
            where, capacity = "the memory this process may use", self.usable_memory
        if capacity is None:
            return  # nothing to check against (no cgroup limit, no MemAvailable)
        error = memory.kv_cache_memory_error(requested, capacity, self.weight_bytes, where)
        if error is not None:
            raise ValueError(error)

    # -- requests (any thread) --------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        return self.add_requests([(prompt, params, request_id or uuid.uuid4().hex)])[0]

    def add_requests(self, requests: Collection[NewRequest]) -> list[str]:
        """Add several requests at once, all or none. A request whose prompt equals an earlier
        one's in the same call (n > 1 choices of one prompt) waits until that one's prompt is in
        the cache, then reads it from there rather than computing it again."""
        seqs = [self._make_sequence(prompt, params, rid) for prompt, params, rid in requests]
        leaders: dict[tuple[int, ...], str] = {}
        entries: list[tuple[Sequence, str | None]] = []
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
            for entry in to_compile:
                self._compiling[entry[0].request_id] = entry
        # A grammar compiles off the step (as vLLM's WAITING_FOR_FSM): its sequence joins the
        # inbox once compiled, so other sequences never wait for it.
        for waiting, _ in to_compile:
            self._compile_grammar(waiting)
        return ids

    def _compile_grammar(self, seq: Sequence) -> None:
        assert seq.params.grammar is not None
        future = self.grammar_compiler.compile(seq.params.grammar)
        future.add_done_callback(lambda done: self._on_grammar_compiled(seq, done))

    def _make_sequence(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> Sequence:
        if not prompt:
            raise ValueError("prompt is empty")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_token_ids(token_ids, params, self.model_config.vocab_size)
        if len(token_ids) + 1 > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, max_model_len is {self.max_model_len}"
            )
        return Sequence(request_id, token_ids, params)

    def _is_known(self, request_id: str) -> bool:
        return (
            request_id in self._states
            or request_id in self._compiling
            or any(s.request_id == request_id for s, _ in self._inbox)
        )

    def _on_grammar_compiled(self, seq: Sequence, future: Future[LLMatcher]) -> None:
        """On a compile thread (or at once, for a cached grammar): the sequence joins the inbox
        with its own matcher, or finished as aborted when the grammar does not compile."""
        error = future.exception()
        if error is None:
            seq.grammar = new_matcher(future.result())
        else:  # the server compiles before it submits, so only direct engine users get here
            log.warning("request %s: grammar does not compile: %s", seq.request_id, error)
            seq.finish("abort")
        with self._lock:
            waiting = self._compiling.pop(seq.request_id, None)
            if waiting is None:
                return  # aborted meanwhile
            self._inbox.append(waiting)
        self.on_work()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts or self._states or self._compiling)

    def has_steppable_work(self) -> bool:
        """Unfinished requests that a step can advance (not those whose grammar compiles)."""
        with self._lock:
            return bool(self._inbox or self._aborts or self._states)

    def stats(self) -> EngineStats:
        with self._lock:
            snapshot = self._snapshot
            num_waiting = snapshot.num_waiting + len(self._inbox) + len(self._compiling)
            return replace(snapshot, num_waiting=num_waiting)

    def _make_stats(self, num_step_tokens: int = 0) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_total_blocks=bm.num_total_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage(),
            prefix_cache_queries=bm.num_queried_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_step_tokens=num_step_tokens,
            spec_decode_drafts=self.spec_decode.drafts,
            spec_decode_draft_tokens=self.spec_decode.draft_tokens,
            spec_decode_accepted_tokens=self.spec_decode.accepted_tokens,
        )

    # -- the step loop (one thread) ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        if self.proposer is not None:
            self._propose(self.proposer)
        batch = self.scheduler.schedule()
        if self.proposer is not None:
            for seq in batch.preempted:  # its blocks are gone: a draft's KV with them
                self.proposer.release(seq.request_id)
        num_step_tokens = sum(item.num_new_tokens for item in batch.scheduled)
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
                if item.num_draft_tokens:
                    self._count_drafts(item, len(tokens) - 1)
            if self.proposer is not None:
                self._measure_for_governor(
                    batch.scheduled, result.samples, num_step_tokens, done - started
                )
        if self._followers:
            outputs += self._release_followers()
        with self._lock:
            self._snapshot = self._make_stats(num_step_tokens)
        return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
            compiling = [self._compiling.pop(r)[0] for r in aborts if r in self._compiling]
        outputs: list[RequestOutput] = []
        for seq in compiling:
            seq.finish("abort")
            outputs.append(make_output(RequestState(seq), is_finished=True))
        for seq, leader in inbox:
            if seq.is_finished:  # its grammar did not compile
                outputs.append(make_output(RequestState(seq), is_finished=True))
            elif leader is not None and leader in self._states:
                self._states[seq.request_id] = RequestState(seq)
                self._followers.setdefault(leader, []).append(seq)
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

    def _release_followers(self) -> list[RequestOutput]:
        """Followers whose leader has its first token (so its prompt blocks are cached), or is
        gone (aborted, finished), queue up: first in line, as they arrived with it."""
        outputs: list[RequestOutput] = []
        for leader_id in list(self._followers):
            leader = self._states.get(leader_id)
            if leader is not None and leader.seq.num_output_tokens == 0:
                continue
            for seq in reversed(self._followers.pop(leader_id)):
                if not seq.is_finished:  # an aborted follower is already answered
                    outputs += self._schedule(seq, at_front=True)
        return outputs

    def _propose(self, proposer: speculative.Proposer) -> None:
        """This step's proposals (speculative decoding), or a draft model's placeholders, for
        each decoding sequence that may have some. The last step's are spent (accepted,
        rejected or not scheduled) and cleared where they were made, so a step without
        proposals, the usual one where they do not pay, costs no work per sequence beyond
        counting the decoding ones."""
        for seq in self._drafted:
            seq.draft_token_ids = []
        self._drafted = []
        config = self.speculative
        assert config is not None
        able = [seq for seq in self.scheduler.running if speculative.can_speculate(seq)]
        # Proposals only where they have measured faster (spec_governor); its epochs count the
        # steps in which some sequence could propose, not idle ones or prefills.
        if not able or not self.governor.pays(len(able)):
            return
        for seq in able:
            budget = speculative.draft_budget(seq, config, self.max_model_len)
            if budget:
                seq.draft_token_ids = proposer.reserve(seq, budget)
                self._drafted.append(seq)

    def _measure_for_governor(
        self,
        scheduled: list[ScheduledSequence],
        samples: list[tuple[ScheduledSequence, list[int], list[dict[int, float] | None]]],
        num_step_tokens: int,
        seconds: float,
    ) -> None:
        """The tokens a step of decodes gave out and its time, for the governor's rates (a
        step with a prefill chunk measures the prompt, not the proposals). Each scheduled
        sequence brings at least one known token, so the step is all decodes when it ran one
        token per sequence besides the proposals."""
        num_drafts = sum(item.num_draft_tokens for item in scheduled) if self._drafted else 0
        if num_step_tokens != len(scheduled) + num_drafts:
            return
        tokens = sum(len(tokens) for _, tokens, _ in samples) if num_drafts else len(samples)
        self.governor.on_step(tokens, seconds, num_drafts > 0, len(scheduled))

    def _count_drafts(self, item: ScheduledSequence, num_accepted: int) -> None:
        """The accepted proposals' KV counts from here, the rejected ones' slots are freed, and
        the acceptance counters (vLLM's spec_decode metrics) move."""
        self.scheduler.accept_drafts(item, num_accepted)
        assert self.speculative is not None
        seq = item.seq
        seq.draft_pace = speculative.pace(
            seq.draft_pace, self.speculative.num_speculative_tokens, item.num_draft_tokens,
            num_accepted,
        )  # fmt: skip
        self.spec_decode.drafts += 1
        self.spec_decode.draft_tokens += item.num_draft_tokens
        self.spec_decode.accepted_tokens += num_accepted

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
            reason = self._grammar_end(seq)
        return reason

    def _grammar_end(self, seq: Sequence) -> str:
        """`stop`, or `abort` if the matcher refused a token (the mask makes that a bug)."""
        if seq.grammar is not None and seq.grammar.is_error():
            log.error(
                "request %s: grammar matcher failed: %s", seq.request_id, seq.grammar.get_error()
            )
            return "abort"
        return "stop"

    def _finish(self, state: RequestState, reason: str) -> RequestOutput:
        self.scheduler.finish(state.seq, reason)
        self.runner.release(state.seq.request_id)
        if self.proposer is not None:
            self.proposer.release(state.seq.request_id)
        del self._states[state.seq.request_id]
        return make_output(state, is_finished=True)
