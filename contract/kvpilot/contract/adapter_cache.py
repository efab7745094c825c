"""Where a LoRA adapter is read from without fetching it: a directory of adapters fetched ahead
(the model cache's, one entry per URI) and the directories the operator mounts pvc:// claims at.

Pure. The runtime resolves an adapter's URI with it (server/lora_serving.py: --lora-cache-dir,
--lora-claims), the operator names its cache fill Jobs' targets and its pods' claim mounts
with the same functions, so the two cannot drift apart. A load keeps the URI it was asked for
(the pod's /v1/models `root`), so the operator's sync sees the adapter it asked for wherever the
files came from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from kvpilot.contract.model_source import ModelSource

# Inside the model cache's claim, beside the model's files (which the runtime reads from the
# claim's top level only), one directory per adapter URI.
CACHE_SUBDIR = ".adapters"


def entry_name(uri: str) -> str:
    """The cache entry of an adapter URI: the digest the model cache's claim is named with
    (operator manifests.cache_claim_name), so an adapter is keyed as a model is."""
    return hashlib.sha256(json.dumps(uri).encode()).hexdigest()[:12]


def parse_claims(items: Sequence[str]) -> dict[str, str]:
    """--lora-claims CLAIM=DIR values as claim -> directory; ValueError naming a bad one."""
    claims: dict[str, str] = {}
    for item in items:
        claim, sep, where = item.partition("=")
        if not sep or not claim or not where:
            raise ValueError(f"--lora-claims {item!r}: expected CLAIM=DIR")
        claims[claim] = where
    return claims


def claim_path(claims: Mapping[str, str], source: ModelSource) -> str:
    """pvc://CLAIM/PATH as a path under the claim's mount; ValueError for a claim not mounted
    or a path that leaves its claim (`..`)."""
    if source.scheme != "pvc":
        raise ValueError(f"{source.uri}: not a pvc:// URI")
    parts = PurePosixPath(source.path).parts
    if ".." in parts:
        raise ValueError(f"{source.uri}: the path may not contain '..'; name a directory in it")
    if source.location not in claims:
        mounted = ", ".join(sorted(claims)) or "none"
        raise ValueError(
            f"{source.uri}: claim {source.location!r} is not mounted in this pod (mounted:"
            f" {mounted}); name the adapter in the ModelDeployment's spec.adapters, whose"
            " pods mount its claim"
        )
    return str(PurePosixPath(claims[source.location], *parts))


@dataclass(frozen=True)
class AdapterDirs:
    """The runtime's --lora-cache-dir (None: not given) and --lora-claims."""

    cache_dir: str | None = None
    claims: Mapping[str, str] = field(default_factory=dict)

    def cache_entry(self, uri: str) -> str | None:
        """The adapter's cache directory (None: no cache given)."""
        if self.cache_dir is None:
            return None
        return str(PurePosixPath(self.cache_dir, entry_name(uri)))
