"""The llama-server build's progress line and its tool check (bench/llama_cpp_common.py): what a
user watching the first `make bench` sees, from the text of a real-shaped build log."""

from __future__ import annotations

import pytest

from bench import llama_cpp_common

CONFIGURE = "$ cmake -S src -B build -G Ninja\n-- The C compiler identification is GNU 12.2.0\n"
BUILD = "$ cmake --build build --target llama-server\n"
LINK = "[212/212] Linking CXX executable bin/llama-server\n"
NINJA = "[1/212] Building C object ggml/src/ggml.c.o\n[57/212] Building CXX object llama.cpp.o\n"


@pytest.mark.parametrize(
    ("log", "progress"),
    [
        ("", "configuring"),
        (CONFIGURE, "configuring"),
        (CONFIGURE + BUILD, "configuring"),  # ninja has not printed its first edge yet
        (CONFIGURE + BUILD + NINJA, "57/212 steps (26%)"),
        (CONFIGURE + BUILD + NINJA + LINK, "212/212 steps (100%)"),
        # a failed build's lines above the new attempt are not this build's progress
        (BUILD + NINJA + "FAILED: x.o\n" + CONFIGURE, "configuring"),
        ("[3/9]without the space is no status line\n", "configuring"),
    ],
)
def test_build_progress(log: str, progress: str) -> None:
    assert llama_cpp_common.build_progress(log) == progress


def test_missing_build_tools_are_named_before_anything_downloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match=r"not found: cmake, ninja, c\+\+ .*BENCH_SKIP"):
        llama_cpp_common.check_build_tools()
