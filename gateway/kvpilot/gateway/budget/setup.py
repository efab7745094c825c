"""Flags and config -> the keys and budget policies (cli.py puts them first and last in the list).

Keys come from the static config's `keys:`/`teams:`, or with `--keys-secret NS/NAME` from the
`keys.yaml` of a Kubernetes Secret (re-read every `--keys-refresh` seconds). The store is Redis
when `--redis-url` (or the config's `redis.url`) is given, else this process's memory. Prices per
model come from the config's `prices:`, else from the route (a ModelDeployment's measured cost);
a provider fallback's from `prices:` under its name (`<model>/<index>`, as `x-kvpilot-target`
says). The gateway is ready (`/ready`) only while the store answers, unless it fails open.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvpilot.gateway.budget.arithmetic import Price
from kvpilot.gateway.budget.config import KeysDocument, key_book, prices
from kvpilot.gateway.budget.keys import KeyRing, KeysPolicy
from kvpilot.gateway.budget.policy import BudgetOptions, BudgetPolicy
from kvpilot.gateway.budget.store import BudgetStore, MemoryStore, RedisStore, StoreError
from kvpilot.gateway.config import ConfigError, GatewayConfig, describe
from kvpilot.gateway.exchange import Policy
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.routes import Fallback, RouteTable

log = logging.getLogger("kvpilot.gateway.keys")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="redis://HOST:PORT/DB: budgets (and the cache) shared by every "
                        "gateway replica; default: this process's memory")  # fmt: skip
    parser.add_argument("--budget-on-store-error", choices=["closed", "open"], default="closed",
                        help="Redis down: refuse requests with 503 (closed, default) or admit "
                        "them unreserved (open)")  # fmt: skip
    parser.add_argument("--budget-default-max-tokens", type=int,
                        default=BudgetOptions.default_max_tokens,
                        help="max_tokens sent (and reserved) for a request under a token limit "
                        "that gave none")  # fmt: skip
    parser.add_argument("--keys-secret", default=None,
                        help="NAMESPACE/NAME of a Secret whose keys.yaml holds keys: and teams: "
                        "(Kubernetes)")  # fmt: skip
    parser.add_argument("--keys-refresh", type=float, default=10.0,
                        help="seconds between reads of --keys-secret")  # fmt: skip


@dataclass
class BudgetSettings:
    document: KeysDocument = field(default_factory=KeysDocument)
    redis_url: str | None = None
    prices: dict[str, Price] = field(default_factory=dict)


def read_settings(config_path: Path | None) -> BudgetSettings:
    """The budget parts of the static config (none without one)."""
    if config_path is None:
        return BudgetSettings()
    try:
        config = GatewayConfig.model_validate(yaml.safe_load(config_path.read_text()))
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read the gateway config {config_path}: {error}") from None
    except ValidationError as error:
        raise ConfigError(f"{config_path}: {describe(error)}") from None
    document = KeysDocument(keys=config.keys, teams=config.teams)
    url = config.redis.url if config.redis else None
    return BudgetSettings(document, url, prices(config.prices))


def price_lookup(static: dict[str, Price], table: RouteTable) -> Callable[[str], Price | None]:
    def price_of(model: str) -> Price | None:
        route = table.get(model)
        return static.get(model) or (route.price if route is not None else None)

    return price_of


def fallbacks_lookup(table: RouteTable) -> Callable[[str], tuple[Fallback, ...]]:
    def fallbacks_of(model: str) -> tuple[Fallback, ...]:
        route = table.get(model)
        return route.fallbacks if route is not None else ()

    return fallbacks_of


@dataclass
class Budgets:
    """The two policies and what runs alongside them (the Secret refresh, the store)."""

    keys: KeysPolicy
    budget: BudgetPolicy
    store: BudgetStore
    refresh: Callable[[], Any] | None = None  # async: re-read the keys Secret

    def policies(self) -> tuple[Policy, Policy]:
        return self.keys, self.budget

    async def running(self, _: Any) -> AsyncIterator[None]:
        """An aiohttp cleanup context: the Secret refresh runs while the app does."""
        task = asyncio.ensure_future(self.refresh()) if self.refresh is not None else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.store.close()

    async def unready(self) -> str | None:
        """Why the gateway cannot serve keyed requests now (None: it can): a budget store that
        does not answer, while requests are refused for it (failing closed)."""
        if self.budget.options.fail_open:
            return None
        try:
            await self.store.ping()
        except StoreError as error:
            return (f"the budget store does not answer ({error}), so every request with a key "
                    "is refused with 503 until it does")  # fmt: skip
        return None


def build(args: argparse.Namespace, table: RouteTable, metrics: GatewayMetrics) -> Budgets | None:
    """The keys and budget policies, or None when no key is configured (an open gateway)."""
    if args.budget_default_max_tokens <= 0:
        raise ValueError(
            f"--budget-default-max-tokens must be > 0, got {args.budget_default_max_tokens}"
        )
    settings = read_settings(args.config)
    if not settings.document.keys and args.keys_secret is None:
        return None
    ring = KeyRing(key_book(settings.document.keys, settings.document.teams))
    url = args.redis_url or settings.redis_url
    store: BudgetStore = RedisStore(url) if url else MemoryStore()
    options = BudgetOptions(args.budget_default_max_tokens, args.budget_on_store_error == "open")
    budget = BudgetPolicy(store, metrics, price_lookup(settings.prices, table), options,
                          fallbacks_lookup(table))  # fmt: skip
    refresh = None
    if args.keys_secret is not None:
        # Imported here: the Kubernetes client only for keys from a Secret.
        from kvpilot.gateway.kube.keys_secret import secret_refresher

        refresh = secret_refresher(args, ring)
    return Budgets(KeysPolicy(ring), budget, store, refresh)
