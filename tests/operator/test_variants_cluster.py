"""spec.model.variants[] served end to end on the `local` pool (real processes): tiny-llama in
bf16 and a compressed-tensors int4 checkpoint of it, made here with the real library, both in the
dev cluster's S3 store; the planner serves the int4 variant, whose pod fetches its URI and answers
the official client with the greedy text the runtime gives that checkpoint in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.operator_cluster import (
    Operator,
    apply_doc,
    get,
    pod_url,
    pods,
    ready_check,
    tiny_llama_from,
    wait_for,
)
from tests.support.variants_cluster import NUM_TOKENS, PROMPT, in_process_greedy, int4_variant_in_s3

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_the_int4_variant_is_planned_fetched_and_serves_its_greedy_text(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    int4 = int4_variant_in_s3(cluster, namespace, tmp_path)

    md = tiny_llama_from("s3://models/tiny-llama", cluster, "model-creds")  # facts read at source
    variant_uri = int4.uri
    md["spec"]["model"]["variants"] = [{"name": "ct-int4", "uri": variant_uri}]
    # int4 alone: the planner ranks a pre-quantised int4 source before quantising the bf16 one
    md["spec"]["quantization"] = {"allowed": ["int4"]}
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=300)

    (plan,) = get(cluster, "modeldeployment", "tiny", "-n", namespace)["status"]["plan"]
    assert (plan["nodeType"], plan["variant"], plan["quantization"]) == ("local", "ct-int4", "int4")
    (pod,) = pods(cluster, namespace, "tiny")
    (fetch,) = pod["spec"]["initContainers"]
    assert f"--model={variant_uri}" in fetch["args"]
    assert fetch["name"] == "fetch-model"
    assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0

    client = OpenAI(base_url=f"{pod_url(pod)}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0
    )
    pod_args = pod["spec"]["containers"][0]["args"]
    assert completion.choices[0].text == in_process_greedy(int4.local, pod_args)
