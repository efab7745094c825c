"""The runtime pods run as the user runtime/Dockerfile creates, so they can write what it owns
(/models) and kube-score's low-UID check passes without an exception."""

from __future__ import annotations

import re
from pathlib import Path

from kvpilot.operator.reconcile import manifests

DOCKERFILE = Path(__file__).resolve().parents[2] / "runtime" / "Dockerfile"


def test_manifests_use_the_images_user() -> None:
    text = DOCKERFILE.read_text()
    (created,) = re.findall(r"useradd --uid (\d+)", text)
    (user,) = re.findall(r"^USER (\d+):(\d+)$", text, flags=re.MULTILINE)
    assert int(created) == manifests.RUNTIME_UID
    assert user == (str(manifests.RUNTIME_UID), str(manifests.RUNTIME_UID))
    assert manifests.RUNTIME_UID > 10000  # kube-score: no overlap with the node's users
