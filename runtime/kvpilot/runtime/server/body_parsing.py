"""Large JSON bodies are decoded and validated off the event loop.

FastAPI decodes a body with json.loads and validates it with pydantic on the event loop: for a
16 MiB body of token ids that is ~0.7 s in which /health and every stream wait. `OffLoopBodyRoute`
does both on the server's prompt threads when a body is over `OFF_LOOP_MIN_BYTES`, and hands
FastAPI the validated model, which it takes as it is (pydantic does not revalidate an instance of
the model). Small bodies take FastAPI's own path: a thread hop would cost more than it saves.
Errors keep FastAPI's shapes (RequestValidationError, loc under "body"), so the 400s are the same
either way; the body size limit (input_limits.BodySizeLimit) applies before any of this.

Small JSON bodies are decoded by `parse_body` too, on the loop: json.loads raises RecursionError,
not JSONDecodeError, for JSON nested deeper than Python's stack (`"[" * 262144`), which FastAPI
would answer with a vague 400 and an off-loop parse with a 500; one parser gives one clear 400. A
client that goes away mid-upload ends the request here (`ClientDisconnect`, see server/app.py).
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from kvpilot.runtime.server.request_checks import MAX_JSON_DEPTH

TOO_DEEP = (
    f"JSON nested more than {MAX_JSON_DEPTH} levels deep; send a body whose arrays and objects "
    f"nest at most {MAX_JSON_DEPTH} levels"
)
NOT_TEXT = "the body is not UTF-8 text; send JSON encoded as UTF-8"
# ~10 ms of decoding and validation on a slow CPU: below this the event loop barely notices.
OFF_LOOP_MIN_BYTES = 256 * 1024

RunOffLoop = Callable[..., Awaitable[Any]]


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI would decode a body of this content type as JSON (none counts as JSON)."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def parse_int(digits: str) -> int:
    """json's integer hook, in Python so that the decoder gives up the GIL as it goes."""
    return int(digits)


def json_invalid(pos: int, message: str) -> dict[str, Any]:
    """A JSON decoding error as FastAPI reports one."""
    return {"type": "json_invalid", "loc": ("body", pos), "msg": message, "input": {}}


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """`raw` decoded and validated as `model`; RequestValidationError as FastAPI raises it.

    json.loads is one C call that holds the GIL throughout: on another thread it would still stop
    the event loop (0.3-2 s for 16 MiB of token ids). Its integer hook, as Python code, lets the
    interpreter switch threads every few ms, at ~2x the decoding time; strings, the bulk of a text
    body, are decoded in C as before.
    """
    try:
        data = json.loads(raw, parse_int=parse_int)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([json_invalid(exc.pos, "JSON decode error")]) from exc
    except RecursionError as exc:  # deeper than the stack; MAX_JSON_DEPTH refuses the rest
        raise RequestValidationError([json_invalid(0, TOO_DEEP)]) from exc
    except UnicodeDecodeError as exc:  # json.loads guesses UTF-8/16/32 from the first bytes
        raise RequestValidationError([json_invalid(exc.start, NOT_TEXT)]) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [
            {**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)
        ]
        raise RequestValidationError(errors) from exc


def body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model a route takes as its whole JSON body, if it takes one."""
    params = route.dependant.body_params
    if len(params) != 1:
        return None
    annotation = params[0].field_info.annotation
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def off_loop_body_route(run_off_loop: RunOffLoop) -> type[APIRoute]:
    """An APIRoute class whose large JSON bodies are parsed by `run_off_loop(fn, *args)`."""

    class OffLoopBodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handle = super().get_route_handler()
            model = body_model(self)
            if model is None:
                return handle

            async def handle_parsed_body(request: Request) -> Response:
                raw = await request.body()  # kept by the request: FastAPI reads it from there
                if raw and is_json(request.headers.get("content-type")):
                    # Starlette's Request.json() returns what it finds in _json; FastAPI then
                    # validates our model instance, which pydantic passes through unchanged.
                    if len(raw) >= OFF_LOOP_MIN_BYTES:
                        request._json = await run_off_loop(parse_body, model, raw)
                    else:
                        request._json = parse_body(model, raw)
                return await handle(request)

            return handle_parsed_body

    return OffLoopBodyRoute
