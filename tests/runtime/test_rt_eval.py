"""`kvpilot-runtime eval` on the trained tiny-llama and its held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.runtime.cli import main as cli_main
from kvpilot.runtime.evaluate import relative_loss, windows


def test_eval_cli_reports_perplexity_and_relative_loss(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--model", str(tiny_llama_dir), "--dataset", str(tiny_llama_dir / "eval.txt")]
    assert cli_main([*argv, "--quantization", "bf16,int8,int4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    base = result["baseline"]["perplexity"]
    levels = result["levels"]
    assert set(levels) == {"bf16", "int8", "int4"}
    assert base < 4096 / 10  # the model has learned something: far below uniform guessing
    assert result["num_tokens"] > 5000
    assert abs(levels["bf16"]["relative_loss"]) < 1e-3  # the checkpoint is stored in bf16
    assert abs(levels["int8"]["relative_loss"]) < 0.02
    assert 0 < levels["int4"]["relative_loss"] < 0.5
    assert (
        levels["int4"]["weight_bytes"]
        < levels["int8"]["weight_bytes"]
        < levels["bf16"]["weight_bytes"]
    )
    assert cli_main([*argv, "--quantization", "int8"]) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table and "int8" in table


def test_eval_cli_rejects_unknown_level(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--model", str(tiny_llama_dir), "--dataset", str(tiny_llama_dir / "eval.txt")]
    assert cli_main([*argv, "--quantization", "fp8"]) == 2
    assert "unknown quantization" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("num_tokens", "max_length", "expected"),
    [(10, 4, [4, 4, 2]), (9, 4, [4, 4]), (1, 4, []), (8, 8, [8])],
)
def test_windows(num_tokens: int, max_length: int, expected: list[int]) -> None:
    assert [len(w) for w in windows(list(range(num_tokens)), max_length)] == expected


def test_relative_loss() -> None:
    assert relative_loss(110.0, 100.0) == pytest.approx(0.10)
