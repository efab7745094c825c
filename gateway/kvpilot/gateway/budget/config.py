"""The `keys:`, `teams:`, `redis:` and `prices:` sections of the gateway's config (the static file,
or in Kubernetes the `keys.yaml` of a Secret: keys and teams only).

    keys:
      - key: sk-local-1              # or keySha256: <hex of sha256(key)>
        team: research
        models: [tiny]               # allow-list; absent: every served model
        limits: [{unit: total_tokens, limit: 2000, window: 1h}]
        rpm_limit: 60                # LiteLLM's shapes: requests / total tokens per minute,
        tpm_limit: 100000            # and max_budget (cost) per budget_duration
        max_budget: 5.0
        budget_duration: 30d
        priority: 1                  # optional: lower runs first (vLLM's); default: its team's
    teams:
      - name: research
        limits: [{unit: cost, limit: 100, window: month}]
        priority: 0                  # the team's keys' (default 0); a request may lower its own
        weight: 3                    # its share in the fair queue (flow/), default 1
    redis: {url: redis://redis:6379/0}
    prices:                          # per 1M tokens, for `unit: cost`
      tiny: {inputPerMillion: 0.05, outputPerMillion: 0.2}
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpilot.gateway.budget.arithmetic import Limit, Price, parse_window

Unit = Literal["requests", "input_tokens", "output_tokens", "total_tokens", "cost"]
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
KEY_ID_CHARS = 12  # of the hash: names a key in metrics, logs and errors without revealing it


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class LimitSpec(_Strict):
    unit: Unit
    limit: float = Field(gt=0)
    window: str

    @field_validator("window")
    @classmethod
    def _window(cls, value: str) -> str:
        parse_window(value)
        return value


class _LimitedSpec(_Strict):
    """Limits in our shape and in LiteLLM's (`rpm_limit`, `tpm_limit`, `max_budget` per
    `budget_duration`)."""

    limits: list[LimitSpec] = Field(default_factory=list)
    rpm_limit: int | None = Field(default=None, gt=0)
    tpm_limit: int | None = Field(default=None, gt=0)
    max_budget: float | None = Field(default=None, gt=0)
    budget_duration: str | None = None

    @model_validator(mode="after")
    def _budget_needs_duration(self) -> _LimitedSpec:
        if self.max_budget is not None and self.budget_duration is None:
            raise ValueError("max_budget needs budget_duration (e.g. 30d or month): when it resets")
        if self.budget_duration is not None:
            parse_window(self.budget_duration)
        return self

    def all_limits(self) -> list[LimitSpec]:
        extra = []
        if self.rpm_limit is not None:
            extra.append(LimitSpec(unit="requests", limit=self.rpm_limit, window="1m"))
        if self.tpm_limit is not None:
            extra.append(LimitSpec(unit="total_tokens", limit=self.tpm_limit, window="1m"))
        if self.max_budget is not None and self.budget_duration is not None:
            extra.append(LimitSpec(unit="cost", limit=self.max_budget, window=self.budget_duration))
        return [*self.limits, *extra]


# Priorities a key, a team or a request may name (vLLM's field is any integer; bounded here so
# a header cannot name a value no one could reason about).
MIN_PRIORITY, MAX_PRIORITY = -1_000_000, 1_000_000


class KeySpec(_LimitedSpec):
    key: str | None = Field(default=None, min_length=8, repr=False)
    key_sha256: str | None = Field(default=None, alias="keySha256")
    team: str | None = None
    models: list[str] | None = None
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)

    @model_validator(mode="after")
    def _one_key(self) -> KeySpec:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give one of key (the API key) or keySha256 (its sha256, hex)")
        if self.key_sha256 is not None and not _SHA256.match(self.key_sha256):
            raise ValueError("keySha256 must be 64 lowercase hex digits: sha256sum of the key")
        return self

    def digest(self) -> str:
        return self.key_sha256 or hash_key(self.key or "")


class TeamSpec(_LimitedSpec):
    name: str = Field(min_length=1)
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    weight: float = Field(default=1.0, gt=0, le=1000)


class RedisSpec(_Strict):
    url: str = Field(pattern=r"^rediss?://")


class PriceSpec(_Strict):
    input_per_million: float = Field(default=0.0, ge=0, alias="inputPerMillion")
    output_per_million: float = Field(default=0.0, ge=0, alias="outputPerMillion")


class KeysDocument(_Strict):
    """What a keys Secret's `keys.yaml` holds."""

    keys: list[KeySpec] = Field(default_factory=list)
    teams: list[TeamSpec] = Field(default_factory=list)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyEntry:
    key_id: str  # the hash's first characters
    team: str
    models: frozenset[str] | None
    limits: tuple[Limit, ...]  # the key's own, then its team's
    priority: int = 0  # the best (lowest) a request with this key may ask for
    weight: float = 1.0  # its tenant's share in the fair queue (its team's weight)

    @property
    def tenant(self) -> str:
        """Who shares a fair-queue share: the team, else the key alone."""
        return self.team or f"key:{self.key_id}"


def key_book(keys: list[KeySpec], teams: list[TeamSpec]) -> dict[str, KeyEntry]:
    """sha256 hex -> the key's entry; ValueError on a duplicate key or team."""
    team_limits: dict[str, tuple[Limit, ...]] = {}
    team_specs = {team.name: team for team in teams}
    for team in teams:
        if team.name in team_limits:
            raise ValueError(f"teams: {team.name!r} appears twice")
        team_limits[team.name] = to_limits(f"team:{team.name}", team, team.name)
    book: dict[str, KeyEntry] = {}
    for index, spec in enumerate(keys):
        digest = spec.digest()
        if digest in book:
            raise ValueError(f"keys[{index}]: the same key appears twice")
        key_id = digest[:KEY_ID_CHARS]
        team_name = spec.team or ""
        # a teamless key's counters share its own scope as their hash tag
        slot = team_name or f"key:{key_id}"
        limits = to_limits(f"key:{key_id}", spec, slot) + team_limits.get(team_name, ())
        models = frozenset(spec.models) if spec.models is not None else None
        team_spec = team_specs.get(team_name)
        team_priority = team_spec.priority if team_spec else 0
        priority = spec.priority if spec.priority is not None else team_priority
        weight = team_spec.weight if team_spec else 1.0
        book[digest] = KeyEntry(key_id, team_name, models, limits, priority, weight)
    return book


def to_limits(scope: str, spec: _LimitedSpec, slot: str) -> tuple[Limit, ...]:
    return tuple(
        Limit(scope, s.unit, s.limit, parse_window(s.window), slot) for s in spec.all_limits()
    )


def prices(specs: dict[str, PriceSpec]) -> dict[str, Price]:
    return {model: Price(s.input_per_million, s.output_per_million) for model, s in specs.items()}
