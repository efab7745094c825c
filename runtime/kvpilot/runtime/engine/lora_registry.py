"""The LoRA adapters a server knows by name, and a host-memory cache of their weights.

Registered adapters (--lora-modules, /v1/load_lora_adapter) stay known until unloaded; their
weights are kept in host memory for the `max_cpu_loras` most recently used, and read from disk
again when an evicted one is asked for. Reading runs in the caller's thread, never the step's:
the server calls `load` and `request_for` off its event loop. Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvpilot.runtime.engine.lora_slots import LoraRequest
from kvpilot.runtime.models.loader import ModelConfig
from kvpilot.runtime.models.lora_files import LoraAdapter, LoraError, load_adapter


class LoraNotFoundError(KeyError):
    """No adapter of this name is loaded."""


@dataclass(frozen=True)
class Registered:
    name: str
    path: str  # the local directory read
    lora_id: int
    uri: str  # as the adapter was named (a path, hf://, s3://)


class LoraRegistry:
    def __init__(self, model_config: ModelConfig, max_rank: int, max_cpu_loras: int) -> None:
        self.model_config, self.max_rank, self.max_cpu_loras = model_config, max_rank, max_cpu_loras
        self._lock = threading.Lock()
        self._by_name: dict[str, Registered] = {}
        self._cache: OrderedDict[int, LoraAdapter] = OrderedDict()  # lora_id -> weights, LRU
        self._ids = itertools.count(1)

    def load(self, name: str, path: str, uri: str | None = None) -> LoraRequest:
        """Read and check the adapter at `path` (fetched from `uri`, if it was), then register it
        as `name`; LoraError when the name is taken or the adapter cannot run on this model."""
        if self.is_loaded(name):  # checked first too, so a taken name reads nothing
            raise LoraError(f"The lora adapter '{name}' has already been loaded.")
        adapter = load_adapter(path, self.model_config, self.max_rank)
        with self._lock:
            if name in self._by_name:
                raise LoraError(f"The lora adapter '{name}' has already been loaded.")
            entry = Registered(name, path, next(self._ids), uri or path)
            self._by_name[name] = entry
            self._keep(entry.lora_id, adapter)
        return LoraRequest(name, entry.lora_id, adapter)

    def unload(self, name: str) -> None:
        """Forget `name`; sequences already running under it finish with its weights."""
        with self._lock:
            entry = self._by_name.pop(name, None)
            if entry is None:
                raise LoraNotFoundError(name)
            self._cache.pop(entry.lora_id, None)

    def is_loaded(self, name: str) -> bool:
        with self._lock:
            return name in self._by_name

    def adapters(self) -> list[Registered]:
        with self._lock:
            return list(self._by_name.values())

    def request_for(self, name: str) -> LoraRequest:
        """The adapter as a request runs it, read from disk again when evicted from the host
        cache; LoraNotFoundError when no adapter has this name."""
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None:
                raise LoraNotFoundError(name)
            adapter = self._cache.get(entry.lora_id)
            if adapter is not None:
                self._cache.move_to_end(entry.lora_id)
                return LoraRequest(name, entry.lora_id, adapter)
        adapter = load_adapter(entry.path, self.model_config, self.max_rank)
        with self._lock:
            if self._by_name.get(name) == entry:  # not unloaded or replaced meanwhile
                self._keep(entry.lora_id, adapter)
        return LoraRequest(name, entry.lora_id, adapter)

    def _keep(self, lora_id: int, adapter: LoraAdapter) -> None:  # under the lock
        self._cache[lora_id] = adapter
        self._cache.move_to_end(lora_id)
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)

    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)
