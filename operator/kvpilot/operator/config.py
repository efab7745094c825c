"""The operator's own configuration: one frozen dataclass, built at the edge from YAML and env.

    runtimeImage: ghcr.io/kvpilot/runtime:0.1.0
    prometheusUrl: http://prometheus.monitoring:9090
    autoscalerIntervalSeconds: 10
    spillAfterSeconds: 180          # Unschedulable this long: replicas move to the next node type
    costWindowSeconds: 300          # status.cost: traffic averaged over this window (Prometheus)
    nodeTypes:                      # for clusters without GPU Feature Discovery
      - name: a10g-24gb
        nodeSelector: {node.kubernetes.io/instance-type: g5.xlarge}
        gpuMemoryMiB: 23028
        gpusPerNode: 1
        pricePerHour: 1.006

Environment variables override the file: KVPILOT_RUNTIME_IMAGE, KVPILOT_PROMETHEUS_URL,
KVPILOT_AUTOSCALER_INTERVAL, KVPILOT_SPILL_AFTER, KVPILOT_COST_WINDOW, KVPILOT_NAMESPACE.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The runtime image released with this operator: its tag is the package's version, as the chart's
# appVersion and every released image's tag are (hack/release.py; one version, in pyproject.toml).
DEFAULT_RUNTIME_IMAGE = f"ghcr.io/kvpilot/runtime:{importlib.metadata.version('kvpilot')}"
FIELD_MANAGER = "kvpilot-operator"


@dataclass(frozen=True)
class DeclaredNodeType:
    """A node type the operator cannot discover from GFD labels, declared by the cluster admin."""

    name: str
    node_selector: Mapping[str, str]
    gpu_memory_mib: int
    gpus_per_node: int
    price_per_hour: float = 0.0
    product: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.node_selector:
            raise ValueError(f"declared node type needs a name and a nodeSelector: {self}")
        if self.gpu_memory_mib <= 0 or self.gpus_per_node <= 0:
            raise ValueError(
                f"node type {self.name}: gpuMemoryMiB and gpusPerNode must be positive,"
                f" got {self.gpu_memory_mib} and {self.gpus_per_node}"
            )


@dataclass(frozen=True)
class OperatorConfig:
    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    prometheus_url: str = ""
    autoscaler_interval_seconds: float = 10.0  # metrics read and decided on this often
    # Long enough for a cluster autoscaler or Karpenter to bring a GPU node of the preferred type
    # (often 2-3 minutes), short enough that users are not left waiting on a type that never comes.
    spill_after_seconds: float = 180.0
    # status.cost averages traffic over this window and is refreshed about once per window/5.
    cost_window_seconds: int = 300
    namespace: str = ""  # empty: all namespaces
    node_types: tuple[DeclaredNodeType, ...] = field(default_factory=tuple)
    field_manager: str = FIELD_MANAGER
    runtime_port: int = 8000
    termination_grace_seconds: int = 120

    def __post_init__(self) -> None:
        if self.autoscaler_interval_seconds <= 0:
            raise ValueError(
                "autoscalerIntervalSeconds (KVPILOT_AUTOSCALER_INTERVAL) must be > 0, got"
                f" {self.autoscaler_interval_seconds}"
            )
        if not 30 <= self.cost_window_seconds <= 86400:
            raise ValueError(
                "costWindowSeconds (KVPILOT_COST_WINDOW) must be between 30 and 86400, got"
                f" {self.cost_window_seconds}"
            )
        if self.spill_after_seconds < 0:
            raise ValueError(
                "spillAfterSeconds (KVPILOT_SPILL_AFTER) must be >= 0, got"
                f" {self.spill_after_seconds}"
            )


def from_mapping(data: Mapping[str, Any], env: Mapping[str, str]) -> OperatorConfig:
    unknown = set(data) - {
        "runtimeImage",
        "prometheusUrl",
        "autoscalerIntervalSeconds",
        "spillAfterSeconds",
        "costWindowSeconds",
        "nodeTypes",
    }
    if unknown:
        raise ValueError(f"unknown operator config keys: {sorted(unknown)}")
    return OperatorConfig(
        runtime_image=env.get("KVPILOT_RUNTIME_IMAGE")
        or data.get("runtimeImage")
        or DEFAULT_RUNTIME_IMAGE,
        prometheus_url=env.get("KVPILOT_PROMETHEUS_URL") or data.get("prometheusUrl", ""),
        autoscaler_interval_seconds=float(
            env.get("KVPILOT_AUTOSCALER_INTERVAL") or data.get("autoscalerIntervalSeconds", 10)
        ),
        spill_after_seconds=float(
            env.get("KVPILOT_SPILL_AFTER") or data.get("spillAfterSeconds", 180)
        ),
        cost_window_seconds=int(
            env.get("KVPILOT_COST_WINDOW") or data.get("costWindowSeconds", 300)
        ),
        namespace=env.get("KVPILOT_NAMESPACE", ""),
        node_types=tuple(_declared(item) for item in data.get("nodeTypes") or ()),
    )


def _declared(item: Mapping[str, Any]) -> DeclaredNodeType:
    try:
        return DeclaredNodeType(
            name=str(item["name"]),
            node_selector={str(k): str(v) for k, v in dict(item["nodeSelector"]).items()},
            gpu_memory_mib=int(item["gpuMemoryMiB"]),
            gpus_per_node=int(item["gpusPerNode"]),
            price_per_hour=float(item.get("pricePerHour", 0.0)),
            product=str(item.get("product", "")),
        )
    except KeyError as missing:
        raise ValueError(f"declared node type {item!r} lacks {missing}") from None


def load(path: Path | None, env: Mapping[str, str] | None = None) -> OperatorConfig:
    """Read the YAML file (when given) and the environment; the only I/O in this module."""
    data: Any = yaml.safe_load(path.read_text()) if path else {}
    if not isinstance(data or {}, dict):
        raise ValueError(f"{path}: operator config must be a mapping")
    return from_mapping(data or {}, os.environ if env is None else env)
