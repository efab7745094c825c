"""Byte-compiles a directory's .py files into reproducible .pyc files: run by customize.sh with
the image's own interpreter, in place of `uv pip sync --compile-bytecode`.

Why not uv's: marshal flags an object as referenced (FLAG_REF) when its reference count is
above one, and CPython 3.13 shares equal constants across every compilation in a process. A
frozenset such as {"linux", "android"} still alive from a file compiled earlier in the same
worker therefore changes the bytes of the next file that has it, and which files share a worker
is a race between uv's workers: two builds of the same venv layer differed in one .pyc
(filelock/_identity/_process.py). Here every file is compiled from the same state: its code is
dropped and the cycle collector run before the next one, so the bytes depend on the file alone,
whichever worker compiles it and in whatever order.

Usage: python3 compile_pyc.py DIR...  (one worker process a CPU, each given its share of the
paths on stdin: no multiprocessing, whose semaphores need a /dev/shm the build's chroot lacks;
checked-hash .pyc, as SOURCE_DATE_EPOCH makes py_compile
write; a file that does not compile, such as a package's Python 2 test data, is left without a
.pyc, as uv and compileall leave it)
"""

from __future__ import annotations

import gc
import os
import py_compile
import subprocess
import sys
from pathlib import Path

WORKERS = os.cpu_count() or 1
CHECKED_HASH = py_compile.PycInvalidationMode.CHECKED_HASH


def sources(directory: Path) -> list[str]:
    """Every .py below `directory`, symlinked directories not followed (a venv's lib64 is a
    link to lib), sorted."""
    found = []
    for parent, dirs, files in os.walk(directory):
        dirs.sort()
        found += [os.path.join(parent, name) for name in sorted(files) if name.endswith(".py")]
    return found


def compile_one(path: str) -> bool:
    try:
        py_compile.compile(path, doraise=True, invalidation_mode=CHECKED_HASH)
        compiled = True
    except py_compile.PyCompileError:  # doraise wraps whatever compiling the file raised
        compiled = False
    gc.collect()  # the file's code objects gone before the next file compiles
    return compiled


def compile_share() -> int:
    """A worker: compiles the paths on stdin, one a line; prints how many compiled."""
    print(sum(compile_one(line) for line in sys.stdin.read().splitlines()), flush=True)
    return 0


def main(directories: list[str]) -> int:
    paths = [path for directory in directories for path in sources(Path(directory))]
    shares = [share for share in (paths[start::WORKERS] for start in range(WORKERS)) if share]
    workers = []
    for share in shares:  # every worker has its share before any is waited for
        worker = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert worker.stdin is not None
        worker.stdin.write("\n".join(share))
        worker.stdin.close()
        workers.append(worker)
    compiled = 0
    for worker in workers:
        assert worker.stdout is not None
        out = worker.stdout.read()
        if worker.wait() != 0:
            raise SystemExit(f"compile_pyc: a worker failed (exit {worker.returncode})")
        compiled += int(out)
    print(f"compile_pyc: {compiled} of {len(paths)} files compiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(compile_share() if sys.argv[1:] == ["--worker"] else main(sys.argv[1:]))
