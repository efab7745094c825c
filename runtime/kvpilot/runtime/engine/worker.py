"""Ranks 1..N-1 of a tensor-parallel engine: child processes that follow rank 0's steps.

Rank 0 (the engine's own process) schedules and samples. Each worker holds its shard of the model
and its share of the KV pool, and runs every step's forward pass alongside rank 0; the layers'
all-reduces keep the ranks in lockstep. A worker first loads its shard and answers "ok" (or the
error); then one pipe per worker carries, from rank 0:

    ("join", None)       join the process group (once every rank has loaded its shard)
    ("kv", args)         allocate the KV pool (ModelRunner.allocate_kv_cache's arguments); the
                         worker answers "ok" or an error
    ("lora_slots", (n, r)) make room for n LoRA adapters of rank <= r (LlamaModel.enable_lora);
                         the worker answers "ok" or an error
    ("lora", loads)      copy adapters into slots before the next step (ModelRunner.load_loras),
                         each whole as numpy arrays: the worker keeps its shard; no answer
    ("step", StepPlan)   run the step; no answer (the all-reduces are the handshake)
    None                 leave the process group and exit

A worker also exits by itself when its pipe closes or its parent process is gone, so a rank 0 that
dies (even by SIGKILL) leaves no orphans computing behind it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpilot.runtime.engine.lora_slots import LoraRequest
from kvpilot.runtime.engine.model_runner import ModelRunner, StepPlan, load_model
from kvpilot.runtime.engine.parallel import (
    TPGroup,
    destroy_process_group,
    init_process_group,
    rank_device,
)
from kvpilot.runtime.layers import paged_kernel
from kvpilot.runtime.models.loader import ModelConfig
from kvpilot.runtime.models.lora_files import LoraAdapter

JOIN_TIMEOUT_S = 10.0  # a worker told to stop that has not exited by then is killed
PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker needs to build its rank; plain values, pickled to the child."""

    model_dir: Path
    model_config: ModelConfig  # the whole model's
    quantization: str
    int8_kernel: str  # resolved: w8a16 or w8a8
    attention_backend: str  # resolved: paged or sdpa
    dtype: torch.dtype
    device: torch.device  # rank 0's; rank r uses the r-th device after it (parallel.rank_device)
    seed: int
    group: TPGroup
    init_method: str
    parent_pid: int
    num_threads: int


