"""The static config file (`kvpilot-gateway --config FILE`): models, their replicas' URLs and their
fallbacks, for use without Kubernetes. Parsed with pydantic; every mistake names its place in the
file and what to write instead.

    models:
      - name: tiny
        backends: [http://10.0.0.5:8000, http://10.0.0.6:8000]
        fallbacks:
          - small                          # another model in this file
          - provider: {baseURL: https://api.example.com/v1, model: gpt-4o-mini,
                       apiKeyEnv: EXAMPLE_API_KEY}
        fallbackAfterSeconds: 30           # optional
        schedulingPolicy: priority         # optional: the replicas run --scheduling-policy
                                           # priority, so they get the request's `priority`
                                           # (default fcfs: the field is left out)
        cascade:              # optional, tried in order before picking (routing/cascade_policy.py)
          - when: {maxPromptTokens: 512, noTools: true}
            model: small                   # another model in this file
        adapters: [sql, support]           # optional: LoRA adapters the backends serve, each a
                                           # model name routed to them (routing/lora_affinity.py)
    cache: {enabled: true, ttlSeconds: 600}  # optional (cache/config.py)
    upstream: {apiKeyEnv: RUNTIME_API_KEY}    # optional: the key sent to the replicas (their
                                              # --api-key), read from this environment variable
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvpilot.gateway.budget.config import KeySpec, PriceSpec, RedisSpec, TeamSpec
from kvpilot.gateway.cache.config import CacheSpec
from kvpilot.gateway.routing.cascade_rules import CascadeRule, find_cycle
from kvpilot.gateway.routing.routes import Backend, Fallback, Provider, Route


class ConfigError(ValueError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class ProviderSpec(_Strict):
    base_url: str = Field(alias="baseURL")
    model: str = Field(min_length=1)
    api_key_env: str | None = Field(default=None, alias="apiKeyEnv")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return http_url(value)


class ProviderFallback(_Strict):
    provider: ProviderSpec


class CascadeWhen(_Strict):
    max_prompt_tokens: int | None = Field(default=None, alias="maxPromptTokens", ge=1)
    no_tools: bool = Field(default=False, alias="noTools")


class CascadeSpec(_Strict):
    when: CascadeWhen = Field(default_factory=CascadeWhen)
    model: str = Field(min_length=1)


class ModelSpec(_Strict):
    name: str = Field(min_length=1)
    backends: list[str] = Field(default_factory=list)
    fallbacks: list[str | ProviderFallback] = Field(default_factory=list)
    fallback_after_seconds: float | None = Field(default=None, alias="fallbackAfterSeconds", gt=0)
    cascade: list[CascadeSpec] = Field(default_factory=list)
    scheduling_policy: Literal["fcfs", "priority"] = Field(default="fcfs", alias="schedulingPolicy")
    # LoRA adapters the backends serve (`kvpilot-runtime serve --enable-lora`): each is a model
    # name of its own, routed to these backends preferring those that hold it.
    adapters: list[str] = Field(default_factory=list)

    @field_validator("backends")
    @classmethod
    def _http_urls(cls, values: list[str]) -> list[str]:
        return [http_url(value) for value in values]

    @model_validator(mode="after")
    def _answerable(self) -> ModelSpec:
        if not self.backends and not self.fallbacks:
            raise ValueError(
                f"model {self.name!r} has no backends and no fallbacks, so no request for it "
                "could be answered: list its replicas' URLs under backends"
            )
        return self


class UpstreamSpec(_Strict):
    """The credential the gateway sends its own replicas (`kvpilot-runtime serve --api-key`)."""

    api_key_env: str = Field(alias="apiKeyEnv", min_length=1)


class GatewayConfig(_Strict):
    models: list[ModelSpec] = Field(min_length=1)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    upstream: UpstreamSpec | None = None
    keys: list[KeySpec] = Field(
        default_factory=list
    )  # budget/config.py: keys, teams, redis, prices
    teams: list[TeamSpec] = Field(default_factory=list)
    redis: RedisSpec | None = None
    prices: dict[str, PriceSpec] = Field(default_factory=dict)


def http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{value!r} is not an http(s) URL like http://10.0.0.5:8000")
    return value.rstrip("/")


def load_routes(path: Path, env: Mapping[str, str] | None = None) -> list[Route]:
    """The routes a config file describes; ConfigError saying what is wrong and where."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read the gateway config {path}: {error}") from None
    return routes_from(data, os.environ if env is None else env, source=str(path))


