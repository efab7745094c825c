"""Keys from a Kubernetes Secret (`--keys-secret NAMESPACE/NAME`): its `keys.yaml` holds `keys:`
(by `keySha256`, so the Secret never holds a usable key) and `teams:`, as in the static config.

A Secret, not a CRD: keys are credentials (RBAC on Secrets already guards them, and they are
kept encrypted at rest where the cluster does), a change is one `kubectl apply` of a file the
team already writes for the static gateway, and the gateway re-reads it every `--keys-refresh`
seconds. A Secret that cannot be read or parsed keeps the keys last read (logged), so a typo
never opens or closes the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable

import yaml
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpilot.gateway.budget.config import KeysDocument, key_book
from kvpilot.gateway.budget.keys import KeyRing
from kvpilot.gateway.config import ConfigError, describe
from kvpilot.gateway.kube import discovery

log = logging.getLogger("kvpilot.gateway.keys")

KEYS_FILE = "keys.yaml"  # the key of the keys Secret


def secret_name(value: str) -> tuple[str, str]:
    namespace, _, name = value.partition("/")
    if not namespace or not name:
        raise ValueError(f"--keys-secret {value!r} must be NAMESPACE/NAME")
    return namespace, name


def secret_refresher(args: argparse.Namespace, ring: KeyRing) -> Callable[[], Awaitable[None]]:
    namespace, name = secret_name(args.keys_secret)
    api = k8s_client.CoreV1Api(discovery.api_client(args.kubeconfig))

    def read() -> str:
        secret = api.read_namespaced_secret(name, namespace, _request_timeout=10)
        encoded = (secret.data or {}).get(KEYS_FILE)
        if encoded is None:
            raise ConfigError(f"Secret {namespace}/{name} has no {KEYS_FILE!r} key")
        return base64.b64decode(encoded).decode()

    async def refresh_forever() -> None:
        source = f"Secret {namespace}/{name} {KEYS_FILE}"
        while True:
            try:
                text = await asyncio.to_thread(read)
            except (ApiException, ConfigError, OSError) as error:
                log.error("keeping the keys last read: %s", error)
            else:
                apply_keys(text, ring, source)
            await asyncio.sleep(args.keys_refresh)

    return refresh_forever


def apply_keys(text: str, ring: KeyRing, source: str) -> bool:
    """The keys `text` holds replace the ring's; a bad document keeps the last ones (logged)."""
    try:
        document = parse_keys_document(text, source)
        ring.replace(key_book(document.keys, document.teams))
    except (ConfigError, ValueError) as error:
        log.error("keeping the keys last read: %s", error)
        return False
    return True


def parse_keys_document(text: str, source: str) -> KeysDocument:
    try:
        return KeysDocument.model_validate(yaml.safe_load(text) or {})
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not YAML ({error})") from None
    except ValidationError as error:
        raise ConfigError(f"{source}: {describe(error)}") from None
