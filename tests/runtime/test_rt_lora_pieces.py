"""The compact B of a fused projection's LoRA (layers/lora.py): its output cut in pieces of one
width, and the batched expand over (slot, piece) against the block-diagonal product it replaces."""

from __future__ import annotations

import pytest
import torch

from kvpilot.runtime.layers.lora import expand, output_pieces


@pytest.mark.parametrize(
    ("outs", "width", "pieces"),
    [
        ([256], 256, [0]),  # o, down: one sub-module, one piece
        ([688, 688], 688, [0, 1]),  # gate_up
        ([256, 64, 64], 64, [0, 0, 0, 0, 1, 2]),  # tiny-llama's q, k, v
        ([4096, 1024, 1024], 1024, [0, 0, 0, 0, 1, 2]),  # Llama-3-8B's
        ([96, 64, 64], 32, [0, 0, 0, 1, 1, 2, 2]),  # q not a multiple of kv
        ([128, 32, 32], 32, [0, 0, 0, 0, 1, 2]),  # a tensor-parallel rank's shard
    ],
)
def test_output_pieces(outs: list[int], width: int, pieces: list[int]) -> None:
    assert output_pieces(outs) == (width, pieces)


@pytest.mark.parametrize(
    ("outs", "num_groups", "num_rows"),
    [([256, 64, 64], 3, 4), ([40, 40], 2, 5), ([24], 4, 1), ([96, 64, 64], 1, 17)],
)
def test_expand_is_the_block_diagonal_product(
    outs: list[int], num_groups: int, num_rows: int
) -> None:
    """Each sub-module's R columns of u times its own B land in its own output columns."""
    rank = 4
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(num_groups, num_rows, len(outs) * rank, generator=generator)
    bs = [torch.randn(num_groups, rank, out, generator=generator) for out in outs]
    block_diagonal = torch.zeros(num_groups, len(outs) * rank, sum(outs))
    column = 0
    for j, b in enumerate(bs):
        block_diagonal[:, j * rank : (j + 1) * rank, column : column + outs[j]] = b
        column += outs[j]
    width, pieces = output_pieces(outs)
    compact = torch.cat(  # [G, P, R, w]: each sub-module's B cut in pieces of width w
        [b.view(num_groups, rank, -1, width).transpose(1, 2) for b in bs], dim=1
    )
    got = expand(u, compact, torch.tensor(pieces))
    want = torch.bmm(u, block_diagonal).flatten(0, 1)
    torch.testing.assert_close(got, want)
