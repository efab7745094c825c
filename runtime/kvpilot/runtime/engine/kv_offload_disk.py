"""The disk tier: blocks the host tier lets go, one file each (engine/kv_offload_files.py).

Writes run on one writer thread, so the step never waits for a disk: a block offered to the tier
waits in `pending` (and is served from there) until its file is whole; a file is written under a
temporary name and renamed, so a crash never leaves half a block under a block's name. At start
the index is rebuilt from the directory's files, oldest first, reading their headers only;
a file that is not this runtime's (another model, dtype, layout) or is unreadable is logged
once and left alone. The KV bytes are checked against the header's checksum when a block is
read back; a corrupt file is logged, dropped from the index and deleted, and never served.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.runtime.engine import kv_offload_files as files
from kvpilot.runtime.engine.kv_offload_policy import TierIndex
from kvpilot.runtime.engine.stats import KvOffloadCounts

log = logging.getLogger("kvpilot.kv_offload")


@dataclass(frozen=True)
class PendingWrite:
    token_ids: tuple[int, ...]
    data: torch.Tensor  # [L, 2, BLOCK_SIZE, H_kv, D bytes] uint8, on the host
    num_hits: int


class DiskTier:
    def __init__(
        self, directory: Path, capacity: int, layout: files.BlockLayout, counts: KvOffloadCounts
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.layout, self.counts = directory, layout, counts
        self.index: TierIndex[Path] = TierIndex(capacity)
        self.lock = threading.Lock()  # index and pending: the step and writer threads
        self.pending: dict[int, PendingWrite] = {}
        self.queue: queue.Queue[int | None] = queue.Queue()
        self._rebuild()
        self.thread = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self.thread.start()

    def _rebuild(self) -> None:
        paths = sorted(
            self.directory.glob(f"*{files.SUFFIX}"), key=lambda p: (p.stat().st_mtime_ns, p.name)
        )
        for path in paths:
            try:
                header, _ = files.read_header(path)
                block_hash = files.check_header(header, self.layout)
            except (files.BlockFileError, OSError) as error:
                log.warning("KV disk tier: ignoring %s: %s", path, error)
                continue
            for victim in self.index.put(block_hash, path, 0):  # over the budget: oldest go
                victim.value.unlink(missing_ok=True)
        self.counts.blocks["disk"] = len(self.index)
        log.info("KV disk tier: %d blocks indexed from %s", len(self.index), self.directory)

    def admit(self, block_hash: int, num_hits: int) -> bool:
        """Whether the tier takes the block (kv_offload_policy): then `write` it."""
        with self.lock:
            if block_hash in self.pending:
                return False
            return self.index.should_admit(block_hash, num_hits)

    def write(
        self, block_hash: int, token_ids: tuple[int, ...], data: torch.Tensor, num_hits: int
    ) -> None:
        """Queue an admitted block for the writer thread; it is served from memory meanwhile."""
        with self.lock:
            self.pending[block_hash] = PendingWrite(token_ids, data, num_hits)
        self.queue.put(block_hash)

    def fetch(self, block_hash: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's KV bytes, checked, or None (a miss, or a file found wrong). Look-ups are
        counted by the caller, once per admitted sequence (KvOffload.count_lookup)."""
        with self.lock:
            pending = self.pending.get(block_hash)
            path = self.index.get(block_hash) if pending is None else None
        if pending is not None and pending.token_ids == token_ids:
            return pending.data
        if path is None:
            return None
        started = time.perf_counter()
        try:
            kv = files.decode(path.read_bytes(), self.layout, block_hash, token_ids)
        except (files.BlockFileError, OSError) as error:
            log.warning("KV disk tier: not serving %s: %s", path, error)
            self._drop(block_hash, path)
            return None
        data = torch.frombuffer(bytearray(kv), dtype=torch.uint8).view(self.layout.payload_shape)
        self.counts.seconds["disk_to_host"] += time.perf_counter() - started
        self.counts.bytes["disk_to_host"] += len(kv)
        return data

    def _drop(self, block_hash: int, path: Path) -> None:
        with self.lock:
            self.index.pop(block_hash)
            self.counts.blocks["disk"] = len(self.index)
        path.unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while (block_hash := self.queue.get()) is not None:
            with self.lock:
                pending = self.pending[block_hash]
            try:
                path = self._write(block_hash, pending)
            except OSError as error:  # a full or failing disk costs the block, not the server
                log.warning("KV disk tier: cannot write block %016x: %s", block_hash, error)
                with self.lock:
                    del self.pending[block_hash]
                continue
            with self.lock:
                victims = self.index.put(block_hash, path, pending.num_hits)
                del self.pending[block_hash]
                self.counts.blocks["disk"] = len(self.index)
            for victim in victims:
                victim.value.unlink(missing_ok=True)

    def _write(self, block_hash: int, pending: PendingWrite) -> Path:
        started = time.perf_counter()
        kv = pending.data.numpy().tobytes()
        path = self.directory / files.file_name(block_hash)
        temporary = path.with_suffix(f".tmp{threading.get_ident()}")
        temporary.write_bytes(files.encode(self.layout, block_hash, pending.token_ids, kv))
        os.replace(temporary, path)
        self.counts.seconds["host_to_disk"] += time.perf_counter() - started
        self.counts.bytes["host_to_disk"] += len(kv)
        return path

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block is on disk; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self.pending:
                    return True
            time.sleep(0.01)  # polled: the writer thread empties `pending`
        return False

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self.queue.put(None)
        self.thread.join()
