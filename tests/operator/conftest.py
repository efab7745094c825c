"""Fixtures of the operator's cluster tests: a namespace per test (the CRDs and the operator
are tests/conftest.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.kube import fresh_namespace


@pytest.fixture
def namespace(cluster: Any) -> Iterator[str]:
    with fresh_namespace(cluster, "op") as name:
        yield name
