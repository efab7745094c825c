"""One step's logits [S, V] -> the next token of every sequence (and logprobs), batched.

The order is vLLM's: logit bias and min_tokens (EOS and stop ids masked) -> presence, frequency
and repetition penalties -> greedy rows take the argmax; the others go through temperature ->
min-p -> top-k -> top-p -> one draw. Each parameter becomes a per-step tensor over the rows that
use it, so a step costs a handful of tensor ops however many sequences it holds; Python only
walks the rows to gather their parameters. A batch of plain greedy rows skips all of it: one
max and one device sync, as before.

The draw is the exponential race: argmax(p / q) with q ~ Exp(1) per token picks token i with
probability p_i. A seeded request fills its own row of q from its own generator, so its tokens do
not depend on which other sequences share its steps.

Logprobs are those of the model's raw distribution, before any of the above (vLLM's default).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpilot.runtime.engine.sampling import PromptLogprob, SamplingParams

# Top-p first looks at this many of a row's most likely tokens (see apply_top_k_top_p).
TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one sequence in this step."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (read, not copied)
    num_prompt_tokens: int
    generator: torch.Generator | None = None  # the request's own (seeded); None: the shared one

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def banned_ids(self, eos_token_ids: Sequence[int]) -> set[int]:
        """Token ids that would end the sequence before min_tokens: masked until then."""
        params = self.params
        if self.num_output_tokens >= params.min_tokens:
            return set()
        eos = () if params.ignore_eos else eos_token_ids
        return {*params.stop_token_ids, *eos}


def is_plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return params.is_greedy and not (
        params.logit_bias or params.has_penalties or row.num_output_tokens < params.min_tokens
    )


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator | None = None,
    eos_token_ids: Sequence[int] = (),
) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits: [S, V] float32 -> one token per row, and the top-N logprobs where asked for.
    `generator` draws for the rows without their own."""
    if all(is_plain_greedy(row) for row in rows):
        # max() gives the first maximal index, as argmax does, and is 3x faster on CPU.
        chosen = logits.max(-1).indices
    else:
        chosen = sample_tensor(logits, rows, generator, eos_token_ids)
    tokens: list[int] = chosen.tolist()  # the step's one device sync
    return tokens, logprobs_of(logits, tokens, [row.params.logprobs for row in rows])


def sample_tensor(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator | None,
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """[S, V] -> [S] token ids, without a device sync."""
    if any(
        row.params.logit_bias or row.params.has_penalties or row.banned_ids(eos_token_ids)
        for row in rows
    ):
        logits = logits.clone()  # the processors work in place; logprobs read the raw logits
        apply_logit_bias_(logits, rows)
        apply_min_tokens_(logits, rows, eos_token_ids)
        apply_penalties_(logits, rows)
    chosen = logits.max(-1).indices  # [S]: right for the greedy rows
    drawn = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if drawn:
        index = _long(drawn, logits.device)
        params = [rows[i].params for i in drawn]
        generators = [rows[i].generator for i in drawn]
        chosen = chosen.index_copy(0, index, draw(logits[index], params, generators, generator))
    return chosen


# -- logits processors, in place on [S, V] logits; each does nothing when no row asks ------------


def apply_logit_bias_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    entries = [(i, t, bias) for i, row in enumerate(rows) for t, bias in row.params.logit_bias]
    if not entries:
        return
    row_ids, token_ids, biases = zip(*entries, strict=True)
    device = logits.device
    index = (_long(list(row_ids), device), _long(list(token_ids), device))
    values = torch.tensor(biases, dtype=logits.dtype, device=device)
    logits.index_put_(index, values, accumulate=True)


def apply_min_tokens_(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int]
) -> None:
    entries = [(i, token) for i, row in enumerate(rows) for token in row.banned_ids(eos_token_ids)]
    if not entries:
        return
    row_ids, token_ids = zip(*entries, strict=True)
    index = (_long(list(row_ids), logits.device), _long(list(token_ids), logits.device))
    touched = _long(sorted(set(row_ids)), logits.device)
    before = logits[touched]  # a copy, [R, V]
    logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
    # A row left with no token at all had only ending tokens allowed (by its grammar, which can
    # only end here): the grammar wins over min_tokens and the row keeps them, rather than
    # drawing from nothing.
    after = logits[touched]
    is_dead = torch.isneginf(after).all(-1, keepdim=True)
    logits[touched] = torch.where(is_dead, before, after)