def routes_from(data: Any, env: Mapping[str, str], source: str = "config") -> list[Route]:
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{source}: {describe(error)}") from None
    names = [model.name for model in config.models]
    served = names + [adapter for model in config.models for adapter in model.adapters]
    duplicates = sorted({name for name in served if served.count(name) > 1})
    if duplicates:
        raise ConfigError(
            f"{source}: model and adapter names must be unique; repeated: {duplicates}"
        )
    routes = [to_route(model, set(names), env, source) for model in config.models]
    edges = {r.model: [(i, rule.target) for i, rule in enumerate(r.cascade) if rule.target]
             for r in routes}  # fmt: skip
    cycle = find_cycle(edges)
    if cycle is not None:
        rules = ", ".join(f"models[{m}].cascade[{i}] -> {t}" for m, i, t in cycle)
        raise ConfigError(f"{source}: cascade rules form a cycle ({rules}): a model that "
                          "requests cascade to must not cascade back; remove one")  # fmt: skip
    adapters = [
        dataclasses.replace(route, model=adapter, cascade=(), adapter_of=route.model)
        for route, model in zip(routes, config.models, strict=True)
        for adapter in model.adapters
    ]
    return routes + adapters


def to_route(model: ModelSpec, names: set[str], env: Mapping[str, str], source: str) -> Route:
    backends = tuple(Backend(name=url, url=url) for url in model.backends)
    fallbacks: list[Fallback] = []
    for index, fallback in enumerate(model.fallbacks):
        where = f"{source}: models[{model.name}].fallbacks[{index}]"
        if isinstance(fallback, str):
            if fallback not in names or fallback == model.name:
                raise ConfigError(f"{where}: {fallback!r} is not another model of this file")
            fallbacks.append(fallback)
        else:
            fallbacks.append(to_provider(fallback.provider, f"{model.name}/{index}", env, where))
    cascade = tuple(to_cascade_rule(rule, index, model.name, names, source)
                    for index, rule in enumerate(model.cascade))  # fmt: skip
    return Route(model.name, backends, tuple(fallbacks), None, model.fallback_after_seconds,
                 cascade=cascade, takes_priority=model.scheduling_policy == "priority")  # fmt: skip


def to_cascade_rule(
    spec: CascadeSpec, index: int, model: str, names: set[str], source: str
) -> CascadeRule:
    where = f"{source}: models[{model}].cascade[{index}].model"
    if spec.model == model:
        raise ConfigError(f"{where}: the rule sends {model!r} to itself; name a smaller model")
    if spec.model not in names:
        raise ConfigError(f"{where}: {spec.model!r} is not another model of this file")
    return CascadeRule(spec.model, spec.when.max_prompt_tokens, spec.when.no_tools)


def to_provider(spec: ProviderSpec, name: str, env: Mapping[str, str], where: str) -> Provider:
    key = None
    if spec.api_key_env is not None:
        key = env.get(spec.api_key_env)
        if not key:
            raise ConfigError(f"{where}: apiKeyEnv {spec.api_key_env!r} is not set or empty")
    return Provider(name=name, base_url=spec.base_url, model=spec.model, api_key=key)


def upstream_api_key(
    flag_env: str | None, path: Path | None, env: Mapping[str, str] | None = None
) -> str | None:
    """The key the gateway sends its replicas: from the environment variable that
    `--upstream-api-key-env` names, else the one the config's `upstream.apiKeyEnv` names; None
    when neither is given. ConfigError when the variable is not set or empty (every request
    would be refused)."""
    name, where = flag_env, "--upstream-api-key-env"
    if name is None and path is not None:
        upstream = load_config(path).upstream
        name, where = (upstream.api_key_env, f"{path}: upstream.apiKeyEnv") if upstream else (
            None, "")  # fmt: skip
    if name is None:
        return None
    key = (os.environ if env is None else env).get(name, "").strip()
    if not key:
        raise ConfigError(f"{where}: the environment variable {name!r} is not set or empty; set "
                          "it to the replicas' --api-key")  # fmt: skip
    return key


def describe(error: ValidationError) -> str:
    """pydantic's errors as `models.0.backends.1: message` lines."""
    lines = []
    for item in error.errors():
        place = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"{place}: {item['msg']}")
    return "; ".join(lines)


def load_cache_spec(path: Path) -> CacheSpec:
    """The file's `cache:` section (defaults when it has none); ConfigError as load_routes."""
    return load_config(path).cache


def load_config(path: Path) -> GatewayConfig:
    """The whole file, validated; ConfigError as load_routes."""
    try:
        data = yaml.safe_load(path.read_text())
        return GatewayConfig.model_validate(data)
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read the gateway config {path}: {error}") from None
    except ValidationError as error:
        raise ConfigError(f"{path}: {describe(error)}") from None
