"""`kvpilot-runtime serve`: the OpenAI-compatible HTTP API over the engine (DESIGN.md §3.4).

This module only translates HTTP to engine calls: validation is in server/request_models.py, chat
rendering in server/chat_template.py, metrics in metrics.py, request handling in handling.py and
server/rendering.py. The lifecycle is what Kubernetes expects: the port opens at once (/health
answers while the model loads), /ready turns 200 when the engine runs; SIGTERM drains (/ready and
new requests 503, in-flight requests finish, exit 0).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any, TypeVar

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvpilot.contract.serve_config import ServeConfig, parse_args
from kvpilot.runtime.engine import machine_files
from kvpilot.runtime.engine.draft_model import check_before_start
from kvpilot.runtime.engine.machine import ThreadChoice
from kvpilot.runtime.server import handling, lora_serving, tokenizing
from kvpilot.runtime.server.body_parsing import off_loop_body_route
from kvpilot.runtime.server.errors import ApiError, error_response, unknown_route
from kvpilot.runtime.server.input_limits import BodyReadTimeout, BodySizeLimit
from kvpilot.runtime.server.job import Job
from kvpilot.runtime.server.lifecycle import ServerState
from kvpilot.runtime.server.request_checks import describe_validation_error
from kvpilot.runtime.server.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from kvpilot.runtime.server.response_models import (
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    StartupReport,
    TokenizeResponse,
    VersionResponse,
)
from kvpilot.runtime.server.startup import StartupClock

log = logging.getLogger("kvpilot.server")
VERSION = importlib.metadata.version("kvpilot")
ERRORS: dict[int | str, dict] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}
# The body of a completion or a chat; generate's `prepare` must take the same one
GenerateBody = TypeVar("GenerateBody", CompletionRequest, ChatCompletionRequest)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.startup.mark("http")  # uvicorn binds the port as this yields
        loader = asyncio.create_task(state.load())
        try:
            yield
        finally:
            loader.cancel()
            await state.close()

    app = FastAPI(title="kvpilot runtime", version=VERSION, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=state.config.max_request_body_bytes)
    app.add_middleware(BodyReadTimeout, timeout_s=state.config.request_body_timeout)
    app.router.route_class = off_loop_body_route(state.off_loop)  # before the routes are added
    add_error_handlers(app)
    add_routes(app, state)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(ApiError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            message = unknown_route(request.method, request.url.path, endpoints(app))
        return error_response(ApiError(exc.status_code, message), dict(exc.headers or {}))

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientDisconnect)
    async def on_gone(request: Request, _: ClientDisconnect) -> Response:
        # a client may hang up at any time: one line, not a traceback; nobody reads the answer
        log.info("client went away during the upload of %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> JSONResponse:  # a bug, or the engine failed
        log.exception("internal error", exc_info=exc)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def endpoints(app: FastAPI) -> dict[str, set[str]]:
    """Each path this server answers ("/v1/models/{model_id}"), with its methods (HEAD left out:
    it follows GET)."""
    return {
        r.path_format: set(r.methods or ()) - {"HEAD"}
        for r in app.routes
        if isinstance(r, APIRoute)
    }


def check_request(request: Request, state: ServerState, model: str | None) -> None:
    """Auth, drain, load and model-name checks common to every /v1 endpoint."""
    key = state.config.api_key
    if key is not None:
        # RFC 7235: the scheme is case-insensitive (`bearer KEY` is `Bearer KEY`)
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        is_bearer = scheme.lower() == "bearer"
        if not (secrets.compare_digest(token.strip().encode(), key.encode()) and is_bearer):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")
    if state.is_draining:
        raise ApiError(503, "server is shutting down; retry on another replica")
    if state.engine is None:
        raise ApiError(503, "model is still loading")
    is_adapter = model is not None and lora_serving.is_served(state.engine_core, model)
    if model is not None and model != state.config.served_name and not is_adapter:
        raise lora_serving.model_not_found(model, state.served_name)


def add_routes(app: FastAPI, state: ServerState) -> None:
    # HEAD too: load balancers and uptime checks probe with it
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/ready", methods=["GET", "HEAD"], responses={503: {"model": ErrorResponse}})
    async def ready() -> JSONResponse:
        if state.engine is None or state.is_draining:
            reason = "draining" if state.is_draining else "loading"
            return error_response(ApiError(503, f"not ready: {reason}"))
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=ERRORS)
    async def models(request: Request) -> ModelList:
        check_request(request, state, None)
        return ModelList(data=model_cards(state))

    @app.get("/v1/models/{model_id:path}", responses=ERRORS)  # ids may hold a "/"
    async def model(model_id: str, request: Request) -> ModelCard:
        check_request(request, state, model_id)  # 404 model_not_found for another id
        return next(card for card in model_cards(state) if card.id == model_id)

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, state, body, handling.prepare_completion)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, state, body, handling.prepare_chat)

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        check_request(request, state, body.model)
        tok = handling.tokenizer_of(state)
        return await state.off_loop(tokenizing.tokenize, tok, body, state.max_model_len)

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        check_request(request, state, body.model)
        return await state.off_loop(tokenizing.detokenize, handling.tokenizer_of(state), body)

    @app.get("/version")
    async def version() -> VersionResponse:
        startup = StartupReport(started_at=state.startup.started_at, phases=state.startup.seconds())
        return VersionResponse(version=VERSION, engine=state.choices, startup=startup)

    if state.config.enable_lora and lora_serving.runtime_updates_allowed():
        add_lora_routes(app, state)


def model_cards(state: ServerState) -> list[ModelCard]:
    """The base model, then each loaded LoRA adapter with the base as its parent (vLLM's form)."""
    base = ModelCard(
        id=state.served_name, root=state.config.model, max_model_len=state.max_model_len
    )
    registry = state.engine_core.lora_registry if state.engine_core is not None else None
    adapters = registry.adapters() if registry is not None else []
    return [base] + [
        ModelCard(
            id=a.name, root=a.uri, parent=state.served_name, max_model_len=state.max_model_len
        )
        for a in adapters
    ]


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's run-time adapter endpoints, their bodies, answers and status codes."""

    @app.post("/v1/load_lora_adapter", responses=ERRORS)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
        check_request(request, state, None)
        core = handling.core_of(state)
        await state.off_loop(
            lora_serving.load,
            core,
            state.served_name,
            body.lora_name,
            body.lora_path,
            state.config.adapter_dirs,
        )
        state.metrics.start_lora_series(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=ERRORS)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
        check_request(request, state, None)
        lora_serving.unload(handling.core_of(state), body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def generate(
    request: Request,
    state: ServerState,
    body: GenerateBody,
    prepare: Callable[[ServerState, GenerateBody], Job],
) -> Response:
    """A completion or a chat: the request's checks, its job prepared off the event loop (the
    tokenizer is slow on long text) and its grammar compiled, all before it is admitted."""
    check_request(request, state, body.model)
    state.check_request_size(body.num_prompts(), body.n)  # before its prompts are tokenised
    job = await state.off_loop(prepare, state, body)
    job.lora = await state.off_loop(
        lora_serving.lora_for, handling.core_of(state), state.served_name, body.model
    )
    if job.lora is not None:
        state.metrics.record_lora_received(job.lora.name, len(job.choices))
    await handling.check_grammar(state, job)
    return await respond(request, state, job)


async def respond(request: Request, state: ServerState, job: Job) -> Response:
    ticket = state.admit(len(job.choices))  # 429 past --max-waiting; released exactly once
    if job.stream:
        stream = handling.stream_events(state, job, ticket)
        return StreamingResponse(
            stream, media_type="text/event-stream", background=BackgroundTask(ticket.release)
        )
    try:
        work = asyncio.ensure_future(handling.collect(state, job))
        body = await until_disconnect(request, work)
    finally:
        ticket.release()
    if body is None:  # client went away: nobody to answer; the sequence was aborted
        return Response(status_code=499)
    return JSONResponse(body)


async def until_disconnect(request: Request, work: asyncio.Future[Any]) -> Any:
    """Await `work` unless the client disconnects first; then cancel it (aborting the sequence)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher: asyncio.Future[Any] = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return None


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first instead of closing the listener at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
            return
        if self.drain_task is None:  # a repeated SIGTERM changes nothing; SIGKILL will follow
            # signal handlers run on the main thread, which is the one running the event loop
            asyncio.get_running_loop().call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.state.is_draining = True  # now, so no request parsed after the signal slips in
        self.drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        log.info("SIGTERM: draining (timeout %.0fs)", self.state.config.shutdown_timeout)
        await self.state.drain(self.state.config.shutdown_timeout)
        self.should_exit = True


def main(argv: list[str] | None = None, clock: StartupClock | None = None) -> int:
    """`clock`: the start-up's, begun before this module's imports (server/serve.py)."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        threads = machine_files.thread_choice(config.threads)  # --threads above the cores
        check_before_start(config.speculative(), config.model)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvpilot-runtime serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    return run(config, threads, clock or StartupClock.of_this_process())


def run(config: ServeConfig, threads: ThreadChoice, clock: StartupClock) -> int:
    # Before any thread computes: torch's threads read this count when they first run a kernel.
    torch.set_num_threads(threads.num_threads)
    state = ServerState(config, threads=threads, startup=clock)
    app = build_app(state)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    server = DrainingServer(uv_config, state)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.load_error is not None:
        print(f"kvpilot-runtime serve: {state.load_error}", file=sys.stderr)
        return 1
    return 0
