"""Where a LoRA adapter is read from without fetching it: a directory of adapters fetched ahead
(the model cache's, one entry per URI) and the directory the operator mounts pvc:// claims under.

Pure. The runtime resolves an adapter's URI with it (server/lora_serving.py: --lora-cache-dir,
--lora-claims-dir), the operator names its cache fill Jobs' targets and its pods' claim mounts
with the same functions, so the two cannot drift apart. A load keeps the URI it was asked for
(the pod's /v1/models `root`), so the operator's sync sees the adapter it asked for wherever the
files came from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import PurePosixPath

from kvpilot.contract.model_source import ModelSource

# Inside the model cache's claim, beside the model's files (which the runtime reads from the
# claim's top level only), one directory per adapter URI.
CACHE_SUBDIR = ".adapters"


def entry_name(uri: str) -> str:
    """The cache entry of an adapter URI: the digest the model cache's claim is named with
    (operator manifests.cache_claim_name), so an adapter is keyed as a model is."""
    return hashlib.sha256(json.dumps(uri).encode()).hexdigest()[:12]


def claim_path(claims_dir: str, source: ModelSource) -> str:
    """pvc://CLAIM/PATH as a path under `claims_dir`, where the operator mounts each claim at
    its name; ValueError for a path that leaves its claim (`..`)."""
    if source.scheme != "pvc":
        raise ValueError(f"{source.uri}: not a pvc:// URI")
    parts = PurePosixPath(source.path).parts
    if ".." in parts:
        raise ValueError(f"{source.uri}: the path may not contain '..'; name a directory in it")
    return str(PurePosixPath(claims_dir, source.location, *parts))


@dataclass(frozen=True)
class AdapterDirs:
    """The runtime's --lora-cache-dir and --lora-claims-dir (None: not given)."""

    cache_dir: str | None = None
    claims_dir: str | None = None

    def cache_entry(self, uri: str) -> str | None:
        """The adapter's cache directory (None: no cache given)."""
        if self.cache_dir is None:
            return None
        return str(PurePosixPath(self.cache_dir, entry_name(uri)))
