"""The GPU check's pre-quantised step, dry-run on CPU: bench.gpu.prequant_refs writes the
checkpoints it carries, and the check loads and compares each (CPU against CPU here, so the
figures are exact; on a GPU the device's kernels against the CPU's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu import check, prequant_refs
from tests.support.prequant_reference import gptqmodel_checkpoint


@pytest.mark.slow
def test_the_carried_checkpoints_are_written_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variant in prequant_refs.GPTQMODEL_VARIANTS:
        gptqmodel_checkpoint(variant)  # skips where GPTQModel's venv cannot be made
    written = prequant_refs.write_refs(tmp_path / ".gpu-refs")
    names = [*prequant_refs.GPTQMODEL_VARIANTS, *prequant_refs.COMPRESSED_TENSORS_VARIANTS]
    assert [p.name for p in written] == names
    monkeypatch.setattr(check, "PREQUANT_REFS", tmp_path / ".gpu-refs")
    results = check.prequant_results("cpu")
    assert [(r.name, r.status) for r in results] == [
        (f"pre-quantised {name}", "PASS") for name in sorted(names)
    ]
    assert all(r.figures["max_logit_diff"] == 0 for r in results)


def test_without_the_checkpoints_the_step_says_how_to_make_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "PREQUANT_REFS", tmp_path / "absent")
    [result] = check.prequant_results("cpu")
    assert result.status == "SKIP" and "python -m bench.gpu.prequant_refs" in result.detail
