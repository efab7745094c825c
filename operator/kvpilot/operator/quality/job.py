"""The eval Job of quality/admission.py: one level of `kvpilot-runtime eval` in the runtime pod's
own spec (pod template, security context, model volume or fetch init container, GPUs, node
selector), its dataset mounted (a ConfigMap key, a pvc:// file) or fetched by the eval itself
(hf://, s3://, with spec.model.secretRef's credentials). Pure: built as data, like
reconcile/manifests.py.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract.dataset_source import parse_dataset_uri
from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.planner import NodePlan
from kvpilot.operator.reconcile import jobs, manifests

Obj = Mapping[str, Any]

LABEL_EVAL = "kvpilot.dev/quality-eval"  # on an eval Job and its pods: the Job's name
LABEL_CACHE = "kvpilot.dev/quality-cache"  # on eval Jobs and the cache: the cache's name
ANNOTATION_LEVEL = "kvpilot.dev/quantization"
ANNOTATION_NODE_TYPE = "kvpilot.dev/node-type"
ANNOTATION_REFERENCE = "kvpilot.dev/quality-reference"
DATASET_MOUNT = "/mnt/eval"
ANNOTATION_ATTEMPT = "kvpilot.dev/eval-attempt"
# A failing eval is retried by the Job controller with its exponential back-off (10 s, 20 s)
# up to EVAL_BACKOFF_LIMIT times; a Job that failed for good stays until its TTL, so the operator
# makes no new one before. The TTL doubles with each failed Job of the same measurement
# (quality/admission.py counts them in the cache ConfigMap), from FIRST_RETRY_SECONDS up to
# MAX_RETRY_SECONDS.
EVAL_BACKOFF_LIMIT = 2
FIRST_RETRY_SECONDS = 600
MAX_RETRY_SECONDS = 6 * 3600
EVAL_WINDOW_TOKENS = 512  # the eval's --max-length: the reference node must hold one window
DATASET_VOLUME = "eval-dataset"
ANNOTATION_VARIANT = "kvpilot.dev/variant"  # on a variant's eval Job: its name
# A spec.model.variants[] checkpoint the eval scores beside spec.model, fetched by its own init
# container as a serving pod fetches it (the variant's URI and Secret).
VARIANT_MOUNT = "/mnt/variant-model"
VARIANT_VOLUME = "variant-model"


def retry_delay_seconds(attempt: int) -> int:
    """How long the `attempt`-th failed Job stays (its TTL) before the next one is made."""
    return min(FIRST_RETRY_SECONDS * 2 ** (max(1, attempt) - 1), MAX_RETRY_SECONDS)


def cache_name(uri: str) -> str:
    return f"kvpilot-quality-{manifests.spec_hash(uri)}"


def job_name(uri: str, level: str, metric: str, digest: str, reference: str = "bf16") -> str:
    against = [] if reference == "bf16" else [reference]  # bf16: the names Jobs always had
    return f"kvpilot-eval-{manifests.spec_hash([uri, level, metric, digest, *against])}"


def variant_job_name(
    uri: str, variant: api.ModelVariant, metric: str, digest: str, reference: str = "bf16"
) -> str:
    """A variant's eval Job: named by the variant's name and URI too (a new URI, a new Job)."""
    return job_name(uri, f"variant:{variant.name}:{variant.uri}", metric, digest, reference)


@dataclass(frozen=True)
class DatasetDelivery:
    """How the eval reaches its dataset: the --dataset value, and the volume that holds it."""

    arg: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    needs_credentials: bool = False


def dataset_delivery(dataset: api.EvalDataset) -> DatasetDelivery:
    """A ConfigMap key or a pvc:// file mounted read-only; an hf:// or s3:// file fetched by the
    eval itself (`kvpilot-runtime eval --dataset URI`) with the model's credentials."""
    mount = [{"name": DATASET_VOLUME, "mountPath": DATASET_MOUNT, "readOnly": True}]
    if dataset.uri is None:
        key = dataset.key or ""
        items = [{"key": key, "path": key}]
        volume = {"name": DATASET_VOLUME, "configMap": {"name": dataset.config_map, "items": items}}
        return DatasetDelivery(f"{DATASET_MOUNT}/{key}", [volume], mount)
    source = parse_dataset_uri(dataset.uri)
    if source.scheme == "pvc":
        claim = {"claimName": source.location, "readOnly": True}
        volume = {"name": DATASET_VOLUME, "persistentVolumeClaim": claim}
        return DatasetDelivery(f"{DATASET_MOUNT}/{source.path}", [volume], mount)
    return DatasetDelivery(dataset.uri, needs_credentials=True)


def runtime_pod_template(
    spec: api.ModelDeploymentSpec, node_plan: NodePlan, config: OperatorConfig
) -> dict[str, Any]:
    """The runtime pod as build_deployment makes it, spec.runtime.podTemplate merged in: the
    eval runs where, and as whom, the runtime would (security context, tolerations, ...)."""
    generated = {"metadata": {}, "spec": manifests.pod_spec(spec, node_plan, config)}
    return manifests.deep_merge(generated, spec.runtime.pod_template)


