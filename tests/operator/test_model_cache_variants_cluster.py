"""spec.model.variants[] through spec.model.cache on the `local` pool (real processes):
tiny-llama in bf16 and a compressed-tensors int4 checkpoint of it (made here with the real
library) in the dev cluster's S3 store; each is filled once into a claim of its own, and the
planner's int4 variant is served from its claim, answering the official client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvpilot.operator.reconcile import manifests
from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    fill_pods,
    get,
    pod_url,
    pods,
    ready_check,
    tiny_llama_from,
    wait_for,
)
from tests.support.variants_cluster import NUM_TOKENS, PROMPT, in_process_greedy, int4_variant_in_s3

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
MODEL_URI = "s3://models/tiny-llama"


def test_a_cached_variant_is_filled_once_and_served_from_its_own_claim(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    int4 = int4_variant_in_s3(cluster, namespace, tmp_path)

    md = tiny_llama_from(MODEL_URI, cluster, "model-creds")  # facts read at source
    variant_uri = int4.uri
    md["spec"]["model"]["variants"] = [{"name": "ct-int4", "uri": variant_uri}]
    md["spec"]["model"]["cache"] = {"size": "1Gi"}
    md["spec"]["quantization"] = {"allowed": ["int4"]}  # the pre-quantised source ranks first
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=300)

    status = get(cluster, "modeldeployment", "tiny", "-n", namespace)["status"]
    (plan,) = status["plan"]
    assert (plan["nodeType"], plan["variant"], plan["quantization"]) == ("local", "ct-int4", "int4")
    model_claim = manifests.cache_claim_name(MODEL_URI)
    variant_claim = manifests.cache_claim_name(variant_uri)
    assert (status["cache"]["claimName"], status["cache"]["phase"]) == (model_claim, "Cached")
    (variant_cache,) = status["variantCaches"]
    assert (variant_cache["claimName"], variant_cache["variant"]) == (variant_claim, "ct-int4")
    assert variant_cache["phase"] == "Cached" and variant_cache["files"] >= 3
    for claim, uri in ((model_claim, MODEL_URI), (variant_claim, variant_uri)):
        (filler,) = fill_pods(cluster, namespace, claim)  # one download per source
        assert filler["status"]["phase"] == "Succeeded"
        assert f"--model={uri}" in filler["spec"]["containers"][0]["args"]

    (pod,) = pods(cluster, namespace, "tiny")
    assert "initContainers" not in pod["spec"]  # nothing fetched by the pod
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": variant_claim, "readOnly": True}

    client = OpenAI(base_url=f"{pod_url(pod)}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0
    )
    pod_args = pod["spec"]["containers"][0]["args"]
    assert completion.choices[0].text == in_process_greedy(int4.local, pod_args)