def apply_penalties_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's penalties on the rows that have any: repetition divides a positive logit (and
    multiplies a negative one) of every token seen in the prompt or output; frequency subtracts
    per occurrence in the output, presence once per token present in it. Only the (row, token)
    entries of tokens that occurred are touched: the work follows the context lengths, not
    rows x vocabulary."""
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return
    device, vocab_size = logits.device, logits.shape[-1]
    flat = logits.view(-1)  # entry (row, token) at row * V + token
    per_row = {
        name: _per_row(rows, penalised, name, device)
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
    }
    if any(rows[i].params.repetition_penalty != 1.0 for i in penalised):
        seen, _ = occurrences([rows[i].token_ids for i in penalised], penalised, vocab_size, device)
        factor = per_row["repetition_penalty"][seen // vocab_size]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    outputs = [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in penalised]
    keys, counts = occurrences(outputs, penalised, vocab_size, device)
    row_of = keys // vocab_size
    flat[keys] -= per_row["frequency_penalty"][row_of] * counts
    flat[keys] -= per_row["presence_penalty"][row_of]


def _per_row(
    rows: list[SamplingRow], penalised: list[int], name: str, device: torch.device
) -> torch.Tensor:
    """[S]: the penalty `name` of each penalised row (the others' are never read)."""
    values = [0.0] * len(rows)
    for i in penalised:
        values[i] = getattr(rows[i].params, name)
    return torch.tensor(values, dtype=torch.float32, device=device)


def occurrences(
    id_lists: list[list[int]], row_ids: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) entries of the lists as flat indices row * V + token, and how
    often each occurs: one unique() over the concatenated ids."""
    lengths = _long([len(ids) for ids in id_lists], device)
    rows = torch.repeat_interleave(_long(row_ids, device), lengths)
    flat = rows * vocab_size + _long(list(itertools.chain.from_iterable(id_lists)), device)
    keys, counts = torch.unique(flat, return_counts=True)
    return keys, counts.to(torch.float32)


# -- the draw ------------------------------------------------------------------------------------


def draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """logits: [N, V] of rows with temperature > 0 -> [N] drawn token ids."""
    probs = filter_logits(logits, params).softmax(-1)
    return (probs / exponential_noise(probs, generators, shared)).argmax(-1)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] -> [N, V]: temperature, then min-p, top-k and top-p set dropped tokens to -inf;
    each filter runs on the rows that use it."""
    device = logits.device
    logits = logits / _column([p.temperature for p in params], device)
    min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0]
    if min_p_rows:
        min_p = _column([params[i].min_p for i in min_p_rows], device)
        logits = _on_rows(logits, min_p_rows, lambda part: apply_min_p(part, min_p))
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    top_k_rows = [i for i, p in enumerate(params) if p.top_p == 1.0 and p.effective_top_k]
    if top_p_rows:
        chosen = [params[i] for i in top_p_rows]
        logits = _on_rows(logits, top_p_rows, lambda part: apply_top_k_top_p(part, chosen))
    if top_k_rows:
        ks = [params[i].effective_top_k for i in top_k_rows]
        logits = _on_rows(logits, top_k_rows, lambda part: apply_top_k(part, ks))
    return logits


