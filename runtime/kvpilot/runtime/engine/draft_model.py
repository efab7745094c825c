"""Speculative decoding with a draft model (vLLM's `draft_model` method): a small model with the
served model's tokenizer proposes k tokens a step, greedily, and the served model checks them in
its one forward pass, as it checks prompt-lookup proposals (engine/speculative.py).

The draft keeps its own KV cache with the same number of blocks as the served model's and reads
it through the same block tables, so no block bookkeeping of its own: a sequence's slots hold
the served model's KV in one pool and the draft's in the other. `_computed` says how many of a
sequence's positions hold valid draft KV. Each step, after scheduling (the scheduler has given a
proposing sequence slots for its proposals), for each sequence that proposes this step, the
draft:

1. runs the sequence's tokens from as far as its own KV goes to the last known token (the whole
   prompt the first time; after that the tokens accepted since its last proposals, or all since
   it last proposed), and takes its greedy next token as the first proposal;
2. runs k - 1 more one-token steps over its own proposals, writing their KV into the slots the
   scheduler reserved (past the known tokens, so nothing the served model reads).

A sequence that does not propose in a step (its pace, the governor) costs the draft nothing.

Only the known tokens count as computed afterwards; proposals the served model keeps are run
again next time (a few rows of a small model). A preempted sequence is forgotten (`release`:
its blocks went back to the pool).

Prefix-cache hits carry the draft's KV too. A full block the served model has hashed is named by
its content (the hash chains every token before it), so the draft remembers, per block, the hash
of the content it wrote there (`_written`). A sequence the draft has not seen (new, a prefix hit,
or back after preemption) starts after its leading blocks whose current hash is the one
remembered: same tokens, same KV. An evicted block loses its hash when it is reused, and gets
another when its new content is hashed, so a block of other content never matches; a block the
draft writes into for content not hashed yet (a sequence's last block, its proposals' blocks)
is forgotten until that content is hashed, so slots written since can never pass for it.

Greedy proposals are a one-hot q, so the served model's keep-while-the-draw-agrees rule is
speculative sampling's rejection rule for sampled requests as well (engine/speculative.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.contract.speculative_config import SpeculativeConfig
from kvpilot.runtime.engine.block_manager import NO_HASH, BlockManager
from kvpilot.runtime.engine.model_runner import ModelRunner, load_model
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.layers import flashinfer_attention
from kvpilot.runtime.models.loader import ModelConfig, load_model_config
from kvpilot.runtime.models.tokenizer_files import Tokenizer

PLACEHOLDER = 0  # a reserved proposal slot between scheduling and the draft's run
GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0)


def check_draft(
    draft_dir: Path,
    draft: ModelConfig,
    draft_vocab: dict[str, int],
    target: ModelConfig,
    target_vocab: dict[str, int],
) -> None:
    """ValueError, in one line, when the draft cannot propose for the served model."""
    if draft_vocab != target_vocab:
        raise ValueError(
            f"draft model {draft_dir} has another tokenizer than the served model "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, or different ids): a draft "
            "model must share the served model's tokenizer"
        )
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir} has {draft.vocab_size} output rows, more than the served "
            f"model's {target.vocab_size}: it could propose ids the served model cannot read"
        )


def check_draft_files(draft_dir: Path, target_dir: Path) -> ModelConfig:
    """The draft's config, once its files say it can propose for the served model's (configs
    and tokenizers only, no weights: the server checks this before it starts)."""
    draft = load_model_config(draft_dir)
    draft_vocab = Tokenizer(draft_dir).hf.get_vocab()
    target_vocab = Tokenizer(target_dir).hf.get_vocab()
    check_draft(draft_dir, draft, draft_vocab, load_model_config(target_dir), target_vocab)
    return draft


def check_before_start(speculative: SpeculativeConfig | None, served_model: str) -> None:
    """A draft model that cannot propose for the served model stops the server before it
    starts, in one line (the engine checks again as it loads, for a model fetched then)."""
    if speculative is None or speculative.model is None:
        return
    if Path(served_model).is_dir():
        check_draft_files(Path(speculative.model), Path(served_model))
    else:
        load_model_config(Path(speculative.model))  # the draft's own files, at least


def check_draft_positions(draft_dir: Path, draft: ModelConfig, max_model_len: int) -> None:
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"draft model {draft_dir} handles {draft.max_position_embeddings} positions, fewer "
            f"than --max-model-len {max_model_len}: pass a smaller --max-model-len"
        )


class DraftModelProposer:
    """Proposals from a draft model, run after scheduling (see the module's docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model_config = runner.model.cfg
        self._computed: dict[str, int] = {}  # request id -> positions with valid draft KV
        # The served model's blocks (the engine sets it): their hashes say what a block holds.
        self.blocks: BlockManager | None = None
        self._written: dict[int, int] = {}  # block id -> hash of the content of its draft KV
        self._recorded: dict[str, int] = {}  # request id -> its leading blocks in `_written`
        self.num_reused_tokens = 0  # positions a sequence's first run took from cached blocks

    def reserve(self, seq: Sequence, budget: int) -> list[int]:
        """Before scheduling: `budget` placeholders, so the scheduler gives the proposals slots."""
        return [PLACEHOLDER] * budget

    def fill(self, scheduled: list[ScheduledSequence]) -> None:
        """After scheduling: run the draft and put its proposals in place of the placeholders."""
        batch = [self._catch_up(item) for item in scheduled if item.num_draft_tokens]
        views = {item.seq.request_id: item.seq for item in batch}
        wanted = {item.seq.request_id: item.num_draft_tokens for item in scheduled}
        proposals: dict[str, list[int]] = {request_id: [] for request_id in views}
        while batch:
            for item, tokens, _ in self.runner.execute(batch).samples:
                proposals[item.seq.request_id].append(tokens[0])
            batch = self._next_round(batch, views, proposals, wanted)
        for item in scheduled:
            if item.num_draft_tokens:
                item.seq.draft_token_ids = proposals[item.seq.request_id]

    def _catch_up(self, item: ScheduledSequence) -> ScheduledSequence:
        """The draft's first run of a proposing sequence this step: from as far as its own KV
        goes up to the last known token (its proposals follow in the slots after it)."""
        seq = item.seq
        known = self._computed.get(seq.request_id)
        if known is None:
            known = self._cached_tokens(seq.block_table)
            self.num_reused_tokens += min(known, seq.num_computed_tokens)
        start = min(known, seq.num_computed_tokens)
        self._computed[seq.request_id] = seq.num_tokens
        for block_id in seq.block_table[start // BLOCK_SIZE :]:  # this step writes there
            self._written.pop(block_id, None)
        self._record(seq.request_id, seq.block_table, seq.num_tokens)
        token_ids = list(seq.token_ids)  # the proposals are appended to the draft's view
        view = Sequence(
            seq.request_id, token_ids, GREEDY, num_prompt_tokens=seq.num_prompt_tokens,
            num_computed_tokens=start, block_table=seq.block_table,
        )  # fmt: skip
        return ScheduledSequence(view, seq.num_tokens - start)

    def _cached_tokens(self, block_table: list[int]) -> int:
        """Positions at the start of `block_table` whose draft KV is in place (whole blocks)."""
        count = 0
        for block_id in block_table:
            content = self._hash(block_id)
            if content == NO_HASH or self._written.get(block_id) != content:
                break
            count += 1
        return count * BLOCK_SIZE

    def _record(self, request_id: str, block_table: list[int], num_tokens: int) -> None:
        """Remember the blocks this run leaves full of draft KV for hashed content. Once per
        block: a sequence's next runs go on from the first block not hashed yet."""
        index = self._recorded.get(request_id, 0)
        while index < min(num_tokens // BLOCK_SIZE, len(block_table)):
            content = self._hash(block_table[index])
            if content == NO_HASH:
                break
            self._written[block_table[index]] = content
            index += 1
        self._recorded[request_id] = index

    def _hash(self, block_id: int) -> int:
        return NO_HASH if self.blocks is None else self.blocks.blocks[block_id].hash

    @staticmethod
    def _next_round(
        batch: list[ScheduledSequence],
        views: dict[str, Sequence],
        proposals: dict[str, list[int]],
        wanted: dict[str, int],
    ) -> list[ScheduledSequence]:
        """One-token steps over the last proposal, for the sequences that want more."""
        following = []
        for item in batch:
            request_id = item.seq.request_id
            made = proposals[request_id]
            if not made or len(made) >= wanted[request_id]:
                continue
            view = views[request_id]
            view.num_computed_tokens = view.num_tokens
            view.token_ids.append(made[-1])
            following.append(ScheduledSequence(view, 1))
        return following

    def release(self, request_id: str) -> None:
        """The sequence finished or lost its blocks (preempted): what its blocks hold stays
        in `_written` for the next sequence (or this one, back) that hits them."""
        self._computed.pop(request_id, None)
        self._recorded.pop(request_id, None)


def load_draft(
    draft_dir: Path,
    target_dir: Path,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    attention_backend: str,
    kv_dtype: torch.dtype,
) -> DraftModelProposer:
    """The draft model loaded beside the served one (its KV cache, in `kv_dtype`, comes with the
    pool's size)."""
    draft = check_draft_files(draft_dir, target_dir)
    check_draft_positions(draft_dir, draft, max_model_len)
    model = load_model(draft_dir, draft, "none", dtype, device)
    if attention_backend == "flashinfer" and flashinfer_attention.unavailable_reason(
        device, dtype, draft.head_dim, kv_dtype
    ):  # the draft's heads may be a size FlashInfer has no kernel for
        attention_backend = "sdpa"
    return DraftModelProposer(ModelRunner(model, device, seed, None, (), attention_backend))
