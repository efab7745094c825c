"""Fixtures of the operator's cluster tests: the CRDs, a namespace and an operator per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hack.closedloop import apply_crds
from tests.support.kube import fresh_namespace
from tests.support.operator_cluster import Operator


@pytest.fixture(scope="module")
def crds(cluster: Any) -> None:
    apply_crds(cluster)


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    with fresh_namespace(cluster, "op") as name:
        yield name


@pytest.fixture
def operator(cluster: Any, crds: None, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(cluster, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
