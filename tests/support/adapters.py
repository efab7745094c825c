"""PEFT adapters of the committed tiny-llama (bench/reference/lora.py), written where the tests
that serve them need them: a directory, or file:// URIs the dev cluster's `local` pool reads."""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.reference.lora import AdapterSpec, load_base, make_adapter
from hack import closedloop
from hack.devcluster.versions import REPO_ROOT


def write_adapters(specs: Sequence[AdapterSpec], root: Path) -> dict[str, Path]:
    """Each adapter made with peft at root/<name>, all for one loaded base: name -> directory."""
    base = load_base()
    for spec in specs:
        make_adapter(base, spec, root / spec.name)
    return {spec.name: root / spec.name for spec in specs}


@contextmanager
def local_pool_adapters(specs: Sequence[AdapterSpec], name: str) -> Iterator[dict[str, str]]:
    """The adapters as file:// URIs the `local` pool's pods read, name -> URI, removed after.
    They are written under the checkout's .devcluster/`name`, not under /tmp, which the pods'
    scratch emptyDir hides (closedloop.local_model_uri refuses such a path)."""
    root = REPO_ROOT / ".devcluster" / name
    try:
        dirs = write_adapters(specs, root)
        yield {adapter: closedloop.local_model_uri(path) for adapter, path in dirs.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
