"""Runs the model on a scheduled batch: flat token layout, slot mapping, block tables, sampling."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpilot.runtime.layers.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from kvpilot.runtime.layers.sampler import sample
from kvpilot.runtime.loader import ModelConfig, iter_weights
from kvpilot.runtime.memory import BLOCK_SIZE
from kvpilot.runtime.models.llama import KVCache, LlamaModel
from kvpilot.runtime.scheduler import ScheduledSequence

DECODE_GROUP_SIZE = 16  # decodes per attention batch


def load_model(
    model_dir: Path, cfg: ModelConfig, quantization: str, dtype: torch.dtype, device: torch.device
) -> LlamaModel:
    tensors = dict(iter_weights(model_dir))

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"checkpoint in {model_dir} is missing tensor {name!r}")
        return tensors[name]

    return LlamaModel(cfg, get, quantization, dtype, device)


class ModelRunner:
    def __init__(self, model: LlamaModel, device: torch.device, seed: int) -> None:
        self.model, self.device = model, device
        self.kv_caches: KVCache = []
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}  # per request with its own seed

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model.cfg
        shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.model.dtype, device=self.device),
                torch.zeros(shape, dtype=self.model.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, item: ScheduledSequence) -> torch.Generator:
        seq = item.seq
        if seq.params.seed is None:
            return self.default_generator
        if seq.request_id not in self.generators:
            generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self.generators[seq.request_id] = generator
        return self.generators[seq.request_id]

    def prepare(
        self, batch: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks into one token batch and describe where KV lives."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_seqs: list[ScheduledSequence] = []
        prefills: list[PrefillSpan] = []
        sample_rows: list[int] = []
        for item in batch:
            seq, start, first = item.seq, len(input_ids), item.seq.num_computed_tokens
            span = range(first, first + item.num_new_tokens)
            input_ids += seq.token_ids[span.start : span.stop]
            positions += span
            slots += [seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
            if item.num_new_tokens == 1:
                decode_rows.append(start)
                decode_seqs.append(item)
            else:
                table = torch.tensor(seq.block_table, dtype=torch.long, device=self.device)
                prefills.append(PrefillSpan(start, item.num_new_tokens, first, table))
            if item.is_sampling:
                sample_rows.append(start + item.num_new_tokens - 1)
        meta = self._metadata(slots, decode_rows, decode_seqs, prefills)
        return self._tensor(input_ids), self._tensor(positions), meta, sample_rows

    def _metadata(
        self,
        slots: list[int],
        decode_rows: list[int],
        decode_seqs: list[ScheduledSequence],
        prefills: list[PrefillSpan],
    ) -> AttentionMetadata:
        # Decodes sorted by length and batched in groups: each group pads its block tables to
        # its own longest sequence, so the gather copies far less padding than one big batch.
        order = sorted(range(len(decode_seqs)), key=lambda i: len(decode_seqs[i].seq.block_table))
        groups = [
            self._decode_group([decode_rows[i] for i in part], [decode_seqs[i] for i in part])
            for part in (
                order[k : k + DECODE_GROUP_SIZE] for k in range(0, len(order), DECODE_GROUP_SIZE)
            )
        ]
        return AttentionMetadata(
            slot_mapping=self._tensor(slots), decodes=groups, prefills=prefills
        )

    def _decode_group(self, rows: list[int], items: list[ScheduledSequence]) -> DecodeGroup:
        max_blocks = max(len(d.seq.block_table) for d in items)
        tables = [d.seq.block_table + [0] * (max_blocks - len(d.seq.block_table)) for d in items]
        lengths = [d.seq.num_computed_tokens + 1 for d in items]
        return DecodeGroup(self._tensor(rows), self._tensor(tables), self._tensor(lengths))

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def execute(
        self, batch: list[ScheduledSequence]
    ) -> list[tuple[ScheduledSequence, int, dict[int, float] | None]]:
        """Run one step; returns (item, next token, logprobs) for each item that samples."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        sampling = [item for item in batch if item.is_sampling]
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows)])  # [S, vocab]
        generators: list[torch.Generator | None] = [self._generator(i) for i in sampling]
        tokens, logprobs = sample(logits, [i.seq.params for i in sampling], generators)
        return list(zip(sampling, tokens, logprobs, strict=True))
