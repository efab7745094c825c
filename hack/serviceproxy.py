"""A stand-in for kube-proxy on the dev cluster: one local port in front of a Service's pods.

Pod IPs of the local pool are loopback addresses, but Service IPs route nowhere on this machine,
so tests and the demo reach a Service through this proxy. It balances requests round-robin over
the *ready* pods the Service selects (refreshed every REFRESH_S), as kube-proxy does with
EndpointSlices; terminating or not-ready pods get no new requests. The apiserver refuses
loopback addresses in EndpointSlices, so the proxy reads the pods themselves. Responses, SSE
streams included, are relayed chunk by chunk.

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
from kubernetes.client.exceptions import ApiException

REFRESH_S = 0.5
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def target_port(service: dict[str, Any], port_name: str | None) -> int | str:
    ports = (service.get("spec") or {}).get("ports") or []
    chosen = next((p for p in ports if port_name in (None, p.get("name"))), None)
    if chosen is None:
        raise ValueError(f"service has no port named {port_name!r}")
    return chosen.get("targetPort") or chosen["port"]


def ready_endpoints(pods: list[dict[str, Any]], port: int | str) -> list[str]:
    """host:port of every ready, non-terminating pod (pure: pod documents in, addresses out)."""
    found = []
    for pod in pods:
        status, meta = pod.get("status") or {}, pod.get("metadata") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if not ready or meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        number = port if isinstance(port, int) else container_port(pod, port)
        if number is not None:
            found.append(f"{status['podIP']}:{number}")
    return sorted(found)


def container_port(pod: dict[str, Any], name: str) -> int | None:
    if name.isdigit():
        return int(name)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return int(port["containerPort"])
    return None


class ServiceProxy:
    def __init__(
        self, api: client.ApiClient, namespace: str, service: str, port_name: str | None
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace, self.service, self.port_name = namespace, service, port_name
        self.endpoints: list[str] = []
        self.cycle = itertools.cycle([""])

    async def refresh_forever(self) -> None:
        while True:
            endpoints = await asyncio.to_thread(self.list_endpoints)
            if endpoints != self.endpoints:
                self.endpoints, self.cycle = endpoints, itertools.cycle(endpoints)
                print(f"serviceproxy: {self.service} -> {endpoints}", flush=True)
            await asyncio.sleep(REFRESH_S)

    def list_endpoints(self) -> list[str]:
        try:
            found = self.core.read_namespaced_service(self.service, self.namespace)
        except ApiException as error:
            if error.status == 404:  # not made yet (the operator makes a new model's Service
                return []  # after its Deployment) or deleted: no endpoints, as kube-proxy has
            raise
        service = self.core.api_client.sanitize_for_serialization(found)
        selector = ",".join(f"{k}={v}" for k, v in service["spec"].get("selector", {}).items())
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        documents = [self.core.api_client.sanitize_for_serialization(p) for p in pods]
        return ready_endpoints(documents, target_port(service, self.port_name))

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
