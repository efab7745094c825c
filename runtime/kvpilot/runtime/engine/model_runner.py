"""Runs the model on a scheduled batch: flat token layout, slot mapping, block tables, sampling."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from kvpilot.contract.checkpoint_quant import (
    check_prequantized_parallel,
    resolve_quantization,
)
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine import speculative
from kvpilot.runtime.engine.lora_slots import LoraRequest
from kvpilot.runtime.engine.parallel import TPGroup, row_parallel_inputs
from kvpilot.runtime.engine.sampling import PromptLogprob
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.layers import kv_cache
from kvpilot.runtime.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedDecodes,
    PrefillSpan,
    chunk_mask,
    decode_mask,
)
from kvpilot.runtime.layers.flashinfer_attention import FlashInferAttention
from kvpilot.runtime.layers.grammar_mask import GrammarMasker
from kvpilot.runtime.layers.lora import LoraBatch
from kvpilot.runtime.layers.sampler import SamplingRow, sample, score_tokens
from kvpilot.runtime.models.llama import KVCache, LlamaModel
from kvpilot.runtime.models.loader import ModelConfig, open_weights

# How decodes are cut into attention groups. On a CPU the gather and the attention are
# memory-bound, so a group's gathered keys and values (padding included) should stay in a core's
# L2 cache until attention reads them back. For 56 tiny-llama decodes of 40-768 tokens that is
# ~20% faster than groups of 16 sequences and 5x faster than one padded batch. On CUDA the cost
# is launches, so groups stay as they were: 16 sequences, any length.
CPU_DECODE_GROUP_BYTES = 1 << 20
CUDA_DECODE_GROUP_SEQS = 16
PROMPT_LOGITS_ROWS = 256  # prompt positions scored per logits matrix (prompt_logprobs)


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    group: TPGroup | None = None,
    int8_kernel: str = "w8a16",
) -> LlamaModel:
    """The model, or this rank's shard of it: every rank reads the checkpoint, keeps its part.
    `int8_kernel`: the int8 level's matmul, resolved (quant.resolve_int8_kernel). A
    pre-quantised checkpoint keeps its own quantisation (checkpoint_quant.resolve_quantization)."""
    quantization = resolve_quantization(quantization, cfg.checkpoint_quant)
    size = group.size if group is not None else 1
    check_prequantized_parallel(cfg.checkpoint_quant, size, row_parallel_inputs(cfg))
    with open_weights(model_dir) as read:
        try:
            return LlamaModel(cfg, read, quantization, dtype, device, group, int8_kernel)
        except ValueError as error:
            raise ValueError(f"{model_dir}: {error}") from error


def slot_ids(block_table: list[int], first: int, end: int) -> list[int]:
    """Cache slots (block_id * BLOCK_SIZE + offset) of positions [first, end), a block at a time
    rather than a token at a time: a 2k-token prefill is 128 ranges, not 2048 divisions."""
    slots: list[int] = []
    for index in range(first // BLOCK_SIZE, -(-end // BLOCK_SIZE)):
        block_start = index * BLOCK_SIZE
        base = block_table[index] * BLOCK_SIZE - block_start
        slots += range(base + max(first, block_start), base + min(end, block_start + BLOCK_SIZE))
    return slots


def is_decode(item: ScheduledSequence) -> bool:
    """One known token to run (the last), with the proposals after it if any: each of its rows
    attends as a decode does, so they batch with the other decodes."""
    return item.num_new_tokens - item.num_draft_tokens == 1


def batch_layout(batch: list[ScheduledSequence]) -> list[ScheduledSequence]:
    """The order of the chunks in the flat token batch: decodes first, by context length (their
    rows, proposals included, are sorted again in `decode_rows`), then the prefill chunks by
    LoRA slot (the base model's first, else in batch order): one adapter's chunks side by side
    make one run of rows, which its LoRA delta multiplies as a slice, without a gather and a
    scatter (layers/lora_groups.slot_runs). Everything after reads the rows in this order: the
    sampled rows are mapped back to batch order (`StepPlan.sample_rows`)."""
    decodes = [item for item in batch if is_decode(item)]
    decodes.sort(key=lambda item: item.seq.num_computed_tokens)
    prefills = [item for item in batch if not is_decode(item)]
    prefills.sort(key=lambda item: item.seq.lora_slot)
    return decodes + prefills


def decode_rows(decodes: list[ScheduledSequence]) -> list[tuple[ScheduledSequence, int]]:
    """(item, offset) per decode row, sorted by context length so that each attention group
    owns consecutive rows. Offset 0 is the item's last known token; offset i > 0 its i-th
    proposal, which attends to the context and the proposals before it (a causal chunk as
    rows of a decode batch, each with its own length)."""
    rows = [(item, offset) for item in decodes for offset in range(item.num_new_tokens)]
    rows.sort(key=lambda row: row[0].seq.num_computed_tokens + row[1])
    return rows


@dataclass(frozen=True)
class PrefillPlan:
    start: int  # first row of this chunk in the flat token batch
    num_tokens: int
    num_computed: int  # tokens already in the cache before this chunk
    block_table: list[int]


@dataclass(frozen=True)
class StepPlan:
    """One step's model inputs as plain ints. Rank 0 builds it from the scheduled batch and sends
    it to the other ranks; each rank turns it into tensors (and masks) on its own device."""

    input_ids: list[int]  # [T] flat, rows in `batch_layout` order
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T] cache slot of each row's key and value
    decode_block_tables: list[list[int]]  # [B] the decodes' tables, rows 0..B-1
    decode_context_lens: list[int]  # [B] tokens each decode attends to, its own included
    prefills: list[PrefillPlan]
    sample_rows: list[int]  # [S] rows whose output is sampled, in batch order
    # [P] rows whose logits score the next prompt token (prompt logprobs), and per sequence that
    # has any: (request id, first prompt position scored, number of rows), in row order.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[str, int, int]] = field(default_factory=list)
    # [T] each row's LoRA slot (-1: the base model); empty when no row runs an adapter.
    lora_slots: list[int] = field(default_factory=list)


def plan_lora_slots(
    rows: list[tuple[ScheduledSequence, int]], prefills: list[ScheduledSequence]
) -> list[int]:
    """[T] the slot of each row's sequence, decode rows then prefill chunks (plan_step's order);
    empty when every sequence runs the base model."""
    slots = [item.seq.lora_slot for item, _ in rows]
    for item in prefills:
        slots += [item.seq.lora_slot] * item.num_new_tokens
    return slots if any(slot >= 0 for slot in slots) else []


def plan_step(batch: list[ScheduledSequence]) -> StepPlan:
    """Flatten the scheduled chunks into one token batch and describe where their KV lives."""
    layout = batch_layout(batch)
    decodes = [item for item in layout if is_decode(item)]
    rows = decode_rows(decodes)
    input_ids = [
        item.seq.token_ids[item.seq.num_computed_tokens] if offset == 0
        else item.draft_token_ids[offset - 1]
        for item, offset in rows
    ]  # fmt: skip
    positions = [item.seq.num_computed_tokens + offset for item, offset in rows]
    slots = [
        item.seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for (item, _), p in zip(rows, positions, strict=True)
    ]
    context_lens = [p + 1 for p in positions]
    row_of = {(item.seq, offset): index for index, (item, offset) in enumerate(rows)}
    last_rows: dict[Sequence, int] = {}
    prefills: list[PrefillPlan] = []
    for item in layout[len(decodes) :]:
        seq, start, first = item.seq, len(input_ids), item.seq.num_computed_tokens
        end = first + item.num_new_tokens
        input_ids += seq.token_ids[first:end]
        positions += range(first, end)
        slots += slot_ids(seq.block_table, first, end)
        last_rows[seq] = start + item.num_new_tokens - 1
        prefills.append(PrefillPlan(start, item.num_new_tokens, first, list(seq.block_table)))
    prompt_rows, prompt_spans = plan_prompt_rows(layout)
    return StepPlan(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        decode_block_tables=[
            item.seq.block_table[: -(-length // BLOCK_SIZE)]
            for (item, _), length in zip(rows, context_lens, strict=True)
        ],
        decode_context_lens=context_lens,
        prefills=prefills,
        sample_rows=[
            row
            for item in batch
            if item.is_sampling
            for row in (
                [row_of[(item.seq, i)] for i in range(item.num_new_tokens)]
                if is_decode(item)
                else [last_rows[item.seq]]
            )
        ],
        prompt_rows=prompt_rows,
        prompt_spans=prompt_spans,
        lora_slots=plan_lora_slots(rows, layout[len(decodes) :]),
    )


def plan_prompt_rows(
    layout: list[ScheduledSequence],
) -> tuple[list[int], list[tuple[str, int, int]]]:
    """The rows whose logits score a prompt token not scored yet: position p scores token p + 1,
    so positions up to num_prompt_tokens - 2 (the last one's output is the first sampled token).
    A recompute after preemption scores nothing twice."""
    rows: list[int] = []
    spans: list[tuple[str, int, int]] = []
    start = 0
    for item in layout:
        seq, first = item.seq, item.seq.num_computed_tokens
        if seq.wants_prompt_logprobs:
            begin = max(first, seq.num_scored_prompt_tokens)
            end = min(first + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if end > begin:
                rows += range(start + begin - first, start + end - first)
                spans.append((seq.request_id, begin, end - begin))
        start += item.num_new_tokens
    return rows, spans


@dataclass(frozen=True)
class StepResult:
    # Per item that samples: its new tokens (one, or with proposals the accepted ones and the
    # model's token after them) and their logprobs (None each when not asked for).
    samples: list[tuple[ScheduledSequence, list[int], list[dict[int, float] | None]]]
    prompt_logprobs: dict[str, list[PromptLogprob]]  # request id -> positions scored this step


def decode_group_bounds(
    num_blocks: list[int], max_group_blocks: int, max_group_seqs: int
) -> list[tuple[int, int]]:
    """Cut decodes sorted by block count into [first, end) groups of at most max_group_seqs
    whose padded size (members x the longest member's blocks) stays within max_group_blocks;
    one long decode may go over alone."""
    bounds: list[tuple[int, int]] = []
    first = 0
    for index, blocks in enumerate(num_blocks):
        size = index - first + 1
        if index > first and (size > max_group_seqs or size * blocks > max_group_blocks):
            bounds.append((first, index))
            first = index
    if num_blocks:
        bounds.append((first, len(num_blocks)))
    return bounds


class OtherRanks(Protocol):
    """The tensor-parallel ranks beside rank 0 (worker.WorkerPool), as the runner drives them."""

    def allocate_kv_cache(
        self,
        num_blocks: int,
        kv_dtype: torch.dtype | None,
        scales: list[tuple[float, float]] | None,
    ) -> None: ...

    def execute(self, plan: StepPlan) -> None: ...

    def load_loras(self, loads: list[tuple[int, LoraRequest]]) -> None: ...


class DecodeGraphs(Protocol):
    """Decode steps replayed from CUDA graphs (engine/cuda_graphs.py, which the loader sets)."""

    def run(self, plan: StepPlan) -> torch.Tensor | None: ...


class ModelRunner:
    """Runs steps on rank 0, and on the other ranks' `workers` alongside when there are any."""

    def __init__(
        self,
        model: LlamaModel,
        device: torch.device,
        seed: int,
        workers: OtherRanks | None = None,
        eos_token_ids: tuple[int, ...] = (),
        attention_backend: str = "sdpa",
        cuda_graphs: bool = False,
    ) -> None:
        """`attention_backend`: resolved (attention.resolve_attention_backend); with `paged` the
        kernel must be loaded in this process, with `flashinfer` FlashInfer must import.
        `cuda_graphs`: decode graphs will be captured (cuda_graphs.capture_decode_graphs), so
        the pool gets a scratch block for their padding rows."""
        self.model, self.device, self.workers = model, device, workers
        self.num_scratch_blocks = 1 if cuda_graphs else 0
        self.num_kv_blocks = 0  # the blocks sequences get; a scratch block lies past them
        self.graphs: DecodeGraphs | None = None
        self.attention_backend = attention_backend
        self.flashinfer: FlashInferAttention | None = None  # with its pool (allocate_kv_cache)
        self.eos_token_ids = eos_token_ids  # masked with stop ids until a row's min_tokens
        self.kv_caches: KVCache = []
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}  # per request with its own seed
        self.decode_group_limits = self._decode_group_limits()
        self.grammar_masker = GrammarMasker(model.cfg.vocab_size, device)

    def _decode_group_limits(self) -> tuple[int, int]:
        """(max padded blocks, max sequences) per decode attention group."""
        if self.device.type == "cuda":
            return sys.maxsize, CUDA_DECODE_GROUP_SEQS
        cfg = self.model.cfg
        element_size = torch.tensor([], dtype=self.model.dtype).element_size()
        block_bytes = 2 * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * element_size  # K and V
        return max(1, CPU_DECODE_GROUP_BYTES // block_bytes), sys.maxsize

    def allocate_kv_cache(
        self,
        num_blocks: int,
        kv_dtype: torch.dtype | None = None,
        scales: list[tuple[float, float]] | None = None,
    ) -> None:
        """The pool in `kv_dtype` (default: the model dtype), with (k, v) scales per layer, of
        this rank's heads: [num_blocks, BLOCK_SIZE, H_kv / tp, D] per layer, on every rank."""
        if self.workers is not None:
            self.workers.allocate_kv_cache(num_blocks, kv_dtype, scales)
        cfg = self.model.cfg
        self.num_kv_blocks = num_blocks
        shape = (num_blocks + self.num_scratch_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        dtype = kv_dtype or self.model.dtype
        self.kv_caches = kv_cache.allocate(cfg.num_layers, shape, dtype, self.device, scales)
        if self.attention_backend == "flashinfer":  # this rank's heads under tensor parallelism
            self.flashinfer = FlashInferAttention(
                self.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.model.dtype,
                dtype, BLOCK_SIZE,
            )  # fmt: skip

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's own generator when it has a seed; None: the shared default one."""
        if seq.params.seed is None:
            return None
        if seq.request_id not in self.generators:
            generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self.generators[seq.request_id] = generator
        return self.generators[seq.request_id]

    def prepare(
        self, batch: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """`plan_step` then `inputs`, for a single process: the sample rows stay a list."""
        plan = plan_step(batch)
        input_ids, positions, meta, _ = self.inputs(plan)
        return input_ids, positions, meta, plan.sample_rows

    def inputs(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """A step's plan as tensors on this rank's device: input_ids [T], positions [T],
        attention metadata, and the rows whose output is needed [S + P]: those to sample, then
        those scoring prompt tokens."""
        ids, positions = self._tensor(plan.input_ids), self._tensor(plan.positions)
        rows = self._tensor(plan.sample_rows + plan.prompt_rows)
        return ids, positions, self._attention(plan), rows

    def _attention(self, plan: StepPlan) -> AttentionMetadata:
        """What every layer's attention reads this step, as the backend wants it."""
        meta = AttentionMetadata(slot_mapping=self._tensor(plan.slot_mapping))
        if self.flashinfer is not None:  # every row, decodes and prefill chunks, in one plan
            meta.flashinfer = self.flashinfer.plan(
                plan.decode_block_tables,
                plan.decode_context_lens,
                [(p.num_tokens, p.num_computed, p.block_table) for p in plan.prefills],
            )
            return meta
        meta.prefills = [self._prefill_span(prefill) for prefill in plan.prefills]
        if self.attention_backend == "paged":
            meta.paged_decodes = self._paged_decodes(plan)
        else:
            meta.decodes = self._decode_groups(plan.decode_block_tables, plan.decode_context_lens)
        return meta

    def _prefill_span(self, prefill: PrefillPlan) -> PrefillSpan:
        num_computed, num_tokens = prefill.num_computed, prefill.num_tokens
        block_table = self._tensor(prefill.block_table)
        span = PrefillSpan(prefill.start, num_tokens, num_computed, block_table)
        if num_computed > 0:  # a chunk over cached KV: one mask for every layer
            cfg = self.model.cfg
            num_groups = cfg.num_heads // cfg.num_kv_heads
            span.mask = chunk_mask(
                num_tokens, num_computed, num_groups, self.model.dtype, self.device
            )
        return span

    def _paged_decodes(self, plan: StepPlan) -> PagedDecodes | None:
        """The decodes' block tables as one [B, W] int32 matrix, padded with block 0 (never read:
        the kernel stops at each row's context length)."""
        tables = plan.decode_block_tables
        if not tables:
            return None
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        lens = plan.decode_context_lens
        return PagedDecodes(
            block_tables=torch.tensor(padded, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
        )

    def _decode_groups(
        self, block_tables: list[list[int]], context_lens: list[int]
    ) -> list[DecodeGroup]:
        """Decodes sorted by length and batched in groups: each group pads its block tables to
        its own longest sequence, so the gather copies far less padding than one big batch.
        The groups' block ids and masks are slices of one tensor each: a few tensor ops per
        step rather than per group."""
        if not block_tables:
            return []
        num_blocks = [len(block_table) for block_table in block_tables]
        bounds = decode_group_bounds(num_blocks, *self.decode_group_limits)
        widths = [max(num_blocks[first:end]) for first, end in bounds]
        block_ids: list[int] = []
        for (first, end), width in zip(bounds, widths, strict=True):
            for block_table in block_tables[first:end]:
                block_ids += block_table + [0] * (width - len(block_table))
        all_ids = self._tensor(block_ids)
        mask = decode_mask(self._tensor(context_lens), max(widths) * BLOCK_SIZE, self.model.dtype)
        groups, offset = [], 0
        for (first, end), width in zip(bounds, widths, strict=True):
            size = (end - first) * width
            group_mask = mask[first:end, :, :, : width * BLOCK_SIZE]
            groups.append(DecodeGroup(first, all_ids[offset : offset + size], group_mask))
            offset += size
        return groups

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def run_model(self, plan: StepPlan) -> torch.Tensor:
        """This rank's share of one step: the final hidden states of the sampled rows [S, hidden],
        the same on every rank once the layers' all-reduces are done."""
        if self.graphs is not None:
            hidden = self.graphs.run(plan)  # None: a step no graph holds
            if hidden is not None:
                return hidden
        input_ids, positions, meta, rows = self.inputs(plan)
        lora = self._lora_batch(plan)
        return self.model.forward(input_ids, positions, self.kv_caches, meta, rows, lora)

    def _lora_batch(self, plan: StepPlan) -> LoraBatch | None:
        lora = self.model.lora
        if lora is None or not plan.lora_slots:
            return None
        output_rows = plan.sample_rows + plan.prompt_rows  # as `inputs` passes them
        return LoraBatch.of_rows(plan.lora_slots, output_rows, self.device)

    def load_loras(self, loads: list[tuple[int, LoraRequest]]) -> None:
        """Copy adapters newly given a slot into the model's stacks (before the step)."""
        lora = self.model.lora
        if not loads:
            return
        if lora is None:
            raise ValueError("LoRA adapters scheduled but the model has no LoRA slots")
        for slot, request in loads:
            lora.set_slot(slot, request.adapter)
        if self.workers is not None:  # each rank copies in its own shard
            self.workers.load_loras(loads)

    def logits(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step on every rank; logits [S + P, vocab] (float32): the items that sample,
        in batch order, then the prompt rows."""
        return self.model.compute_logits(self.hidden(plan_step(batch)))

    def hidden(self, plan: StepPlan) -> torch.Tensor:
        """Run one step on every rank; the final hidden states [S + P, hidden] of the rows
        whose output is needed."""
        if self.workers is not None:
            self.workers.execute(plan)  # the other ranks run the same step alongside
        return self.run_model(plan)

    def execute(self, batch: list[ScheduledSequence]) -> StepResult:
        """Run one step: (item, next token, logprobs) for each item that samples, and the
        prompt logprobs scored in this step."""
        sampling = [item for item in batch if item.is_sampling]
        plan = plan_step(batch)
        hidden = self.hidden(plan)  # [S + P, hidden]
        num_rows = len(plan.sample_rows)  # S: with proposals, one row more per proposal
        prompt = self._prompt_logprobs(batch, plan, hidden[num_rows:])
        if not sampling:
            return StepResult([], prompt)
        logits = self.model.compute_logits(hidden[:num_rows])  # [S, vocab]
        rows = [row for item in sampling for row in self._sampling_rows(item)]
        # A sequence with a grammar proposes nothing, so it has one row.
        matchers = [item.seq.grammar for item in sampling for _ in range(item.num_draft_tokens + 1)]
        self.grammar_masker.apply(logits, matchers)
        tokens, logprobs = sample(logits, rows, self.default_generator, self.eos_token_ids)
        return StepResult(_accepted(sampling, tokens, logprobs), prompt)

    def _prompt_logprobs(
        self, batch: list[ScheduledSequence], plan: StepPlan, hidden: torch.Tensor
    ) -> dict[str, list[PromptLogprob]]:
        """hidden: [P, hidden] of the plan's prompt rows -> per request, its scored positions.
        Logits are made PROMPT_LOGITS_ROWS rows at a time: a whole 8k-token chunk's would be
        8k x vocabulary floats (5 GB at 152k)."""
        if not plan.prompt_spans:
            return {}
        seqs = {item.seq.request_id: item.seq for item in batch}
        targets: list[int] = []
        num_tops: list[int] = []
        for request_id, begin, count in plan.prompt_spans:
            seq = seqs[request_id]
            targets += seq.token_ids[begin + 1 : begin + 1 + count]
            num_tops += [seq.params.prompt_logprobs or 0] * count
        scored: list[PromptLogprob] = []
        for first in range(0, len(targets), PROMPT_LOGITS_ROWS):
            end = first + PROMPT_LOGITS_ROWS
            logits = self.model.compute_logits(hidden[first:end])  # [<= PROMPT_LOGITS_ROWS, V]
            scored += score_tokens(logits, targets[first:end], num_tops[first:end])
        result, offset = {}, 0
        for request_id, _, count in plan.prompt_spans:
            result[request_id] = scored[offset : offset + count]
            offset += count
        return result

    def _sampling_rows(self, item: ScheduledSequence) -> list[SamplingRow]:
        """One row per output position: the next token, then after each proposal the token
        that would follow it, with the proposals before it counted as output (penalties and
        min_tokens see the text as it would be)."""
        seq, drafts = item.seq, item.draft_token_ids
        generator = self._generator(seq)
        return [
            SamplingRow(
                seq.params,
                seq.token_ids + drafts[:i] if i else seq.token_ids,
                seq.num_prompt_tokens,
                generator,
            )
            for i in range(len(drafts) + 1)
        ]


def _accepted(
    sampling: list[ScheduledSequence],
    tokens: list[int],
    logprobs: list[dict[int, float] | None],
) -> list[tuple[ScheduledSequence, list[int], list[dict[int, float] | None]]]:
    """Each item's new tokens: the model's choices up to and including the first that differs
    from a proposal (all of them when every proposal was right)."""
    samples, offset = [], 0
    for item in sampling:
        if not item.num_draft_tokens:  # the common case, a row of its own
            samples.append((item, [tokens[offset]], [logprobs[offset]]))
            offset += 1
            continue
        drafts = item.draft_token_ids
        chosen = tokens[offset : offset + len(drafts) + 1]
        keep = speculative.num_accepted(drafts, chosen) + 1
        samples.append((item, chosen[:keep], logprobs[offset : offset + keep]))
        offset += len(drafts) + 1
    return samples
