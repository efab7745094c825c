"""Prometheus for the dev cluster: kubernetes_sd (role pod) against the local apiserver.

Pods are scraped when annotated `prometheus.io/scrape: "true"` (port and path from
`prometheus.io/port` / `prometheus.io/path`), the convention kvpilot's runtime pods follow. Their
kvpilot.dev/model and kvpilot.dev/node-type labels become the series labels `kvpilot_model` and
`kvpilot_node_type` that the operator's metrics adapter aggregates by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hack.devcluster.versions import PROMETHEUS

SCRAPE_INTERVAL = "2s"  # short, so tests and the demo see load within seconds


def relabel(source: str, target: str) -> dict[str, Any]:
    return {"source_labels": [source], "target_label": target, "action": "replace"}


def build_config(apiserver_url: str, ca: Path, cert: Path, key: Path) -> dict[str, Any]:
    tls = {"ca_file": str(ca), "cert_file": str(cert), "key_file": str(key)}
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "scrape_timeout": "1s",
                "kubernetes_sd_configs": [
                    {"role": "pod", "api_server": apiserver_url, "tls_config": tls}
                ],
                "relabel_configs": [
                    {
                        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
                        "regex": "true",
                        "action": "keep",
                    },
                    {
                        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
                        "regex": "(.+)",
                        "target_label": "__metrics_path__",
                        "action": "replace",
                    },
                    {
                        "source_labels": [
                            "__meta_kubernetes_pod_ip",
                            "__meta_kubernetes_pod_annotation_prometheus_io_port",
                        ],
                        "regex": "(.+);(\\d+)",
                        "replacement": "$1:$2",
                        "target_label": "__address__",
                        "action": "replace",
                    },
                    # Pod IPs of the dev cluster are loopback; never scrape anything else.
                    {"source_labels": ["__address__"], "regex": "127\\..*", "action": "keep"},
                    relabel("__meta_kubernetes_namespace", "namespace"),
                    relabel("__meta_kubernetes_pod_name", "pod"),
                    relabel("__meta_kubernetes_pod_label_kvpilot_dev_model", "kvpilot_model"),
                    relabel(
                        "__meta_kubernetes_pod_label_kvpilot_dev_node_type", "kvpilot_node_type"
                    ),
                ],
            }
        ],
    }


def argv(config_file: Path, data_dir: Path, port: int) -> list[str]:
    return [
        str(PROMETHEUS.path("prometheus")),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=2h",
        "--web.enable-lifecycle",
    ]
