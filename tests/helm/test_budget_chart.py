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


@pytest.mark.parametrize("scope", ["team", "key", "shared"])
def test_the_cache_scope_becomes_the_flag_the_gateway_parses(helm_bin: Path, scope: str) -> None:
    values = {"gateway.cacheStore": "memory", "gateway.cacheScope": scope}
    args = cli.parse_args(container(render(helm_bin, values), "gateway")["args"])
    assert args.cache_scope == scope
    assert cli.parse_args(container(render(helm_bin), "gateway")["args"]).cache_scope is None


def test_the_upstream_key_comes_from_a_secret_into_the_environment(helm_bin: Path) -> None:
    """The replicas' --api-key: a Secret key in the gateway's environment, named by the flag the
    gateway parses; the key itself is never in the pod's args."""
    values = {
        "gateway.upstreamApiKeySecret.name": "runtime-key",
        "gateway.env[0].name": "HTTPS_PROXY",
        "gateway.env[0].value": "http://proxy:3128",
    }
    gateway = container(render(helm_bin, values), "gateway")
    args = cli.parse_args(gateway["args"])
    assert args.upstream_api_key_env == "KVPILOT_UPSTREAM_API_KEY"
    env = {e["name"]: e for e in gateway["env"]}
    assert env["KVPILOT_UPSTREAM_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "runtime-key", "key": "api-key"}
    }
    assert env["HTTPS_PROXY"]["value"] == "http://proxy:3128"  # gateway.env is kept
    defaults = container(render(helm_bin), "gateway")
    assert cli.parse_args(defaults["args"]).upstream_api_key_env is None
    assert "env" not in defaults