def build_eval_job(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    level: str,
    node_plan: NodePlan,
    digest: str,
    config: OperatorConfig,
    attempt: int = 1,
    variant: api.ModelVariant | None = None,
) -> manifests.Manifest:
    """The eval Job for one level: the runtime pod's template with the eval as its container.
    `digest`: the dataset's key (quality.dataset_key), which names the Job. `node_plan`: the
    reference node (planner.reference_plan); its level is the one losses are relative to.
    `attempt`: 1 + the failed Jobs of this measurement so far; sets the Job's TTL. `variant`:
    measure that spec.model.variants[] checkpoint instead of a level (`level` is then "")."""
    evaluation = _evaluation(spec)
    reference = node_plan.quantization
    name = (
        job_name(spec.model.uri, level, evaluation.metric, digest, reference)
        if variant is None
        else variant_job_name(spec.model.uri, variant, evaluation.metric, digest, reference)
    )
    delivery = dataset_delivery(evaluation.dataset)
    template = runtime_pod_template(spec, node_plan, config)
    pod = template["spec"]
    runtime = pod["containers"][0]
    container = _eval_container(spec, (level, reference), runtime, delivery)
    pod["containers"] = [container]
    pod["volumes"] = [*pod.get("volumes", []), *delivery.volumes]
    if variant is not None:
        _add_variant(pod, container, spec, variant, config)
    annotations = {
        ANNOTATION_LEVEL: level,
        ANNOTATION_NODE_TYPE: node_plan.node_type.name,
        ANNOTATION_REFERENCE: reference,
        ANNOTATION_ATTEMPT: str(attempt),
        "kvpilot.dev/model-uri": spec.model.uri,
        "kvpilot.dev/dataset-digest": digest,
        **({} if variant is None else {ANNOTATION_VARIANT: variant.name}),
    }
    return jobs.build_job(
        name,
        md["metadata"]["namespace"],
        {LABEL_EVAL: name, LABEL_CACHE: cache_name(spec.model.uri)},
        annotations,
        template,
        backoff_limit=EVAL_BACKOFF_LIMIT,
        ttl_seconds=retry_delay_seconds(attempt),
    )


def _eval_container(
    spec: api.ModelDeploymentSpec,
    levels: tuple[str, str],
    runtime: Mapping[str, Any],
    delivery: DatasetDelivery,
) -> dict[str, Any]:
    """`levels`: the level measured, and the reference it is measured against."""
    level, reference = levels
    # bf16 is the checkpoint unquantised, the eval's default baseline (`none`)
    baseline = [] if reference == "bf16" else [f"--baseline={reference}"]
    model_dir = manifests.model_location(spec.model).model_arg.removeprefix("file://")
    args = [
        "eval",
        f"--model={model_dir}",
        f"--dataset={delivery.arg}",
        f"--metric={_evaluation(spec).metric}",
        f"--quantization={level}",
        f"--max-length={EVAL_WINDOW_TOKENS}",
        "--dtype=auto",  # the compute dtype `serve` uses on that device
        "--summary-file=/dev/termination-log",
        *baseline,
    ]
    secret = spec.model.secret_ref if delivery.needs_credentials else None
    return manifests.task_container(
        "eval",
        runtime["image"],
        args,
        copy.deepcopy(runtime.get("env", [])),
        [*copy.deepcopy(runtime.get("volumeMounts", [])), *delivery.mounts],
        secret=None if secret is None else secret.name,
        resources=copy.deepcopy(runtime.get("resources", {})),
        security=copy.deepcopy(runtime.get("securityContext", {})),
    )


def _add_variant(
    pod: dict[str, Any],
    container: dict[str, Any],
    spec: api.ModelDeploymentSpec,
    variant: api.ModelVariant,
    config: OperatorConfig,
) -> None:
    """The eval scores the variant (`--checkpoint NAME=PATH`) and no level of spec.model. With
    spec.model.cache it reads the variant's cache claim (filled as a serving pod of it reads it);
    else an init container fetches it as a serving pod would (manifests.fetch_container with the
    variant's URI and Secret, spec.model's if it has none) into a volume of its own."""
    source = spec.model.variant(variant.name)
    if source.cache is not None:
        claim = {"claimName": manifests.cache_claim_name(source.uri), "readOnly": True}
        pod["volumes"].append({"name": VARIANT_VOLUME, "persistentVolumeClaim": claim})
    else:
        fetch = manifests.fetch_container(spec.model_copy(update={"model": source}), config)
        fetch["name"] = "fetch-variant"
        fetch["args"] = ["fetch", f"--model={variant.uri}", f"--to={VARIANT_MOUNT}"]
        fetch["volumeMounts"][-1] = {"name": VARIANT_VOLUME, "mountPath": VARIANT_MOUNT}
        pod["initContainers"] = [*pod.get("initContainers", []), fetch]
        pod["volumes"].append({"name": VARIANT_VOLUME, "emptyDir": {}})
    mount = {"name": VARIANT_VOLUME, "mountPath": VARIANT_MOUNT, "readOnly": True}
    container["volumeMounts"].append(mount)
    args = [a for a in container["args"] if not a.startswith("--quantization=")]
    container["args"] = [*args, "--quantization=", f"--checkpoint={variant.name}={VARIANT_MOUNT}"]


def _evaluation(spec: api.ModelDeploymentSpec) -> api.Evaluation:
    if spec.quantization.evaluation is None:
        raise ValueError("spec.quantization.evaluation is not set")
    return spec.quantization.evaluation
