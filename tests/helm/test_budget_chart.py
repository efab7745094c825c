"""The chart's gateway keys, budgets and cache (gateway.keysSecret, gateway.redisUrl,
gateway.cacheStore) rendered by the real helm: the flags the gateway CLI parses, and `get` on
that one Secret only."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvpilot.gateway import cli
from kvpilot.gateway.budget import setup as budget_setup
from tests.support.helm_chart import container, find, render, require

pytestmark = pytest.mark.slow  # runs helm (and kubeconform) on the chart


@pytest.fixture(scope="module")
def helm_bin(helm_binary: Path) -> Path:
    return require(helm_binary)


def gateway_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--discovery")
    parser.add_argument("--port")
    cli.add_discovery_arguments(parser)
    budget_setup.add_arguments(parser)
    parsed, unknown = parser.parse_known_args(args)
    assert unknown == []
    return parsed


def test_keys_secret_and_redis_become_flags_and_one_secret_rule(helm_bin: Path) -> None:
    values = {"gateway.keysSecret": "gateway-keys", "gateway.redisUrl": "redis://redis:6379/0"}
    objects = render(helm_bin, values)
    args = gateway_args(container(objects, "gateway")["args"])
    assert args.keys_secret == "kvpilot-system/gateway-keys"
    assert args.redis_url == "redis://redis:6379/0"
    role = find(objects, "Role", "kvpilot-gateway-keys", part="gateway")
    assert role["metadata"]["namespace"] == "kvpilot-system"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"],
                              "resourceNames": ["gateway-keys"], "verbs": ["get"]}]  # fmt: skip


def test_no_keys_by_default(helm_bin: Path) -> None:
    objects = render(helm_bin)
    args = gateway_args(container(objects, "gateway")["args"])
    assert args.keys_secret is None and args.redis_url is None
    assert not [o for o in objects if o["metadata"]["name"] == "kvpilot-gateway-keys"]


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_cache_store_becomes_the_flag_the_gateway_parses(helm_bin: Path, store: str) -> None:
    values = {"gateway.cacheStore": store, "gateway.redisUrl": "redis://redis:6379/0"}
    args = cli.parse_args(container(render(helm_bin, values), "gateway")["args"])
    assert args.cache_store == store


def test_no_cache_by_default(helm_bin: Path) -> None:
    assert cli.parse_args(container(render(helm_bin), "gateway")["args"]).cache_store is None
