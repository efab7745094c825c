"""hack/images/compile_pyc.py: the venv layer's .pyc bytes depend on each file alone, not on
what its worker compiled before (uv's --compile-bytecode made two builds of one layer differ)."""

from __future__ import annotations

import marshal
import subprocess
import sys
from pathlib import Path

import pytest

from hack.images import compile_pyc

# Two modules sharing a frozenset constant (of identifiers no other module here has): compiled
# in one process while the first's code is alive, the second's bytes differ (marshal flags the
# shared set as referenced).
SHARED = 'import sys\nKNOWN = sys.argv[0] in {"kvpilot_test_a", "kvpilot_test_b"}\n'
USES_IT_TWICE = (
    "import sys\n"
    'KNOWN = sys.argv[0] in {"kvpilot_test_a", "kvpilot_test_b"}\n'
    'def known():\n    return sys.argv[0] in {"kvpilot_test_a", "kvpilot_test_b"}\n'
)


def pyc_of(source: Path) -> bytes:
    return next(source.parent.glob(f"__pycache__/{source.stem}.*.pyc")).read_bytes()


def worker(paths: list[Path]) -> None:
    """compile_pyc's worker, a new interpreter, compiling `paths` in order."""
    subprocess.run([sys.executable, compile_pyc.__file__, "--worker"], check=True,
                   input="\n".join(map(str, paths)), text=True, capture_output=True)  # fmt: skip


def alone(source: Path) -> bytes:
    """`source`'s .pyc as a new worker writes it with nothing compiled before."""
    for old in source.parent.glob(f"__pycache__/{source.stem}.*.pyc"):
        old.unlink()
    worker([source])
    return pyc_of(source)


def test_the_premise_a_live_equal_constant_changes_a_files_bytes() -> None:
    by_itself = marshal.dumps(compile(USES_IT_TWICE, "m.py", "exec"))
    kept = compile(SHARED, "s.py", "exec")
    beside_it = marshal.dumps(compile(USES_IT_TWICE, "m.py", "exec"))
    assert kept is not None and by_itself != beside_it


def test_a_file_compiled_after_another_has_the_bytes_it_has_alone(tmp_path: Path) -> None:
    (tmp_path / "a_shared.py").write_text(SHARED)
    (tmp_path / "b_module.py").write_text(USES_IT_TWICE)
    worker([tmp_path / "a_shared.py", tmp_path / "b_module.py"])
    after_another = pyc_of(tmp_path / "b_module.py")
    assert after_another == alone(tmp_path / "b_module.py")


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_any_number_of_workers_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    sources = [tmp_path / "pkg" / f"m{index}.py" for index in range(6)]
    sources[0].parent.mkdir()
    for index, source in enumerate(sources):
        source.write_text(SHARED if index % 2 else USES_IT_TWICE)
    monkeypatch.setattr(compile_pyc, "WORKERS", workers)
    assert compile_pyc.main([str(tmp_path)]) == 0
    written = [pyc_of(source) for source in sources]
    assert written == [alone(source) for source in sources]


def test_a_file_that_does_not_compile_is_left_without_a_pyc_and_links_are_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "good.py").write_text("X = 1\n")
    (lib / "python2.py").write_text('print "hello"\n')
    (tmp_path / "lib64").symlink_to(lib)  # a venv's lib64
    assert compile_pyc.main([str(tmp_path)]) == 0
    assert "1 of 2 files compiled" in capsys.readouterr().out
    assert [path.name.split(".")[0] for path in (lib / "__pycache__").iterdir()] == ["good"]


def test_pyc_files_are_checked_hash_ones(tmp_path: Path) -> None:
    """Checked-hash .pyc (flags 0b11): valid whatever mtime the layer's tar gives the source."""
    (tmp_path / "m.py").write_text("X = 1\n")
    assert compile_pyc.compile_one(str(tmp_path / "m.py"))
    assert int.from_bytes(pyc_of(tmp_path / "m.py")[4:8], "little") == 0b11
