"""`kvpilot-runtime eval --checkpoint NAME=PATH`: a pre-quantised checkpoint of tiny-llama, made by
compressed-tensors itself, scored against the same bf16 baseline and samples as kvpilot's own
levels; its perplexity is transformers' on the same checkpoint decompressed."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from bench.reference.prequantized import decompressed_model, write_checkpoint
from kvpilot.runtime.cli import main as cli_main
from kvpilot.runtime.eval_checkpoints import Candidate, parse_candidate, parse_candidates
from kvpilot.runtime.evaluate import samples_for
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from tests.support.prequant_reference import hf_perplexity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("awq=/models/awq", Candidate("awq", Path("/models/awq"))),
        ("ct-int4=rel/dir", Candidate("ct-int4", Path("rel/dir"))),
        ("a=/x=y", Candidate("a", Path("/x=y"))),  # only the first '=' separates
    ],
)
def test_parse_candidate(text: str, expected: Candidate) -> None:
    assert parse_candidate(text) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("/models/awq", "expected NAME=PATH"),
        ("awq=", "expected NAME=PATH"),
        ("=/models/awq", "must be lower-case"),
        ("AWQ=/m", "must be lower-case"),
        ("a_b=/m", "must be lower-case"),
        ("-a=/m", "must be lower-case"),
    ],
)
def test_parse_candidate_says_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_candidate(text)


@pytest.mark.parametrize(
    ("values", "levels", "clashes"),
    [
        (["a=/x", "b=/y"], ["int4"], None),
        (["a=/x", "a=/y"], [], "['a']"),
        (["int4=/x"], ["int8", "int4"], "['int4']"),
    ],
)
def test_parse_candidates_refuses_a_name_twice(
    values: list[str], levels: list[str], clashes: str | None
) -> None:
    if clashes is None:
        assert [c.name for c in parse_candidates(values, levels)] == ["a", "b"]
        return
    with pytest.raises(ValueError, match=re.escape(f"names {clashes}")):
        parse_candidates(values, levels)


@pytest.fixture(scope="module")
def ct_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ct-int4"), "int4-g128")


@pytest.mark.slow
def test_a_checkpoint_row_compares_with_the_levels(
    tiny_llama_dir: Path, ct_int4: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short = tmp_path / "short.txt"
    short.write_text((tiny_llama_dir / "eval.txt").read_text()[:4000])
    summary_file = tmp_path / "termination-log"
    argv = ["eval", "--model", str(tiny_llama_dir), "--dataset", str(short), "--json"]
    candidates = ["--checkpoint", f"ct-int4={ct_int4}", "--checkpoint", f"same={tiny_llama_dir}"]
    options = ["--quantization", "bf16,int4", "--summary-file", str(summary_file)]
    assert cli_main([*argv, *options, *candidates]) == 0
    result = json.loads(capsys.readouterr().out)
    rows, levels = result["checkpoints"], result["levels"]
    # The bf16 checkpoint as a candidate is the bf16 level's row: same samples, same metric.
    assert rows["same"]["level"] == "bf16" and rows["same"]["format"] == "16-bit"
    assert rows["same"]["value"] == pytest.approx(levels["bf16"]["value"], rel=1e-6)
    ct = rows["ct-int4"]
    assert ct["level"] == "int4" and ct["format"].startswith("compressed-tensors int4")
    assert 0 < ct["relative_loss"] < 0.5
    assert ct["relative_loss"] == pytest.approx(ct["value"] / result["baseline"]["value"] - 1)
    # packed int4; down_proj (128 does not divide it) and the embeddings stay in fp32
    assert ct["weight_bytes"] < result["baseline"]["weight_bytes"]
    # What the eval measured is the checkpoint as transformers reads it, decompressed.
    samples = samples_for("perplexity", short, Tokenizer(tiny_llama_dir), 512)
    reference = hf_perplexity(decompressed_model(ct_int4), [s.ids for s in samples])
    assert math.isclose(ct["value"], reference, rel_tol=0.005)
    summary = json.loads(summary_file.read_text())
    assert summary["checkpoints"]["ct-int4"] == {
        "value": ct["value"],
        "relative_loss": ct["relative_loss"],
        "weight_bytes": ct["weight_bytes"],
        "level": "int4",
    }
    assert len(summary_file.read_bytes()) < 4096  # a termination message's limit
    assert cli_main([*argv[:-1], "--quantization", "int4", *candidates]) == 0
    assert "ct-int4 (int4)" in capsys.readouterr().out


@pytest.mark.slow
def test_a_checkpoint_of_another_architecture_is_refused_before_measuring(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1234}))
    shutil.copy(tiny_llama_dir / "tokenizer.json", other / "tokenizer.json")
    argv = ["eval", "--model", str(tiny_llama_dir), "--dataset", str(tiny_llama_dir / "eval.txt")]
    assert cli_main([*argv, "--checkpoint", f"other={other}"]) == 2
    error = capsys.readouterr().err
    assert "--checkpoint other" in error and "vocab_size 1234 vs" in error
