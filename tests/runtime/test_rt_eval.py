"""`kvpilot-runtime eval` on the trained tiny-llama and its held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpilot.runtime.cli import main as cli_main
from kvpilot.runtime.engine.model_runner import load_model
from kvpilot.runtime.evaluate import read_pairs, relative_loss, window_logits, windows
from kvpilot.runtime.models.loader import load_model_config
from kvpilot.runtime.models.tokenizer_files import Tokenizer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model


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


@pytest.mark.parametrize(
    ("value", "baseline", "metric", "loss"),
    [
        (110.0, 100.0, "perplexity", 0.10),
        (99.0, 100.0, "perplexity", -0.01),
        (0.95, 1.0, "agreement", 0.05),
        (1.0, 1.0, "agreement", 0.0),
        (0.6, 0.8, "exact-match", 0.25),
        (0.8, 0.8, "exact-match", 0.0),
    ],
)
def test_relative_loss(value: float, baseline: float, metric: str, loss: float) -> None:
    assert relative_loss(value, baseline, metric) == pytest.approx(loss)


def test_exact_match_needs_a_baseline_that_answers_something() -> None:
    with pytest.raises(ValueError, match="reproduces none"):
        relative_loss(0.0, 0.0, "exact-match")


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ('{"prompt": "a"}', "non-empty prompt and answer"),
        ('{"prompt": "", "answer": "b"}', "non-empty prompt and answer"),
        ('["a", "b"]', "non-empty prompt and answer"),
        ("not json", "Expecting value"),
    ],
)
def test_read_pairs_says_which_line_is_wrong(tmp_path: Path, lines: str, error: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "ok", "answer": "yes"}\n' + lines + "\n")
    with pytest.raises(ValueError, match=error):
        read_pairs(path)


def greedy_answers(model_dir: Path, prompts: list[str], num_tokens: int) -> list[str]:
    """The unquantised model's own greedy continuations, so exact-match has answers it gets."""
    tokenizer, cfg = Tokenizer(model_dir), load_model_config(model_dir)
    model = load_model(model_dir, cfg, "none", torch.float32, torch.device("cpu"))
    answers = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        start = len(ids)
        for _ in range(num_tokens):
            ids.append(int(window_logits(model, [*ids, 0], torch.device("cpu"))[-1].argmax()))
        answers.append(tokenizer.decode(ids[start:]))
    return answers


def test_agreement_and_exact_match_rank_the_levels(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (tiny_llama_dir / "eval.txt").read_text()
    short = tmp_path / "short.txt"
    short.write_text(text[:6000])
    argv = ["eval", "--model", str(tiny_llama_dir), "--quantization", "bf16,int8,int4", "--json"]
    assert cli_main([*argv, "--dataset", str(short), "--metric", "agreement"]) == 0
    agreement = json.loads(capsys.readouterr().out)
    rows = agreement["levels"]
    assert agreement["baseline"]["value"] == 1.0 and agreement["metric"] == "agreement"
    assert rows["bf16"]["value"] > 0.98
    assert 1.0 >= rows["bf16"]["value"] >= rows["int8"]["value"] > rows["int4"]["value"] > 0.5
    assert rows["int4"]["relative_loss"] == pytest.approx(1 - rows["int4"]["value"])

    prompts = [p.strip() for p in text.split(".")[:12] if len(p.strip()) > 20]
    answers = greedy_answers(tiny_llama_dir, prompts, 6)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": p, "answer": a}) + "\n"
            for p, a in zip(prompts, answers, strict=True)
        )
    )
    summary_file = tmp_path / "termination-log"
    assert (
        cli_main(
            [
                *argv,
                "--dataset",
                str(pairs),
                "--metric",
                "exact-match",
                "--summary-file",
                str(summary_file),
            ]
        )
        == 0
    )
    exact = json.loads(capsys.readouterr().out)
    assert exact["num_samples"] == len(prompts)
    assert exact["baseline"]["value"] >= 0.8  # re-tokenising a decoded answer may split it anew
    assert exact["levels"]["int4"]["value"] <= exact["levels"]["int8"]["value"]
    summary = json.loads(summary_file.read_text())
    assert summary["metric"] == "exact-match" and summary["dataset_digest"].startswith("sha256:")
    assert set(summary["levels"]) == {"bf16", "int8", "int4"}
    assert len(summary_file.read_bytes()) < 4096  # a termination message's limit


def test_a_quantised_baseline_is_the_reference_the_loss_is_relative_to(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the unquantised weights fit no GPU, the operator measures against the largest
    level that fits: `--baseline int8` makes int8 the reference (its own loss 0)."""
    short = tmp_path / "short.txt"
    short.write_text((tiny_llama_dir / "eval.txt").read_text()[:3000])
    summary_file = tmp_path / "termination-log"
    argv = ["eval", "--model", str(tiny_llama_dir), "--dataset", str(short), "--json"]
    options = ["--metric", "perplexity", "--summary-file", str(summary_file)]
    assert cli_main([*argv, *options, "--quantization", "int8,int4", "--baseline", "int8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["baseline"]["quantization"] == "int8"
    int8, int4 = result["levels"]["int8"], result["levels"]["int4"]
    assert int8["relative_loss"] == 0.0 and int8["value"] == result["baseline"]["value"]
    assert int4["relative_loss"] == pytest.approx(int4["value"] / int8["value"] - 1)
    summary = json.loads(summary_file.read_text())
    assert summary["reference"] == "int8" and summary["baseline"] == int8["value"]
    # the default reference stays the unquantised checkpoint
    assert cli_main([*argv, "--quantization", "int4"]) == 0
    assert json.loads(capsys.readouterr().out)["baseline"]["quantization"] == "none"
