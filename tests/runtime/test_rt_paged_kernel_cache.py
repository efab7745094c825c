"""The paged-attention kernel's cache: a library built once is loaded by later processes as it
is, with no rebuild check (torch's ninja check rebuilt it whenever another checkout had used the
cache last)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvpilot.runtime.layers import paged_kernel

LOAD_IN_A_NEW_PROCESS = """
import sys
from kvpilot.runtime.layers import paged_kernel
paged_kernel.load()
import torch
assert hasattr(torch.ops.kvpilot, "paged_decode_attention")
print("cpp_extension imported:", "torch.utils.cpp_extension" in sys.modules)
"""


def test_a_built_kernel_loads_in_a_new_process_without_the_build_tools() -> None:
    paged_kernel.load()  # built here, or by an earlier process on this machine
    build_dir = paged_kernel.cache_root() / paged_kernel.build_key()
    assert (build_dir / (build_dir / paged_kernel.BUILT_MARK).read_text()).is_file()
    result = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_NEW_PROCESS],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=300,
        check=True,
    )
    assert result.stdout.strip() == "cpp_extension imported: False", result.stderr


def test_a_mark_without_its_library_is_not_loaded(tmp_path: Path) -> None:
    assert not paged_kernel.load_built(tmp_path)  # nothing built here
    paged_kernel.mark_built(tmp_path, tmp_path / "gone.so")
    assert (tmp_path / paged_kernel.BUILT_MARK).read_text() == "gone.so"
    assert not paged_kernel.load_built(tmp_path)  # so it is built again


def test_a_mark_that_cannot_be_written_is_left_out_without_an_error(tmp_path: Path) -> None:
    missing_dir = tmp_path / "gone"  # the mark's directory is not there: writing it fails
    paged_kernel.mark_built(missing_dir, missing_dir / "lib.so")
    assert not (missing_dir / paged_kernel.BUILT_MARK).exists()
