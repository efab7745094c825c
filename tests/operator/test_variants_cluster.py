"""spec.model.variants[] served end to end on the `local` pool (real processes): a
compressed-tensors int4 checkpoint of tiny-llama (made here with the real library) as spec.model
and tiny-llama in bf16 as a variant, both in the dev cluster's S3 store. At int4 the planner
serves the cheaper source (planning/choice.py): kvpilot's own int4 of the bf16 variant, which also
packs the embeddings and lm_head; its pod fetches the variant's URI and answers the official
client with the greedy text the runtime gives that checkpoint in-process."""

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
from tests.support.variants_cluster import (
    BF16_LOCAL,
    BF16_URI,
    NUM_TOKENS,
    PROMPT,
    in_process_greedy,
    int4_variant_in_s3,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_the_cheaper_variant_is_planned_fetched_and_serves_its_greedy_text(
    cluster: Any, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    int4 = int4_variant_in_s3(cluster, namespace, tmp_path)

    md = tiny_llama_from(int4.uri, cluster, "model-creds")  # facts read at source
    variant_uri = BF16_URI
    md["spec"]["model"]["variants"] = [{"name": "bf16", "uri": variant_uri}]
    # int4 alone: both sources run at it; the bf16 one quantised by kvpilot holds fewer bytes
    md["spec"]["quantization"] = {"allowed": ["int4"]}
    apply_doc(cluster, namespace, md)
    wait_for(ready_check(cluster, namespace, "tiny"), "tiny Ready", operator, timeout=300)

    (plan,) = get(cluster, "modeldeployment", "tiny", "-n", namespace)["status"]["plan"]
    assert (plan["nodeType"], plan["variant"], plan["quantization"]) == ("local", "bf16", "int4")
    assert plan["reason"].startswith("variant bf16 over spec.model (weights ")
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
    assert completion.choices[0].text == in_process_greedy(BF16_LOCAL, pod_args)
