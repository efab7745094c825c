"""torch.ops.kvpilot.dense_rows (layers/dense_rows.cpp): a dense projection of a decode step's
few rows, against the same product in float64; and DenseWeight.linear, which sends one or two
rows there and more to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention

from kvpilot.runtime.layers import paged_kernel, quant

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def kernel() -> None:
    paged_kernel.load()


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


# (x dtype, w dtype): the pairs DenseWeight sends, and the others the op takes too
PAIRS = [(F32, F32), (F32, BF16), (BF16, BF16), (F16, F16), (BF16, F32)]


@pytest.mark.parametrize(("x_dtype", "w_dtype"), PAIRS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [1, 15, 16, 33, 100])  # past a block of 16 and of 32 pairs
@pytest.mark.parametrize("n", [1, 3, 4, 9])  # whole and partial groups of 4 features
def test_dense_rows_is_the_product_rounded_once(
    x_dtype: torch.dtype, w_dtype: torch.dtype, rows: int, k: int, n: int
) -> None:
    torch.manual_seed(k * 100 + n)
    x, w = torch.randn(rows, k, dtype=x_dtype), torch.randn(n, k, dtype=w_dtype)
    bias = torch.randn(n, dtype=x_dtype)
    for b in (None, bias):
        got = torch.ops.kvpilot.dense_rows(x, w, b)
        assert got.dtype == x_dtype and got.shape == (rows, n)
        want = reference(x, w, b)
        # float sums in another order than float64's, then one rounding into x's dtype
        ulp = torch.finfo(x_dtype).eps
        assert torch.allclose(got.double(), want, rtol=2 * ulp, atol=1e-5 * k + ulp * k**0.5)


def test_rows_may_be_a_strided_view() -> None:
    """Rows of a wider tensor (a split's output): each row contiguous, rows apart."""
    wide = torch.randn(2, 80, dtype=BF16)
    x = wide[:, 16:48]
    w = torch.randn(7, 32, dtype=BF16)
    expected = torch.ops.kvpilot.dense_rows(x.contiguous(), w, None)
    assert torch.equal(torch.ops.kvpilot.dense_rows(x, w, None), expected)


@pytest.mark.parametrize(
    ("x", "w", "bias", "message"),
    [
        (torch.randn(2, 8), torch.randn(4, 9), None, "for the same K"),
        (torch.randn(8), torch.randn(4, 8), None, r"x must be \[T, K\]"),
        (torch.randn(2, 8), torch.randn(8, 4).t(), None, "must be contiguous"),
        (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), r"bias must be \[N\]"),
        (torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8), None, "not Double"),
    ],
)
def test_bad_operands_are_refused_with_the_reason(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvpilot.dense_rows(x, w, bias)


@pytest.mark.parametrize(("x_dtype", "storage"), [(F32, F32), (F32, BF16), (BF16, BF16)])
def test_dense_weight_sends_one_or_two_rows_to_dense_rows(
    x_dtype: torch.dtype, storage: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op's result at 1 and 2 rows (where the dtypes are run by it here: bf16 by bf16 needs
    AVX512-BF16), F.linear's past DENSE_ROWS_MAX or with the switch off (the benchmark's other
    arm)."""
    torch.manual_seed(0)
    weight = quant.DenseWeight(torch.randn(96, 256), storage)
    runs = x_dtype == F32 or torch.ops.kvpilot.dense_rows_bf16_dot()
    linear_calls: list[int] = []

    def counted_linear(
        x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        linear_calls.append(x.shape[0])
        return F.linear(x, w, bias)

    monkeypatch.setattr(quant, "F", type("F", (), {"linear": staticmethod(counted_linear)}))
    assert quant.DENSE_ROWS_MAX == 2
    for rows in (1, 2, 3):
        x = torch.randn(rows, 256, dtype=x_dtype)
        got = weight.linear(x)
        if runs and rows <= quant.DENSE_ROWS_MAX:
            assert torch.equal(got, torch.ops.kvpilot.dense_rows(x, weight.weight, None))
        else:
            assert torch.equal(got, F.linear(x, weight.dequantize(x_dtype)))
    assert linear_calls == ([3] if runs else [1, 2, 3])
    monkeypatch.setattr(quant, "_DENSE_ROWS", False)
    weight.linear(torch.randn(1, 256, dtype=x_dtype))
    assert linear_calls[-1] == 1


def test_dense_weight_leaves_float16_and_non_contiguous_rows_to_f_linear() -> None:
    weight = quant.DenseWeight(torch.randn(8, 32), F16)
    x = torch.randn(1, 32, dtype=F16)
    assert not quant.dense_rows_runs(x, weight.weight)
    strided = torch.randn(32, 2, dtype=F32).t()[:1]  # a row whose values are 2 apart
    assert not quant.dense_rows_runs(strided, quant.DenseWeight(torch.randn(8, 32), F32).weight)
    assert torch.equal(weight.linear(x), F.linear(x, weight.weight))
