"""The server's state: the engine's lifecycle (load in the background, drain on SIGTERM) and
admission (`--max-waiting`), between HTTP (server/app.py) and request handling (server/handling.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any, TypeVar

import torch

from kvpilot.contract.checkpoint_quant import CheckpointQuant
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.contract.fetch import fetch
from kvpilot.contract.memory import BLOCK_SIZE
from kvpilot.contract.serve_config import ServeConfig
from kvpilot.contract.speculative_config import SpeculativeConfig
from kvpilot.runtime.engine.async_engine import AsyncEngine
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.machine import ThreadChoice, rank_share
from kvpilot.runtime.engine.stats import EngineStats
from kvpilot.runtime.server import lora_serving
from kvpilot.runtime.server.errors import ApiError
from kvpilot.runtime.server.metrics import CacheInfo, ServerMetrics
from kvpilot.runtime.server.response_models import EngineChoices
from kvpilot.runtime.server.startup import StartupClock, describe

log = logging.getLogger("kvpilot.server")
T = TypeVar("T")


def engine_config(config: ServeConfig, model_dir: str) -> EngineConfig:
    """The engine's fields of the serve config (the same names), with the model as a directory."""
    values = {f.name: getattr(config, f.name) for f in fields(EngineConfig)}
    return EngineConfig(**{**values, "model": model_dir})


def local_model_dir(config: ServeConfig) -> str:
    """`--model` as a directory: hf:// and s3:// are fetched first (into HF_HOME's cache)."""
    source = config.source
    return str(fetch(source, None).path) if source.is_fetched else config.model


def cache_info(config: ServeConfig, core: Engine) -> CacheInfo:
    return CacheInfo(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=core.block_manager.num_total_blocks,
        cache_dtype=config.kv_cache_dtype,
        enable_prefix_caching=config.enable_prefix_caching,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )


class Ticket:
    """One admitted request's sequences in the in-flight count; `release` is idempotent."""

    def __init__(self, state: ServerState, num_seqs: int = 1):
        self.state, self.num_seqs, self.is_released = state, num_seqs, False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.state.num_in_flight -= self.num_seqs
            if self.state.num_in_flight == 0:
                self.state.idle.set()


def engine_choices(core: Engine, threads: ThreadChoice) -> EngineChoices:
    per_rank = rank_share(threads, core.config.tensor_parallel_size)
    return EngineChoices(
        device=str(core.device),
        threads=per_rank.num_threads,
        threads_source=per_rank.source,
        dtype=dtype_name(core.dtype),
        cpu_has_bf16=core.cpu_has_bf16,
        quantization=core.config.quantization,
        checkpoint_quantization=describe_checkpoint(core.model_config.checkpoint_quant),
        int8_kernel=core.int8_kernel,
        cpu_has_int8_dot=core.cpu_has_int8_dot,
        attention_backend=core.attention_backend,
        attention_source=core.attention_source,
        kv_cache_dtype=dtype_name(core.kv_dtype),
        kv_cache_bytes=sum(k.data.nbytes + v.data.nbytes for k, v in core.runner.kv_caches),
        kv_cache_blocks=core.block_manager.num_total_blocks,
        kv_cache_source=core.kv_budget_source,
        weight_bytes=core.weight_bytes,
        speculative=describe_speculative(core.speculative),
    )


def describe_speculative(config: SpeculativeConfig | None) -> str:
    if config is None:
        return "off"
    where = (
        f"lookup {config.prompt_lookup_min}-{config.prompt_lookup_max}"
        if config.model is None
        else f"draft {config.model}"
    )
    return f"{config.method}, up to {config.num_speculative_tokens} token(s), {where}"


def describe_checkpoint(quant: CheckpointQuant | None) -> str | None:
    return None if quant is None else quant.describe()


def weights_note(choices: EngineChoices) -> str:
    """What the weights are: the level, or the checkpoint's own quantisation."""
    if choices.checkpoint_quantization is not None:
        return f"pre-quantised {choices.checkpoint_quantization}"
    return f"{choices.quantization}{int8_note(choices)}"


def int8_note(choices: EngineChoices) -> str:
    if choices.quantization != "int8":
        return ""
    dot = "yes" if choices.cpu_has_int8_dot else "no"
    return f" ({choices.int8_kernel}; CPU int8 dot products: {dot})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_choices(choices: EngineChoices) -> str:
    """The start-up log line: what was chosen for this machine, and from what."""
    return (
        f"{choices.device}, {choices.threads} thread(s) ({choices.threads_source}), "
        f"{choices.dtype} compute (CPU bf16 units: {'yes' if choices.cpu_has_bf16 else 'no'}), "
        f"weights {weights_note(choices)} "
        f"{choices.weight_bytes / 2**20:.0f} MiB, KV cache {choices.kv_cache_dtype} "
        f"{choices.kv_cache_bytes / 2**20:.0f} MiB in {choices.kv_cache_blocks} blocks of "
        f"{BLOCK_SIZE} tokens ({choices.kv_cache_source}), decode attention "
        f"{choices.attention_backend} ({choices.attention_source}), speculative decoding "
        f"{choices.speculative}"
    )