def _on_rows(
    logits: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`fn` applied to some rows of `logits`; the whole tensor when every row is in."""
    if len(rows) == logits.shape[0]:
        return fn(logits)
    index = _long(rows, logits.device)
    return logits.index_copy(0, index, fn(logits[index]))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min_p: [N, 1]. Drop tokens less likely than min_p x the most likely token."""
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Top-k alone needs only the largest max(k) logits, not a sort of the vocabulary; ties
    with the k-th logit stay. top_ks: >= 1."""
    largest = logits.topk(min(max(top_ks), logits.shape[-1]), dim=-1).values  # [N, max_k]
    return logits.masked_fill(logits < _kth(largest, top_ks), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p, looking only at each row's TOP_P_CANDIDATES most likely tokens (or its
    top-k): a top-k of ~1k is an order of magnitude cheaper than sorting a 32k-152k vocabulary.
    That is exact whenever the candidates hold at least top_p of the row's probability, since
    every other token then has that much mass before it; rows where they do not (flat
    distributions) are sorted in full. Finding out costs one device sync."""
    vocab_size, device = logits.shape[-1], logits.device
    top_ks = [p.effective_top_k for p in params]
    num_candidates = min(vocab_size, max(*top_ks, TOP_P_CANDIDATES))
    values, ids = by_value_then_id(*logits.topk(num_candidates, dim=-1))  # [N, C], descending
    has_top_k = _long(top_ks, device).unsqueeze(1) > 0
    values = values.masked_fill(has_top_k & (values < _kth(values, top_ks)), float("-inf"))
    # Probabilities over the row's whole vocabulary, or over its top-k when it has one.
    normaliser = torch.where(has_top_k, values, float("-inf")).logsumexp(-1, keepdim=True)
    normaliser = torch.where(has_top_k, normaliser, logits.logsumexp(-1, keepdim=True))
    probs = (values - normaliser).exp()
    top_p = _column([p.top_p for p in params], device)
    # The likelier tokens already hold top_p; the most likely token, with none before it, stays.
    drop = probs.cumsum(-1) - probs >= top_p
    values = values.masked_fill(drop, float("-inf"))
    result = torch.full_like(logits, float("-inf")).scatter_(1, ids, values)
    is_covered = has_top_k.squeeze(1) | (probs.sum(-1) >= top_p.squeeze(1))
    uncovered = (~is_covered).nonzero().squeeze(1).tolist()
    if uncovered:
        rows = _long(uncovered, device)
        sorted_rows = top_k_top_p_sorted(logits[rows], top_ks=[top_ks[i] for i in uncovered],
                                         top_p=top_p[rows])  # fmt: skip
        result = result.index_copy(0, rows, sorted_rows)
    return result


def by_value_then_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates in descending value, equal values by ascending token id. topk leaves the order
    of ties open, and top-p keeps the first of tied tokens at its edge: ordered so, a top_p near
    0 keeps the token greedy's argmax picks (the first of the largest), not another with the same
    logit, which bf16 logits often have."""
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(1, order), ids.gather(1, order)


def _kth(values: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """[N, 1]: the k-th largest of each row of descending `values` (the last for k = 0)."""
    width = values.shape[-1]
    ks = [min(k, width) if k > 0 else width for k in top_ks]
    return values.gather(1, _long(ks, values.device).unsqueeze(1) - 1)


def top_k_top_p_sorted(
    logits: torch.Tensor, top_ks: list[int], top_p: torch.Tensor
) -> torch.Tensor:
    """top_p: [N, 1]. The same filters over a full sort of each row."""
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)  # ties by id, as above
    has_top_k = _long(top_ks, logits.device).unsqueeze(1) > 0
    ordered = ordered.masked_fill(has_top_k & (ordered < _kth(ordered, top_ks)), float("-inf"))
    probs = ordered.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator | None
) -> torch.Tensor:
    """[N, V] of Exp(1) draws, as -log(U) (several times faster than exponential_ on CPU): the
    shared generator's for every row, then each seeded row's own (the only per-row loop: a
    generator cannot fill several rows at once)."""
    uniform = torch.rand(probs.shape, generator=shared, device=probs.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(probs.shape[-1], generator=generator, device=probs.device)
    return uniform.log_().neg_()


# -- logprobs ------------------------------------------------------------------------------------


def logprobs_of(
    logits: torch.Tensor, tokens: list[int], num_tops: list[int | None]
) -> list[dict[int, float] | None]:
    """Per row: None, or the chosen token's logprob plus the `num_top` most likely tokens'."""
    result: list[dict[int, float] | None] = [None] * len(num_tops)
    wanted = [i for i, num_top in enumerate(num_tops) if num_top is not None]
    if not wanted:
        return result
    logprobs = logits[_long(wanted, logits.device)].log_softmax(-1)  # [W, V]
    chosen = [tokens[i] for i in wanted]
    chosen_values = logprobs.gather(1, _long(chosen, logits.device).unsqueeze(1)).squeeze(1)
    max_top = max(num_tops[i] or 0 for i in wanted)
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [W, max_top]
    values, ids = top_values.tolist(), top_ids.tolist()
    chosen_list = chosen_values.tolist()
    for row, i in enumerate(wanted):
        num_top = num_tops[i] or 0
        entry = {chosen[row]: chosen_list[row]}
        entry.update(zip(ids[row][:num_top], values[row][:num_top], strict=True))
        result[i] = entry
    return result


def score_tokens(
    logits: torch.Tensor, targets: list[int], num_tops: list[int]
) -> list[PromptLogprob]:
    """logits: [P, V] -> how likely each row's target token was, in a few batched ops."""
    logprobs = logits.log_softmax(-1)  # [P, V]
    target_ids = _long(targets, logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, target_ids)  # [P, 1]
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(max(num_tops, default=0), dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        PromptLogprob(
            target, value, rank, dict(zip(ids[row][:num], values[row][:num], strict=True))
        )
        for row, (target, value, rank, num) in enumerate(
            zip(targets, chosen.squeeze(1).tolist(), ranks, num_tops, strict=True)
        )
    ]


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