class WorkerPool:
    """The worker processes of one engine, and rank 0's membership in their process group."""

    def __init__(self, args: WorkerArgs, store_dir: str) -> None:
        ctx = mp.get_context("spawn")  # fork would copy rank 0's threads and CUDA state
        self.store_dir, self.init_method = store_dir, args.init_method
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.is_shut_down = False
        for rank in range(1, args.group.size):
            conn, child_conn = ctx.Pipe()
            rank_args = replace(args, group=TPGroup(rank, args.group.size))
            proc = ctx.Process(
                target=run_worker,
                args=(rank_args, child_conn),
                name=f"kvpilot-tp-rank-{rank}",
                daemon=True,  # terminated by multiprocessing at exit if shutdown never ran
            )
            proc.start()
            child_conn.close()  # the child's end lives in the child only: EOF when it dies
            self.procs.append(proc)
            self.conns.append(conn)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs if proc.pid is not None]

    def join_group(self, group: TPGroup, device: torch.device) -> None:
        """Once every rank has loaded its shard (however long that takes), all join the process
        group together, so its rendezvous timeout only covers the rendezvous."""
        self._wait_all("load")
        self._send_all(("join", None))
        init_process_group(group, self.init_method, device)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        kv_dtype: torch.dtype | None,
        scales: list[tuple[float, float]] | None,
    ) -> None:
        self._send_all(("kv", (num_blocks, kv_dtype, scales)))
        self._wait_all("KV-cache allocation")

    def thread_counts(self) -> list[int]:
        """The intra-op threads each worker computes with (ranks 1..N-1, in order)."""
        self._send_all(("threads", None))
        return [_receive(proc, conn) for proc, conn in zip(self.procs, self.conns, strict=True)]

    def execute(self, plan: StepPlan) -> None:
        self._send_all(("step", plan))

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        self._send_all(("lora_slots", (num_slots, max_rank)))
        self._wait_all("LoRA slot allocation")

    def load_loras(self, loads: list[tuple[int, LoraRequest]]) -> None:
        self._send_all(("lora", [(slot, adapter_arrays(req.adapter)) for slot, req in loads]))

    def _send_all(self, message: Any) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
            try:
                conn.send(message)
            except OSError as error:  # its end of the pipe closed: the worker exited
                raise RuntimeError(
                    f"tensor-parallel rank {rank} is gone (exit code {proc.exitcode}); "
                    "the engine cannot run without it"
                ) from error

    def _wait_all(self, what: str) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
            answer = _receive(proc, conn)
            if answer != "ok":
                raise RuntimeError(f"tensor-parallel rank {rank} failed at {what}: {answer}")

    def shutdown(self) -> None:
        """Stop and reap every worker, leave the process group; safe to call more than once."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that worker may be gone already
                conn.send(None)
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        destroy_process_group()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def start_workers(args: WorkerArgs) -> WorkerPool:
    """Spawn ranks 1..N-1; they start loading their shards while rank 0 loads its own."""
    store_dir = tempfile.mkdtemp(prefix="kvpilot-tp-")
    init_method = f"file://{store_dir}/rendezvous"
    pool_args = replace(args, init_method=init_method)
    return WorkerPool(pool_args, store_dir)


def _receive(proc: BaseProcess, conn: Connection) -> Any:
    """The worker's next answer, or why none will come. No deadline: loading a large shard takes
    as long as it takes, and a worker that dies is noticed within a poll."""
    while proc.is_alive() or conn.poll(0):
        if conn.poll(0.2):
            try:
                return conn.recv()
            except EOFError:
                break
    return f"no answer (exit code {proc.exitcode})"


# -- the worker process ---------------------------------------------------------------------------


def run_worker(args: WorkerArgs, conn: Connection) -> None:
    """A worker's whole life: load its shard, join the group, follow steps until told to stop."""
    # Ctrl-C reaches the whole foreground process group; only rank 0 decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(args.parent_pid, args.init_method)
    torch.set_num_threads(args.num_threads)
    try:
        device = rank_device(args.device, args.group.rank, args.group.size)
        runner = load_rank(args, device)
    except Exception as error:
        conn.send(f"{type(error).__name__}: {error}")
        return
    conn.send("ok")
    handlers: dict[str, Callable[[Any], object]] = {
        "join": lambda _: init_process_group(args.group, args.init_method, device),
        "kv": lambda kv_args: conn.send(_try(runner.allocate_kv_cache, *kv_args)),
        "step": runner.run_model,
        "lora_slots": lambda args: conn.send(_try(runner.model.enable_lora, *args)),
        "lora": lambda loads: load_lora_arrays(runner, loads),
        "threads": lambda _: conn.send(torch.get_num_threads()),
    }
    try:
        if not follow(conn, handlers):
            remove_store(args.init_method)  # rank 0 died and could not
    finally:
        destroy_process_group()


def load_rank(args: WorkerArgs, device: torch.device) -> ModelRunner:
    model = load_model(
        args.model_dir,
        args.model_config,
        args.quantization,
        args.dtype,
        device,
        args.group,
        args.int8_kernel,
    )
    if args.attention_backend == "paged":
        paged_kernel.load()  # built by rank 0 already: this loads it into the worker
    return ModelRunner(model, device, args.seed, attention_backend=args.attention_backend)


def follow(conn: Connection, handlers: dict[str, Callable[[Any], object]]) -> bool:
    """Handle rank 0's messages until it says stop (True) or is gone (False)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return False
        if message is None:
            return True
        kind, payload = message
        handlers[kind](payload)


# An adapter as a worker receives it: its path, rank and (layer, module) -> (A, B) as arrays.
AdapterArrays = tuple[str, int, dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]]


def adapter_arrays(adapter: LoraAdapter) -> AdapterArrays:
    """Plain arrays pickle through the pipe as bytes; tensors would go through torch's
    shared-memory reductions (a file descriptor per tensor) for a one-off copy."""
    weights = {key: (a.numpy(), b.numpy()) for key, (a, b) in adapter.weights.items()}
    return adapter.path, adapter.rank, weights


def load_lora_arrays(runner: ModelRunner, loads: list[tuple[int, AdapterArrays]]) -> None:
    lora = runner.model.lora
    if lora is None:
        raise ValueError("LoRA adapters sent to a worker without LoRA slots")
    for slot, (path, rank, arrays) in loads:
        weights = {k: (torch.from_numpy(a), torch.from_numpy(b)) for k, (a, b) in arrays.items()}
        lora.set_slot(slot, LoraAdapter(path, rank, weights))


def _try(fn: Callable[..., object], *args: Any) -> str:
    try:
        fn(*args)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def watch_parent(parent_pid: int, init_method: str) -> None:
    """Exit as soon as the parent (rank 0) is gone, even while blocked in a collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        remove_store(init_method)
        os._exit(1)

    threading.Thread(target=watch, name="kvpilot-watch-parent", daemon=True).start()


def remove_store(init_method: str) -> None:
    """The rendezvous directory (start_workers) of a group whose rank 0 is gone."""
    shutil.rmtree(Path(init_method.removeprefix("file://")).parent, ignore_errors=True)
