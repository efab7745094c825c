"""A stand-in for kube-proxy on the dev cluster: one local port in front of a Service's pods.

Pod IPs of the local pool are loopback addresses, but Service IPs route nowhere on this machine,
so tests and the demo reach a Service through this proxy. It balances requests round-robin over
the *ready* endpoints of the Service's EndpointSlices (refreshed every REFRESH_S), as kube-proxy
does; terminating or not-ready pods get no new requests. Responses, SSE streams included, are
relayed chunk by chunk.

    python -m hack.serviceproxy --kubeconfig K --namespace NS --service NAME --port N
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web
from kubernetes import client, config

REFRESH_S = 0.5
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def ready_endpoints(slices: list[dict[str, Any]], port_name: str | None) -> list[str]:
    """host:port of every ready endpoint (pure: EndpointSlice documents in, addresses out)."""
    found = []
    for item in slices:
        ports = item.get("ports") or []
        port = next((p["port"] for p in ports if port_name in (None, p.get("name"))), None)
        if port is None:
            continue
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") and not conditions.get("terminating"):
                found += [f"{address}:{port}" for address in endpoint.get("addresses", [])]
    return sorted(found)


class ServiceProxy:
    def __init__(
        self, api: client.ApiClient, namespace: str, service: str, port_name: str | None
    ) -> None:
        self.discovery = client.DiscoveryV1Api(api)
        self.namespace, self.service, self.port_name = namespace, service, port_name
        self.endpoints: list[str] = []
        self.cycle = itertools.cycle([""])

    async def refresh_forever(self) -> None:
        while True:
            slices = await asyncio.to_thread(self.list_slices)
            endpoints = ready_endpoints(slices, self.port_name)
            if endpoints != self.endpoints:
                self.endpoints, self.cycle = endpoints, itertools.cycle(endpoints)
                print(f"serviceproxy: {self.service} -> {endpoints}", flush=True)
            await asyncio.sleep(REFRESH_S)

    def list_slices(self) -> list[dict[str, Any]]:
        selector = f"kubernetes.io/service-name={self.service}"
        items = self.discovery.list_namespaced_endpoint_slice(
            self.namespace, label_selector=selector
        ).items
        return [self.discovery.api_client.sanitize_for_serialization(i) for i in items]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if not self.endpoints:
            return web.json_response(
                {
                    "error": {
                        "message": f"service {self.service} has no ready endpoints",
                        "type": "unavailable",
                    }
                },
                status=503,
            )
        target = f"http://{next(self.cycle)}{request.rel_url}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        session: ClientSession = request.app["session"]
        try:
            async with session.request(
                request.method, target, headers=headers, data=await request.read()
            ) as upstream:
                return await relay(request, upstream)
        except (TimeoutError, ClientError) as err:
            return web.json_response(
                {"error": {"message": f"upstream {target}: {err}", "type": "bad_gateway"}},
                status=502,
            )


async def relay(request: web.Request, upstream: Any) -> web.StreamResponse:
    response = web.StreamResponse(
        status=upstream.status,
        headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP},
    )
    await response.prepare(request)
    async for chunk in upstream.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


async def serve(proxy: ServiceProxy, port: int) -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["session"] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=5))
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"serviceproxy: listening on http://127.0.0.1:{port}", flush=True)
    try:
        await proxy.refresh_forever()
    finally:
        await app["session"].close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.serviceproxy")
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--service", required=True)
    parser.add_argument("--port-name", default=None, help="Service port name (default: first)")
    parser.add_argument("--port", type=int, required=True, help="local port to listen on")
    args = parser.parse_args(argv)
    api = config.new_client_from_config(config_file=str(args.kubeconfig))
    proxy = ServiceProxy(api, args.namespace, args.service, args.port_name)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(proxy, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
