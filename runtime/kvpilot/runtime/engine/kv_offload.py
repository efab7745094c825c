"""KV tiers below the pool (`--kv-offloading-size`, `--kv-offloading-disk-path`): evicted prefix
blocks are kept in host memory, then on disk, and a later prefix hit copies them back instead of
recomputing them.

When the copies run: the block manager only records what leaves and what comes back
(block_manager.EvictedBlock, BlockLoad); `transfer` copies both on the step thread between
scheduling and the model's step, evictions first. That is the simplest order that is correct:
an evicted block's KV was fully written (it was hashed after the step that computed it), and
its slot is written again only by the step about to run, so copying it out before that step
needs no fences, no pinning of slots and no second pass. On CPU the copy out is a gather per layer
and a memcpy per block (`_copy_out`; tens of microseconds a block on tiny-llama), cheaper than
handing it to another thread; the disk tier, whose writes are slow, writes on its own
thread. On CUDA the gather runs on the step's stream (ordered before the step's writes) into a
fresh device buffer, and the device-to-host copy into pinned memory runs on a side stream,
so the step does not wait for it; a block read back before its copy ends waits on the copy's
event. (The CUDA path is not exercised by the tests here, which run on CPU.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.runtime.engine.block_manager import BlockLoad, EvictedBlock, TierLookup
from kvpilot.runtime.engine.kv_offload_disk import DiskTier
from kvpilot.runtime.engine.kv_offload_files import BlockLayout, model_identity
from kvpilot.runtime.engine.kv_offload_policy import TierIndex
from kvpilot.runtime.engine.model_runner import ModelRunner
from kvpilot.runtime.engine.sizing import Hardware
from kvpilot.runtime.engine.stats import KvOffloadCounts
from kvpilot.runtime.models.llama import KVCache

GIB = 1 << 30


@dataclass
class HostBlock:
    token_ids: tuple[int, ...]
    data: torch.Tensor  # [L, 2, BLOCK_SIZE, H_kv, D bytes] uint8, on the host (pinned on CUDA)
    ready: torch.cuda.Event | None = None  # None: the copy is done

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


@dataclass(frozen=True)
class OffloadSizes:
    host_blocks: int
    disk_blocks: int  # 0: no disk tier
    disk_path: Path | None


def tier_sizes(
    layout: BlockLayout, host_gib: float, disk_gib: float | None, disk_path: str | None
) -> OffloadSizes:
    """Blocks each tier holds; ValueError when a size holds not one block."""
    host_blocks = int(host_gib * GIB) // layout.payload_bytes
    if host_blocks < 1:
        raise ValueError(
            f"--kv-offloading-size {host_gib} GiB holds no KV block of {layout.payload_bytes} "
            "bytes; give at least that much"
        )
    if disk_path is None or disk_gib is None:
        return OffloadSizes(host_blocks, 0, None)
    disk_blocks = int(disk_gib * GIB) // layout.payload_bytes
    if disk_blocks < 1:
        raise ValueError(
            f"--kv-offloading-disk-size {disk_gib} GiB holds no KV block of "
            f"{layout.payload_bytes} bytes; give at least that much"
        )
    return OffloadSizes(host_blocks, disk_blocks, Path(disk_path))


class KvOffload:
    """The host tier (and the disk tier under it) of one KV pool; block_manager.LowerTier."""

    def __init__(
        self, kv_caches: KVCache, layout: BlockLayout, sizes: OffloadSizes, device: torch.device
    ) -> None:
        self.device, self.layout = device, layout
        # The pool as raw bytes: fp8 has no CPU gather/scatter kernels; bytes are bytes.
        self.pool_bytes = [
            (k.data.view(torch.uint8), v.data.view(torch.uint8)) for k, v in kv_caches
        ]
        self.counts = KvOffloadCounts(capacity={"host": sizes.host_blocks})
        if sizes.disk_path is not None:
            self.counts.capacity["disk"] = sizes.disk_blocks
        self.host: TierIndex[HostBlock] = TierIndex(sizes.host_blocks)
        self.disk = None
        if sizes.disk_path is not None:
            self.disk = DiskTier(sizes.disk_path, sizes.disk_blocks, layout, self.counts)
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fetch(
        self, block_hash: int, token_ids: tuple[int, ...], lookup: TierLookup
    ) -> HostBlock | None:
        lookup.queries["host"] += 1
        block = self.host.get(block_hash)
        if block is not None and block.token_ids == token_ids:
            lookup.answers["host"] += 1
            return block
        if self.disk is None:
            return None
        lookup.queries["disk"] += 1
        data = self.disk.fetch(block_hash, token_ids)
        if data is None:
            return None
        lookup.answers["disk"] += 1
        block = HostBlock(token_ids, data)
        self._put_host(block_hash, block, num_hits=1)  # promoted: the next hit is in memory
        return block

    def count_lookup(self, lookup: TierLookup) -> None:
        """An admitted sequence's look-up, once (block_manager.TierLookup)."""
        for tier, num in lookup.queries.items():
            self.counts.queries[tier] += num
        for tier, num in lookup.answers.items():
            self.counts.hits[tier] += num

    def transfer(self, evicted: list[EvictedBlock], loads: list[BlockLoad]) -> None:
        """Before the step runs: copy out the evicted blocks the host tier admits, then copy
        in the blocks that prefix hits load (a load may reuse a slot just evicted)."""
        to_host = [e for e in evicted if self.host.should_admit(e.hash, e.num_hits)]
        if to_host:
            self._offload(to_host)
        # What a full host tier refuses may still be worth a file: a disk tier with room
        # takes anything, as the host tier does. (A block the host tier holds already, one
        # that was loaded from it, needs no copy at all.)
        disk = self.disk
        if disk is not None:
            refused = [e for e in evicted if e not in to_host and e.hash not in self.host]
            to_disk = [e for e in refused if disk.admit(e.hash, e.num_hits)]
            if to_disk:
                self._offload(to_disk, disk)
        if loads:
            self._load(loads)

    def _offload(self, admitted: list[EvictedBlock], disk: DiskTier | None = None) -> None:
        """Copy the admitted blocks to host memory: into the host tier, or straight to the
        disk tier's writer (`disk`)."""
        started = time.perf_counter()
        block_ids = [e.block_id for e in admitted]
        copies: list[tuple[torch.Tensor, torch.cuda.Event | None]]
        if self.side_stream is None:
            copies = [(data, None) for data in self._copy_out(block_ids)]
        else:
            copies = self._copy_out_async(block_ids, self.side_stream)
        for evicted, (data, ready) in zip(admitted, copies, strict=True):
            block = HostBlock(evicted.token_ids, data, ready)
            if disk is None:
                self._put_host(evicted.hash, block, evicted.num_hits)
            else:
                block.wait()
                disk.write(evicted.hash, evicted.token_ids, block.data, evicted.num_hits)
        self.counts.seconds["pool_to_host"] += time.perf_counter() - started
        self.counts.bytes["pool_to_host"] += len(admitted) * self.layout.payload_bytes

    def _copy_out(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The blocks' KV, one host tensor each (so that each is freed with its entry), in
        2 x layers + n torch calls: per call dispatch, not bytes, is the cost of tiny blocks
        (block by block and layer by layer: ~250 us a block on tiny-llama). Per-layer gathers
        stay small, under torch's grain size, so no thread pool starts (a gather of every
        layer at once did, and on the busy dev machine took 30-80 ms for 5 blocks)."""
        ids = torch.tensor(block_ids)
        layers, _, *block_shape = self.layout.payload_shape
        gathered = torch.empty((layers, 2, len(block_ids), *block_shape), dtype=torch.uint8)
        for layer, (k, v) in enumerate(self.pool_bytes):
            torch.index_select(k, 0, ids, out=gathered[layer, 0])
            torch.index_select(v, 0, ids, out=gathered[layer, 1])
        per_block = gathered.movedim(2, 0)  # [n, L, 2, BS, H_kv, D bytes], a view
        return [block.contiguous() if len(block_ids) > 1 else block for block in per_block]

    def _copy_out_async(
        self, block_ids: list[int], side_stream: torch.cuda.Stream
    ) -> list[tuple[torch.Tensor, torch.cuda.Event | None]]:
        """CUDA: gather on the step's stream (ordered before the step's writes to these slots),
        copy to pinned host memory on the side stream; the event marks the copy's end."""
        ids = torch.tensor(block_ids, device=self.device)
        gathered = torch.stack(
            [
                torch.stack([k.index_select(0, ids), v.index_select(0, ids)])
                for k, v in self.pool_bytes
            ]
        )  # [L, 2, n, BS, H_kv, D bytes]
        side_stream.wait_stream(torch.cuda.current_stream(self.device))
        hosts = []
        with torch.cuda.stream(side_stream):
            for i in range(len(block_ids)):
                host = torch.empty(self.layout.payload_shape, dtype=torch.uint8, pin_memory=True)
                hosts.append(host.copy_(gathered[:, :, i], non_blocking=True))
            ready = torch.cuda.Event()
            ready.record(side_stream)
        gathered.record_stream(side_stream)  # its memory is not reused before the copy is done
        return [(host, ready) for host in hosts]

    def _put_host(self, block_hash: int, block: HostBlock, num_hits: int) -> None:
        disk = self.disk
        for victim in self.host.put(block_hash, block, num_hits):
            if disk is not None and disk.admit(victim.hash, victim.num_hits):
                victim.value.wait()
                disk.write(victim.hash, victim.value.token_ids, victim.value.data, victim.num_hits)
        self.counts.blocks["host"] = len(self.host)

    def _load(self, loads: list[BlockLoad]) -> None:
        """Host copies into their fresh pool blocks (on CUDA a blocking copy: the step about to
        run reads them)."""
        started = time.perf_counter()
        blocks = [cast(HostBlock, load.payload) for load in loads]
        for block in blocks:
            block.wait()
        stacked = torch.stack([block.data for block in blocks]).to(self.device)  # [m, L, 2, ...]
        ids = torch.tensor([load.block_id for load in loads], device=self.device)
        for layer, (k, v) in enumerate(self.pool_bytes):
            k.index_copy_(0, ids, stacked[:, layer, 0])
            v.index_copy_(0, ids, stacked[:, layer, 1])
        self.counts.seconds["host_to_pool"] += time.perf_counter() - started
        self.counts.bytes["host_to_pool"] += len(loads) * self.layout.payload_bytes

    def stats(self, queried_tokens: int, hit_tokens: int) -> KvOffloadCounts:
        snapshot = self.counts.snapshot()
        snapshot.queried_tokens, snapshot.hit_tokens = queried_tokens, hit_tokens
        return snapshot

    def close(self) -> None:
        """Shutdown: the host tier's blocks go to the disk tier (as far as it admits them), so
        that a restart on the same directory starts with them too; then the writes finish."""
        disk = self.disk
        if disk is None:
            return
        for segment in (self.host.protected, self.host.probation):
            for block_hash, entry in segment.items():
                if disk.admit(block_hash, entry.num_hits):
                    entry.value.wait()
                    disk.write(block_hash, entry.value.token_ids, entry.value.data, entry.num_hits)
        disk.close()


def build_kv_offload(
    config: EngineConfig, hardware: Hardware, runner: ModelRunner, host_gib: float
) -> KvOffload:
    """The tiers the config asks for, `host_gib` of host memory first, under `runner`'s pool."""
    cfg = runner.model.cfg
    settings = {  # what changes the KV's values besides the checkpoint
        "dtype": str(hardware.dtype),
        "quantization": config.quantization,
        "int8_kernel": hardware.int8_kernel,
        "device": hardware.device.type,
        "attention_backend": hardware.attention_backend,
        "kv_scales": [(k.scale, v.scale) for k, v in runner.kv_caches],
    }
    layout = BlockLayout(
        model_identity=model_identity(Path(config.model), settings),
        kv_dtype=str(hardware.kv_dtype).removeprefix("torch."),
        kv_itemsize=hardware.kv_dtype.itemsize,
        block_size=BLOCK_SIZE,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )
    sizes = tier_sizes(
        layout, host_gib, config.kv_offloading_disk_size,
        config.kv_offloading_disk_path,
    )  # fmt: skip
    return KvOffload(runner.kv_caches, layout, sizes, hardware.device)