class ServerState:
    def __init__(
        self,
        config: ServeConfig,
        engine: AsyncEngine | None = None,
        threads: ThreadChoice | None = None,
        startup: StartupClock | None = None,
    ):
        self.config = config
        # The process's start-up phases (server/startup.py); a state built without a server
        # starts its clock here.
        self.startup = startup or StartupClock(time.time())
        # What `run` set torch to; a state built without a server keeps torch's own choice.
        self.threads = threads or ThreadChoice(torch.get_num_threads(), "torch default")
        self.choices: EngineChoices | None = None
        self.served_name = config.served_name
        self.engine = engine
        self.engine_core: Engine | None = engine.engine if engine else None
        self.max_model_len = self.engine_core.max_model_len if self.engine_core else 0
        self.is_draining = False
        self.load_error: str | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        self.num_in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.active: set[str] = set()  # request ids in the engine, for abort at drain timeout
        self.metrics = ServerMetrics(config.served_name, self.engine_stats, self.startup.seconds)
        # Tokenising and rendering chat templates run here, off the event loop, so /health and
        # running streams are not held up by a long prompt. Two threads: the work is bounded by
        # the character check and mostly GIL-free (models/tokenizer_files.py), and more threads
        # would only compete with the engine's step thread for the GIL.
        self.prompt_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpilot-prompt")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)

    async def load(self) -> None:
        """Load the model off the event loop so /health answers meanwhile."""
        try:
            model_dir = await asyncio.to_thread(local_model_dir, self.config)
            config = engine_config(self.config, model_dir)
            self.startup.mark("model_located")
            # built on its stepping thread (engine/async_engine.py); it marks kernel and weights
            engine = await AsyncEngine.create(lambda: Engine(config, self.startup.mark))
            await asyncio.to_thread(self._load_lora_modules, engine.engine)
        except Exception as exc:  # any load failure ends the process with its message
            self.load_error = f"cannot load model {self.config.model}: {exc}"
            log.error(self.load_error)
            self.on_fatal()
            return
        core = engine.engine
        engine.add_step_listener(self.metrics.on_step)
        self.metrics.on_engine_ready(core.max_model_len, cache_info(self.config, core))
        await engine.start()
        self.startup.mark("warmup")
        self.choices = engine_choices(core, self.threads)
        self.startup.mark("serving")  # /ready answers 200 from the next line on
        self.engine_core, self.max_model_len, self.engine = core, core.max_model_len, engine
        log.info("model %s loaded; ready: %s", self.served_name, describe_choices(self.choices))
        log.info("start-up %s", describe(self.startup.seconds()))

    def _load_lora_modules(self, core: Engine) -> None:
        """--lora-modules, each fetched and checked: one that cannot be served fails the start."""
        for name, uri in self.config.lora_adapters:
            try:
                lora_serving.load(
                    core, self.config.served_name, name, uri, self.config.adapter_dirs
                )
            except ApiError as exc:
                raise ValueError(f"--lora-modules {name}={uri}: {exc.message}") from exc
            self.metrics.start_lora_series(name)

    async def close(self) -> None:
        self.prompt_pool.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            await self.engine.stop()
        if self.engine_core is not None:
            self.engine_core.shutdown()  # reaps the tensor-parallel workers, if any

    def engine_stats(self) -> EngineStats:
        return self.engine.stats() if self.engine is not None else EngineStats.idle()

    def check_request_size(self, num_prompts: int, n: int) -> None:
        """400 for a request of more sequences (prompts x n) than one may hold
        (ServeConfig.request_seq_limit): admitted, it would fill the queue alone, and every
        other request would get 429 for as long as it ran."""
        limit, num_seqs = self.config.request_seq_limit, num_prompts * n
        if num_seqs > limit:
            raise ApiError(
                400,
                f"n: this request asks for {num_seqs} sequences ({num_prompts} prompt(s) x n "
                f"{n}), more than the {limit} one request may hold on this server "
                "(--max-seqs-per-request, at most --max-num-seqs + --max-waiting); "
                "send fewer prompts or a smaller n per request",
                "n",
                code="too_many_sequences",
            )

    def admit(self, num_seqs: int = 1) -> Ticket:
        """A place for one request of `num_seqs` sequences (n choices x prompts), or 429 when
        they would queue past --max-waiting.

        Counted in sequences from the server's own in-flight number, not the engine's last-step
        snapshot, so a burst between two steps cannot overshoot: at most max_num_seqs +
        max_waiting sequences (and their prompts) are ever held. A request larger than one may
        hold was refused before (check_request_size), so none takes the whole queue alone.
        """
        if self.engine is None:
            raise ApiError(503, "model is still loading")
        num_queued = self.num_in_flight - self.config.max_num_seqs
        if num_queued + num_seqs > self.config.max_waiting:
            raise ApiError(429, f"server overloaded: {num_queued} sequences already waiting")
        self.num_in_flight += num_seqs
        self.idle.clear()
        return Ticket(self, num_seqs)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let accepted requests finish, abort what is left at the timeout."""
        self.is_draining = True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
            return
        except TimeoutError:
            log.warning("drain timeout: aborting %d requests", len(self.active))
        if self.engine is not None:
            for request_id in list(self.active):
                self.engine.abort(request_id)
        try:  # aborted requests end within a step or two
            await asyncio.wait_for(self.idle.wait(), 10)
        except TimeoutError:
            log.warning("requests still open after abort; exiting anyway")
