"""The paged-attention kernel's cache: a library built once is loaded by later processes as it
is, with no rebuild check (torch's ninja check rebuilt it whenever another checkout had used the
cache last)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.runtime.layers import paged_kernel

LOAD_IN_A_NEW_PROCESS = """
import sys
import pytest

from kvpilot.runtime.layers import paged_kernel
LOAD = paged_kernel.loaded_without_building if sys.argv[1] == "without" else paged_kernel.load
print("loaded:", LOAD())
import torch
assert hasattr(torch.ops.kvpilot, "paged_decode_attention")
assert hasattr(torch.ops.kvpilot, "int4_tiles")
print("cpp_extension imported:", "torch.utils.cpp_extension" in sys.modules)
"""


@pytest.mark.parametrize(("how", "returned"), [("load", "None"), ("without", "True")])
def test_a_built_kernel_loads_in_a_new_process_without_the_build_tools(
    how: str, returned: str
) -> None:
    """Both ops of the library load (`without`: paged_kernel.loaded_without_building, as the
    int4 tile writer asks)."""
    paged_kernel.load()  # built here, or by an earlier process on this machine
    build_dir = paged_kernel.cache_root() / paged_kernel.build_key()
    assert (build_dir / (build_dir / paged_kernel.BUILT_MARK).read_text()).is_file()
    result = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_NEW_PROCESS, how],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=300,
        check=True,
    )
    lines = [f"loaded: {returned}", "cpp_extension imported: False"]
    assert result.stdout.strip().splitlines() == lines, result.stderr


NOT_BUILT_HERE = """
from kvpilot.runtime.layers import paged_kernel
print(paged_kernel.loaded_without_building())
"""


def test_where_nothing_is_built_the_int4_tile_writer_does_not_build_it(tmp_path: Path) -> None:
    """No cache and no prebuilt kernel: False at once (the tile writer's tensor ops then run),
    and nothing is compiled, though a compiler is there."""
    env = {**os.environ, paged_kernel.CACHE_ENV: str(tmp_path / "cache"),
           paged_kernel.PREBUILT_ENV: str(tmp_path / "prebuilt")}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", NOT_BUILT_HERE], capture_output=True,
                            text=True, env=env, timeout=300, check=True)  # fmt: skip
    assert result.stdout.strip() == "False", result.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_a_mark_without_its_library_is_not_loaded(tmp_path: Path) -> None:
    assert not paged_kernel.load_built(tmp_path)  # nothing built here
    paged_kernel.mark_built(tmp_path, tmp_path / "gone.so")
    assert (tmp_path / paged_kernel.BUILT_MARK).read_text() == "gone.so"
    assert not paged_kernel.load_built(tmp_path)  # so it is built again


def test_a_mark_that_cannot_be_written_is_left_out_without_an_error(tmp_path: Path) -> None:
    missing_dir = tmp_path / "gone"  # the mark's directory is not there: writing it fails
    paged_kernel.mark_built(missing_dir, missing_dir / "lib.so")
    assert not (missing_dir / paged_kernel.BUILT_MARK).exists()


V4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}


@pytest.mark.parametrize(
    ("level", "march"),
    [
        ("x86-64-v4-bf16", ["-march=x86-64-v4", "-mavx512bf16"]),
        ("x86-64-v4", ["-march=x86-64-v4"]),
        ("x86-64-v3", ["-march=x86-64-v3"]),
    ],
)
def test_a_portable_level_builds_for_its_architecture_not_this_cpu(
    level: str, march: list[str]
) -> None:
    flags = paged_kernel.portable_flags(level)
    assert "-march=native" not in flags
    assert [f for f in flags if f.startswith(("-march", "-mavx"))] == march
    assert set(flags) - set(march) == set(paged_kernel.COMPILE_FLAGS) - {"-march=native"}


@pytest.mark.parametrize(
    ("flags", "levels"),
    [
        (V4 | V3 | {"sse4_2", "avx512_bf16"}, ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3"]),
        (V4 | V3 | {"sse4_2"}, ["x86-64-v4", "x86-64-v3"]),
        ((V4 - {"avx512bw"}) | V3 | {"avx512_bf16"}, ["x86-64-v3"]),
        (V3 | {"sse4_2"}, ["x86-64-v3"]),
        (V3 - {"abm"}, []),  # no LZCNT: not v3, whatever else it has
        ((V4 | V3) - {"avx512vl"}, ["x86-64-v3"]),
        (set(), []),
    ],
)
def test_a_cpu_runs_the_portable_levels_whose_features_it_has(
    flags: set[str], levels: list[str]
) -> None:
    assert paged_kernel.portable_levels(frozenset(flags)) == levels


LOAD_WITHOUT_A_COMPILER = """
import pytest

from kvpilot.runtime.layers import paged_kernel
paged_kernel.load()
import torch
assert hasattr(torch.ops.kvpilot, "paged_decode_attention")
print("loaded from", paged_kernel.prebuilt_root(), torch.ops.kvpilot.dense_rows_bf16_dot())
"""


@pytest.mark.slow  # compiles the kernel once for a portable level
@pytest.mark.parametrize(("level", "bf16_dot"), [("x86-64-v3", False), ("x86-64-v4-bf16", True)])
def test_a_prebuilt_kernel_loads_where_there_is_no_compiler_and_no_cache(
    tmp_path: Path, level: str, bf16_dot: bool
) -> None:
    """What an image does: the kernel built for a portable level when the image was built,
    loaded in a pod without a compiler or a cache of its own; dense_rows runs bf16 through
    AVX512-BF16 in the level that has it only."""
    from kvpilot.runtime.engine import machine_files

    if level not in paged_kernel.portable_levels(machine_files.cpu_flags()):
        pytest.skip(f"this CPU is not {level}")
    out = tmp_path / "prebuilt"
    build = [sys.executable, "-m", "kvpilot.runtime.layers.paged_kernel", "--portable",
             level, "--out", str(out)]  # fmt: skip
    subprocess.run(build, capture_output=True, text=True, timeout=600, check=True)
    (built,) = out.iterdir()
    assert built.name == paged_kernel.portable_key(level)
    env = {**os.environ, "CXX": "no-such-compiler", paged_kernel.CACHE_ENV: str(tmp_path / "cache"),
           paged_kernel.PREBUILT_ENV: str(out)}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_A_COMPILER], capture_output=True,
                            text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"loaded from {out} {bf16_dot}"
    assert not (tmp_path / "cache").exists()  # nothing was built for this machine
