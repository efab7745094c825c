"""Requests that match no endpoint: an OpenAI-shaped error that says which endpoints there are
(aiohttp's own answer is a plain-text "404: Not Found", which the openai client shows as it is).
A client aimed at an API the gateway does not proxy (/v1/embeddings, /v1/responses) learns what
it can call instead; a wrong method, which one to use."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping

from aiohttp import web

from kvpilot.gateway.upstream import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def unknown_route(method: str, path: str, routes: Mapping[str, Collection[str]]) -> str:
    """The message for `method path` given `routes` (path -> its methods)."""
    methods = routes.get(path)
    if methods:
        return f"{method} {path} is not served; use {' or '.join(sorted(methods))} {path}"
    openai = sorted((p, m) for p, ms in routes.items() if p.startswith("/v1/") for m in ms)
    endpoints = ", ".join(f"{m} {p}" for p, m in openai)
    return f"{method} {path} is not an endpoint of this gateway; its OpenAI endpoints: {endpoints}"


def routes_of(app: web.Application) -> dict[str, set[str]]:
    """Each path the app answers, with its methods (HEAD left out: aiohttp adds it to GET)."""
    routes: dict[str, set[str]] = {}
    for route in app.router.routes():
        if route.resource is not None and route.method != "HEAD":
            routes.setdefault(route.resource.canonical, set()).add(route.method)
    return routes


@web.middleware
async def explain_unknown_routes(request: web.Request, handler: Handler) -> web.StreamResponse:
    unmatched = request.match_info.http_exception
    if unmatched is None or unmatched.status not in (404, 405):
        return await handler(request)
    message = unknown_route(request.method, request.path, routes_of(request.app))
    response = error_response(unmatched.status, message)
    if "Allow" in unmatched.headers:
        response.headers["Allow"] = unmatched.headers["Allow"]
    return response
