"""LoRA adapters through the model cache on the `local` pool (real processes): two s3://
adapters of a cached tiny-llama with two replicas are each fetched once, by a Job, into the
cache's claim; the pods read them from there (their logs show no fetch) and serve them. And a
pvc:// adapter: its claim (bound by the dev cluster's provisioner, filled by a Job) mounted
read-only in the pod, the runtime reading the adapter there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.reference.lora import MIXED_ADAPTERS, load_base, make_adapter
from hack.devcluster.modelsources import S3Endpoint, s3_client, upload_model
from hack.devcluster.nodepools import NODE_TYPE_LABEL
from kvpilot.operator.adapters import cache_fill
from kvpilot.operator.config import OperatorConfig
from tests.support.operator_cluster import (
    TINY_FACTS,
    Operator,
    apply_doc,
    apply_secret,
    get,
    model_server_env,
    pod_url,
    pods,
    ready_check,
    tiny_llama_from,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
BUCKET = "models"
NAMES = ("qv8", "all16")
PROMPT = [1, 9, 33, 17, 400, 12, 88, 1001, 7, 7, 7] * 3  # each adapter changes the output


def upload_adapters(cluster: Any, namespace: str, root: Path) -> dict[str, str]:
    """tiny-llama adapters made with peft, in the dev cluster's S3 store: name -> URI."""
    env = model_server_env(cluster)
    s3 = S3Endpoint(
        env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], BUCKET
    )
    base, client, uris = load_base(), s3_client(s3), {}
    for spec in (s for s in MIXED_ADAPTERS if s.name in NAMES):
        make_adapter(base, spec, root / spec.name)
        upload_model(client, BUCKET, root / spec.name, f"{namespace}/lora/{spec.name}/")
        uris[spec.name] = f"s3://{BUCKET}/{namespace}/lora/{spec.name}"
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    apply_secret(cluster, namespace, "model-creds", {"HF_TOKEN": "x"} | {k: env[k] for k in keys})
    return uris


def all_loaded(cluster: Any, namespace: str) -> dict[str, list[str]]:
    """adapter -> pods once AdaptersLoaded is True ({} before)."""
    status = get(cluster, "modeldeployment", "tiny", "-n", namespace).get("status") or {}
    found = [c for c in status.get("conditions", []) if c["type"] == "AdaptersLoaded"]
    if not found or found[0]["status"] != "True":
        raise AssertionError(f"AdaptersLoaded {found}; adapters {status.get('adapters')}")
    return {a["name"]: a["pods"] for a in status["adapters"]}


def answer(pod: dict[str, Any], model: str) -> tuple[str, list[float]]:
    """The pod's greedy text for PROMPT under `model`, and each token's logprob (an adapter
    changes them even where it leaves the argmax)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    found = httpx.post(f"{pod_url(pod)}/v1/completions", json=body, timeout=120)
    found.raise_for_status()
    choice = found.json()["choices"][0]
    return str(choice["text"]), list(choice["logprobs"]["token_logprobs"])


def pod_log(cluster: Any, namespace: str, pod: dict[str, Any]) -> str:
    return (cluster.log_dir / "pods" / f"{namespace}_{pod['metadata']['name']}.log").read_text()


def test_adapters_of_a_cached_model_are_fetched_once_into_the_cache_and_read_from_it(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    if not hasattr(cluster, "log_dir"):
        pytest.skip("needs the dev cluster's pod runner, whose pod logs it reads")
    uris = upload_adapters(cluster, namespace, tmp_path)
    md = tiny_llama_from("hf://kvpilot/tiny-llama", cluster, "model-creds", TINY_FACTS)
    md["spec"]["model"]["cache"] = {"size": "1Gi"}
    md["spec"]["autoscaling"] = {"mode": "off", "replicas": 2}
    md["spec"]["lora"] = {"maxLoras": 2, "maxLoraRank": 16}
    md["spec"]["adapters"] = [{"name": n, "uri": u} for n, u in uris.items()]
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=240)
    where = wait_for(lambda: all_loaded(cluster, namespace), "adapters loaded", operator, 240)

    claim = get(cluster, "modeldeployment", "tiny", "-n", namespace)["status"]["cache"]["claimName"]
    selector = f"{cache_fill.LABEL_ADAPTER_CACHE}={claim}"
    fills = get(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    assert len(fills) == len(uris)  # two replicas, one fetch per adapter
    assert {p["status"]["phase"] for p in fills} == {"Succeeded"}
    fetched = "\n".join(pod_log(cluster, namespace, p) for p in fills)
    replicas = {p["metadata"]["name"]: p for p in pods(cluster, namespace, "tiny")}
    assert len(replicas) == 2
    for name, uri in uris.items():
        assert f"fetching {uri}" in fetched
        assert where[name]  # served somewhere
        for pod in replicas.values():
            assert f"fetching {uri}" not in pod_log(cluster, namespace, pod)  # read from the claim
        holder = replicas[where[name][0]]
        assert answer(holder, name) != answer(holder, "tiny")
    args = next(iter(replicas.values()))["spec"]["containers"][0]["args"]
    assert "--lora-cache-dir=/mnt/models/.adapters" in args


def fill_claim_job(cluster: Any, claim: str, uri: str, to: str) -> dict[str, Any]:
    """A Job that fetches `uri` into `to` on `claim` with the runtime's own fetch (how a user
    fills a claim with adapters: any writer would do)."""
    endpoints = {
        k: v for k, v in model_server_env(cluster).items() if k.endswith(("ENDPOINT_URL", "REGION"))
    }
    container = {
        "name": "fill",
        "image": OperatorConfig().runtime_image,
        "command": ["kvpilot-runtime"],
        "args": ["fetch", f"--model={uri}", f"--to=/data/{to}"],
        "env": [{"name": k, "value": v} for k, v in endpoints.items()],
        "envFrom": [{"secretRef": {"name": "model-creds"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod = {
        "restartPolicy": "Never",
        "nodeSelector": {NODE_TYPE_LABEL: "local"},  # a node whose pods run for real
        "tolerations": [{"operator": "Exists"}],
        "containers": [container],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"fill-{claim}"},
        "spec": {"backoffLimit": 0, "template": {"spec": pod}},
    }


def test_a_pvc_adapter_is_read_from_the_claim_mounted_read_only(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    uris = upload_adapters(cluster, namespace, tmp_path)
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "loras"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    apply_doc(cluster, namespace, claim)
    apply_doc(cluster, namespace, fill_claim_job(cluster, "loras", uris["all16"], "tenant/all16"))

    def filled() -> bool:
        job = get(cluster, "job", "fill-loras", "-n", namespace)
        found = {c["type"] for c in (job.get("status") or {}).get("conditions") or []}
        assert "Failed" not in found, job["status"]
        return "Complete" in found

    wait_for(filled, "the claim filled", operator, timeout=180)
    md = tiny_llama_from("hf://kvpilot/tiny-llama", cluster, "model-creds", TINY_FACTS)
    md["spec"]["lora"] = {"maxLoras": 2, "maxLoraRank": 16}
    md["spec"]["adapters"] = [{"name": "tenant", "uri": "pvc://loras/tenant/all16"}]
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=240)
    where = wait_for(lambda: all_loaded(cluster, namespace), "adapter loaded", operator, 120)

    (pod,) = pods(cluster, namespace, "tiny")
    assert where == {"tenant": [pod["metadata"]["name"]]}
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "lora-claim-0")
    assert volume["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    assert "--lora-claims=loras=/mnt/lora-claims/loras" in pod["spec"]["containers"][0]["args"]
    assert answer(pod, "tenant") != answer(pod, "tiny")
    assert f"fetching {uris['all16']}" not in pod_log(cluster, namespace, pod)
