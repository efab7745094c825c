"""ModelDeployment spec and status (group kvpilot.dev, version v1alpha1), DESIGN.md §3.1.

These pydantic models are the source of truth: `crdgen` turns them into the CRD's OpenAPI schema,
and the operator parses objects with them. Field names are snake_case in Python and camelCase on the
wire (aliases). Rules that span fields are CEL rules (`x-kubernetes-validations`) so the apiserver
rejects a bad object at `kubectl apply`; `model_validator`s repeat them so unit tests see the same.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from kvpilot.contract import resource
from kvpilot.contract.dataset_source import parse_dataset_uri
from kvpilot.contract.engine_config import EngineConfig
from kvpilot.contract.model_source import FETCHED_SCHEMES
from kvpilot.contract.speculative_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from kvpilot.operator.autoscaling.policy import Bounds

Quantization = Literal["bf16", "int8", "int4"]
KvCacheDtype = Literal["auto", "fp16", "bf16", "fp8"]
SchedulingPolicy = Literal["fcfs", "priority"]  # engine_config.SCHEDULING_POLICY_CHOICES
QualityLoss = Literal["none", "low", "medium"]
QualityMetric = Literal["perplexity", "agreement", "exact-match"]
AutoscalingMode = Literal["builtin", "external", "off"]
Prefer = Literal["quality", "cost"]

# Which quantisation levels each tolerated quality loss admits (int8 costs ~0.1-0.5% perplexity,
# int4 with group scales ~1-3%; "medium" therefore is the widest).
QUALITY_LOSS_LEVELS: dict[str, tuple[str, ...]] = {
    "none": ("bf16",),
    "low": ("bf16", "int8"),
    "medium": ("bf16", "int8", "int4"),
}

URI_PATTERN = (
    r"^(hf://[^/\s]+/[^\s]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^\s]*|s3://[^\s]+|file:///[^\s]*)$"
)
# A draft model is fetched into the pod by an init container, as hf:// and s3:// models are.
DRAFT_URI_PATTERN = r"^(hf://[^/\s]+/[^\s]+|s3://[^\s]+)$"
# One file: an eval Job cannot see a file:// path on the user's machine.
EVAL_DATASET_URI_PATTERN = (
    r"^(hf://[^/\s]+/[^/\s]+/[^\s]*[^/\s]|s3://[^/\s]+/[^\s]*[^/\s]"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^\s]*[^/\s])$"
)
# A storage size as Kubernetes writes one (a subset of resource.Quantity: no exponents).
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
BASE_URL_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
MAX_FALLBACKS = 8
GIB, MIB = 2**30, 2**20
MAX_ADAPTERS = 256
# An adapter's name is a model name clients send and a --lora-modules NAME=PATH key: no `=`,
# no whitespace, no leading or trailing punctuation.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._:/-]*[A-Za-z0-9])?$"
# The runtime fetches an adapter itself when it loads it (hf://, s3://; or from the model cache),
# reads a path it can see (file://, e.g. a local pool's host directory), or reads a pvc:// claim
# the pods mount read-only: a claim new to the spec is a new volume in the pod template, so it
# rolls the pods once; more adapters on claims already mounted do not.
ADAPTER_URI_PATTERN = (
    r"^(hf://[^/\s]+/[^\s]+|s3://[^\s]+|file:///[^\s]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?)$"
)
MAX_CASCADE_RULES = 8

# The autoscaling policy's tuned defaults (policy.Bounds, measured in bench/autoscaler_sim.py) are
# the CRD's defaults, so the simulator measures what a ModelDeployment without settings gets.
POLICY_DEFAULTS = Bounds()
# The runtime's speculative-decoding defaults and limits are the CRD's, so a field left out means
# what the runtime would do with the key left out.
SPECULATIVE_DEFAULTS = SpeculativeConfig()
# The runtime's LoRA slot defaults (its EngineConfig's fields) are the CRD's.
_ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(EngineConfig)}
DEFAULT_MAX_LORAS: int = _ENGINE_DEFAULTS["max_loras"]
DEFAULT_MAX_LORA_RANK: int = _ENGINE_DEFAULTS["max_lora_rank"]
_DRAFT_NEEDS_MODEL = (
    "speculative method draft_model needs model (the draft's hf:// or s3:// URI), and only it"
    " takes one"
)
_LOOKUP_IS_NGRAM = "promptLookupMax and promptLookupMin apply to speculative method ngram only"
_LOOKUP_BOUNDS = "promptLookupMin must not exceed promptLookupMax"


def _cel(*rules: tuple[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": msg} for rule, msg in rules]}


@dataclass(frozen=True)
class _UriForms:
    """A URI (or an adapter's name) that must match `pattern`: pydantic refuses any other saying
    which `forms` are accepted, and the CRD says the same words in a CEL rule (with an OpenAPI
    `pattern` instead, `kubectl apply` would print the regular expression)."""

    pattern: str
    forms: str

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._matches, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        rule = (f"self.matches(r'{self.pattern}')", f"must be {self.forms}")
        return {**handler(schema), **_cel(rule)}

    def _matches(self, value: str) -> str:
        if re.fullmatch(self.pattern, value) is None:
            raise ValueError(f"must be {self.forms}")
        return value


MODEL_URI_FORMS = (
    "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX, pvc://CLAIM/PATH or file:///PATH (a Hugging"
    " Face id such as Qwen/Qwen2.5-7B-Instruct is hf://Qwen/Qwen2.5-7B-Instruct)"
)
DRAFT_URI_FORMS = "hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"
# The operator plans a variant by its config.json (its quantisation and bytes), which it reads
# only from hf:// and s3://: a node's file:// path or a claim is not mounted in the operator.
VARIANT_URI_FORMS = (
    f"{DRAFT_URI_FORMS}: the operator reads a variant's config.json to plan it and cannot read"
    " a node's file:// path or a pvc:// claim; upload the checkpoint to S3, or serve it as"
    " spec.model (file:///PATH with configMapRef naming a ConfigMap that holds its config.json)"
)
# The operator reads an hf:// or s3:// model's config.json itself (what the pods fetch); a node's
# file:// path or a claim it cannot read, so for those the user gives it in a ConfigMap.
CONFIG_MAP_REF_IS_LOCAL = (
    "configMapRef is for file:// and pvc:// models: an hf:// or s3:// model's config.json is"
    " read from the source; remove configMapRef"
)
ADAPTER_URI_FORMS = (
    "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX, pvc://CLAIM/PATH or file:///PATH (a PEFT"
    " adapter directory)"
)
EVAL_DATASET_URI_FORMS = (
    "one file: hf://ORG/NAME[@REV]/PATH (hf://datasets/ORG/NAME/PATH for a dataset repo),"
    " s3://BUCKET/KEY or pvc://CLAIM/PATH"
)
ModelUri = Annotated[str, _UriForms(URI_PATTERN, MODEL_URI_FORMS)]
DraftUri = Annotated[str, _UriForms(DRAFT_URI_PATTERN, DRAFT_URI_FORMS)]
VariantUri = Annotated[str, _UriForms(DRAFT_URI_PATTERN, VARIANT_URI_FORMS)]
AdapterUri = Annotated[str, _UriForms(ADAPTER_URI_PATTERN, ADAPTER_URI_FORMS)]
ADAPTER_NAME_FORMS = (
    "a model name of letters, digits and . _ : / -, starting and ending with a letter or digit"
    " (e.g. sql-v2 or tenant/support)"
)
AdapterName = Annotated[str, _UriForms(ADAPTER_NAME_PATTERN, ADAPTER_NAME_FORMS)]
EvalDatasetUri = Annotated[str, _UriForms(EVAL_DATASET_URI_PATTERN, EVAL_DATASET_URI_FORMS)]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class SecretRef(_Model):
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)


class ConfigMapKeyRef(_Model):
    """One key of a ConfigMap in the ModelDeployment's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    key: str = Field(default="config.json", pattern=SECRET_KEY_PATTERN, max_length=253)


class ModelCache(_Model):
    """A PersistentVolumeClaim the operator fills once with a Job and every replica mounts
    read-only, so N replicas do not download N times and a scale-up loads from local storage."""

    storage_class_name: str | None = Field(
        default=None, max_length=253, description="default: the cluster's default StorageClass"
    )
    size: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="the claim's size, e.g. 200Gi; default: 2 bytes per parameter + 20% + 1Gi",
    )
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        default="ReadWriteMany",
        description="ReadWriteMany (a shared filesystem) lets replicas on several nodes mount"
        " it; ReadWriteOnce keeps every replica on the node that filled it",
    )
    delete_with_model: bool = Field(
        default=False,
        description="delete the cache with the last ModelDeployment using it; by default it"
        " stays, shared by every ModelDeployment of the same model in the namespace",
    )


MAX_VARIANTS = 8
_VARIANTS_UNIQUE = "spec.model.variants: each name once"


class ModelVariant(_Model):
    """The same model published another way (AWQ, GPTQ, FP8, compressed-tensors, or another
    16-bit copy); the planner may serve it on a node type instead of spec.model."""

    name: str = Field(
        pattern=DNS_LABEL_PATTERN,
        max_length=63,
        description="how status.plan[].variant names it, e.g. awq",
    )
    uri: VariantUri = Field(
        max_length=1024,
        description="hf://org/name or s3://bucket/path: the operator reads its config.json",
    )
    secret_ref: SecretRef | None = Field(
        default=None, description="the Secret it is fetched with; default: spec.model.secretRef"
    )


class ModelSource(_Model):
    """Where the weights are, and the architecture facts for models the catalog lacks."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "!has(self.cache) || self.uri.startsWith('hf://') || self.uri.startsWith('s3://')",
                "cache applies to hf:// and s3:// models; pvc:// and file:// are local already",
            ),
            (
                "!has(self.configMapRef) || self.uri.startsWith('file://')"
                " || self.uri.startsWith('pvc://')",
                CONFIG_MAP_REF_IS_LOCAL,
            ),
        )
    )

    uri: ModelUri = Field(
        max_length=1024,
        description="hf://org/name, pvc://claim/path, s3://bucket/path or file:///path",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        description="model name in the OpenAI API; default: the URI's last path element",
    )
    secret_ref: SecretRef | None = Field(
        default=None,
        description="a Secret in this namespace whose keys (HF_TOKEN; AWS_ACCESS_KEY_ID,"
        " AWS_SECRET_ACCESS_KEY) become the model fetch's environment; never put tokens inline",
    )
    parameters: int | None = Field(default=None, ge=1, description="number of parameters")
    layers: int | None = Field(default=None, ge=1, le=1024)
    kv_heads: int | None = Field(default=None, ge=1, le=1024)
    head_dim: int | None = Field(default=None, ge=1, le=4096)
    vocab_size: int | None = Field(default=None, ge=1)
    config_map_ref: ConfigMapKeyRef | None = Field(
        default=None,
        description="file:// and pvc:// only: a ConfigMap in this namespace holding the"
        " checkpoint's config.json (key default config.json), which the operator cannot read"
        " from a node's path or a claim; it plans the model from it (architecture, and a"
        " pre-quantised checkpoint's own level and bytes) as it plans an hf:// one from"
        " the source, and its pods refuse a checkpoint of another kind",
    )
    cache: ModelCache | None = Field(
        default=None,
        description="fetch once into a shared volume instead of once per pod; each of variants"
        " is fetched into a volume of its own, keyed by its URI as spec.model's is",
    )
    variants: list[ModelVariant] = Field(
        default_factory=list,
        max_length=MAX_VARIANTS,
        description="the same model published other ways (e.g. AWQ, FP8): per node type the"
        " planner serves the one that fits best (status.plan[].variant); each must have"
        " spec.model's architecture",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    @model_validator(mode="after")
    def _cache_needs_a_remote_source(self) -> ModelSource:
        if self.cache is not None and not self.uri.startswith(("hf://", "s3://")):
            raise ValueError(
                "cache applies to hf:// and s3:// models; pvc:// and file:// are local already"
            )
        if self.config_map_ref is not None and not self.uri.startswith(("file://", "pvc://")):
            raise ValueError(CONFIG_MAP_REF_IS_LOCAL)
        names = [v.name for v in self.variants]
        if len(set(names)) < len(names):
            raise ValueError(_VARIANTS_UNIQUE)
        return self

    def variant(self, name: str) -> ModelSource:
        """The source a node type planned with variant `name` serves ("": this one): its URI
        and Secret, this one's served name (clients ask for one model), and this one's cache
        settings (a variant is cached in a claim of its own, keyed by its URI)."""
        if not name:
            return self
        found = next(v for v in self.variants if v.name == name)
        return ModelSource(
            uri=found.uri,
            served_name=served_name(self),
            secret_ref=found.secret_ref or self.secret_ref,
            cache=self.cache,
        )


class Speculative(_Model):
    """Speculative decoding, passed to the runtime as --speculative-config (vLLM's keys):
    requests without a grammar or a seed take proposals, and the served model checks them in
    one step (sampled requests keep their distribution). `ngram` proposes the tokens that
    followed an earlier occurrence of the last few (prompt lookup); `draft_model` runs a
    smaller model with the served model's tokenizer, which each pod fetches beside the served
    one (an init container) and holds on the same GPU."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.method == 'draft_model' ? has(self.model) : !has(self.model)",
                _DRAFT_NEEDS_MODEL,
            ),
            (
                "self.method == 'ngram' || (!has(self.promptLookupMax) && "
                "!has(self.promptLookupMin))",
                _LOOKUP_IS_NGRAM,
            ),
            (
                f"(has(self.promptLookupMin) ? self.promptLookupMin : "
                f"{SPECULATIVE_DEFAULTS.prompt_lookup_min}) <= (has(self.promptLookupMax) ? "
                f"self.promptLookupMax : {SPECULATIVE_DEFAULTS.prompt_lookup_max})",
                _LOOKUP_BOUNDS,
            ),
        )
    )

    method: Literal["ngram", "draft_model"] = "ngram"
    model: DraftUri | None = Field(
        default=None,
        max_length=1024,
        description="draft_model: the draft's hf://org/name or s3://bucket/path, with the served"
        " model's tokenizer (fetched with spec.model.secretRef's credentials)",
    )
    num_speculative_tokens: int = Field(
        default=SPECULATIVE_DEFAULTS.num_speculative_tokens, ge=1, le=MAX_SPECULATIVE_TOKENS
    )
    # No defaults in the schema: draft_model refuses them, so they must stay absent unless set.
    prompt_lookup_max: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description=f"ngram: the longest suffix matched (default"
        f" {SPECULATIVE_DEFAULTS.prompt_lookup_max})",
    )
    prompt_lookup_min: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description=f"ngram: the shortest suffix matched (default"
        f" {SPECULATIVE_DEFAULTS.prompt_lookup_min})",
    )

    @model_validator(mode="after")
    def _fields_of_the_method(self) -> Speculative:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(_DRAFT_NEEDS_MODEL)
        lookup = (self.prompt_lookup_max, self.prompt_lookup_min)
        if self.method == "draft_model" and lookup != (None, None):
            raise ValueError(_LOOKUP_IS_NGRAM)
        if self.method == "ngram" and self.lookup_min > self.lookup_max:
            raise ValueError(_LOOKUP_BOUNDS)
        return self

    @property
    def lookup_max(self) -> int:
        return self.prompt_lookup_max or SPECULATIVE_DEFAULTS.prompt_lookup_max

    @property
    def lookup_min(self) -> int:
        return self.prompt_lookup_min or SPECULATIVE_DEFAULTS.prompt_lookup_min

    def runtime_json(self, draft_dir: str) -> str:
        """The runtime's --speculative-config value (its own keys, snake_case); `draft_dir`:
        where the pod holds the draft model (draft_model only)."""
        values: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.method == "ngram":
            values["prompt_lookup_max"] = self.lookup_max
            values["prompt_lookup_min"] = self.lookup_min
        else:
            values["model"] = draft_dir
        return json.dumps(values, separators=(",", ":"))


class Serving(_Model):
    max_context_length: int = Field(default=4096, ge=16, le=1_048_576)
    target_concurrency: int = Field(
        default=8, ge=1, le=4096, description="sequences at full context one replica must hold"
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="cap on sequences one replica batches (the runtime's --max-num-seqs); beyond"
        " it requests queue, which the autoscaler scales on. Default: what the plan holds",
    )
    kv_cache_dtype: KvCacheDtype = "auto"
    gpu_memory_utilization: float = Field(
        default=0.9, ge=0.1, le=1.0, description="share of each GPU's memory the runtime may use"
    )
    speculative: Speculative | None = Field(
        default=None, description="speculative decoding (ngram or draft_model); off when absent"
    )
    scheduling_policy: SchedulingPolicy = Field(
        default="fcfs",
        description="the runtime's --scheduling-policy: fcfs (first come, first served; a "
        "request's priority must be 0) or priority (vLLM's `priority` field, lower first; a "
        "waiting request preempts running ones of a worse priority). kvpilot-gateway forwards "
        "each request's priority only to replicas under priority",
    )


_ONE_DATASET_FORM = (
    "dataset: give either uri (hf://, s3:// or pvc://) or configMap with key, not both"
)


class EvalDataset(_Model):
    """The user's evaluation set (text, .jsonl of {"text"}, or for exact-match .jsonl of
    {"prompt", "answer"}): one key of a ConfigMap in the ModelDeployment's namespace, or one file
    the eval Job fetches (hf://, s3://, with spec.model.secretRef's credentials) or mounts
    read-only (pvc://)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "has(self.uri) ? !has(self.configMap) && !has(self.key)"
                " : has(self.configMap) && has(self.key)",
                _ONE_DATASET_FORM,
            )
        )
    )

    config_map: str | None = Field(default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    key: str | None = Field(
        default=None,
        pattern=SECRET_KEY_PATTERN,
        max_length=253,
        description="the key is the file name the eval reads; end it in .jsonl for JSON lines",
    )
    uri: EvalDatasetUri | None = Field(
        default=None,
        max_length=1024,
        description="hf://ORG/NAME[@REV]/PATH (hf://datasets/ORG/NAME/PATH for a dataset repo),"
        " s3://BUCKET/KEY or pvc://CLAIM/PATH: one file; its name's suffix selects the format",
    )

    @model_validator(mode="after")
    def _one_form(self) -> EvalDataset:
        has_config_map = self.config_map is not None and self.key is not None
        has_any_config_map = self.config_map is not None or self.key is not None
        if (self.uri is not None) == has_any_config_map or (
            self.uri is None and not has_config_map
        ):
            raise ValueError(_ONE_DATASET_FORM)
        if self.uri is not None:
            parse_dataset_uri(self.uri)  # the runtime's own check, the same message
        return self


class Evaluation(_Model):
    """Quality measured per level on the user's eval set (`kvpilot-runtime eval` in a Job per
    level); a level is admitted once its measured loss is within maxQualityLoss."""

    dataset: EvalDataset
    metric: QualityMetric = Field(
        default="perplexity",
        description="perplexity (text), agreement (greedy tokens vs the unquantised model, text)"
        " or exact-match (prompt/answer pairs)",
    )
    max_quality_loss: float = Field(
        ge=0,
        le=100,
        description="percent: the largest relative loss vs the unquantised model a level may have"
        " (perplexity increase, 1 - agreement, or exact-match drop); e.g. 0.5",
    )


_INT4_ALONE = (
    "with evaluation, allowed needs bf16 or int8 as well: int4 is served only once measured,"
    " and something must serve until then"
)


class QuantizationPolicy(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.allowed.exists(q, q == 'bf16'"
                " || (q == 'int8' && self.maxQualityLoss != 'none')"
                " || (q == 'int4' && self.maxQualityLoss == 'medium'))",
                "no level in allowed is within maxQualityLoss (none: bf16; low: bf16, int8)",
            ),
            (
                "!has(self.evaluation) || self.allowed.exists(q, q != 'int4')",
                _INT4_ALONE,
            ),
        )
    )

    allowed: list[Quantization] = Field(
        default_factory=lambda: list(QUALITY_LOSS_LEVELS["medium"]),  # type: ignore[arg-type]
        min_length=1,
        max_length=3,
        description="quantisation levels in order of preference",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    max_quality_loss: QualityLoss = Field(
        default="medium",
        description="none: bf16 only; low: up to int8; medium: up to int4. With evaluation set,"
        " the fallback until a level is measured, capped at low",
    )
    evaluation: Evaluation | None = Field(
        default=None,
        description="measure each level (and each of spec.model.variants) on this eval set"
        " against spec.model unquantised, and admit it by its measured loss; spec.model must be"
        " a 16-bit checkpoint (list pre-quantised ones under spec.model.variants)",
    )

    @model_validator(mode="after")
    def _some_level_admitted(self) -> QuantizationPolicy:
        if not allowed_quantizations(self):
            raise ValueError(
                "no level in allowed is within maxQualityLoss (none: bf16; low: bf16, int8)"
            )
        if self.evaluation is not None and set(self.allowed) == {"int4"}:
            raise ValueError(_INT4_ALONE)
        return self


class Placement(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "!('auto' in self.nodeTypes) || size(self.nodeTypes) == 1",
                "nodeTypes is either [auto] or a list of node type names",
            ),
            (
                "self.minGpusPerReplica <= self.maxGpusPerReplica",
                "minGpusPerReplica must be <= maxGpusPerReplica",
            ),
        )
    )

    node_types: list[str] = Field(
        default_factory=lambda: ["auto"],
        min_length=1,
        max_length=64,
        description="[auto] for every GPU node type in the cluster, or node type names",
        json_schema_extra={
            "x-kubernetes-list-type": "set",
            "items": {"type": "string", "maxLength": 63, "pattern": DNS_LABEL_PATTERN},
        },
    )
    prefer: Prefer = "quality"
    max_gpus_per_replica: int = Field(default=8, ge=1, le=8)
    min_gpus_per_replica: int = Field(
        default=1,
        ge=1,
        le=8,
        description="tensor parallelism of at least this many GPUs, even where fewer hold the"
        " model (lower latency per token); degrees that do not divide the KV heads are skipped",
    )

    @model_validator(mode="after")
    def _auto_alone(self) -> Placement:
        if "auto" in self.node_types and len(self.node_types) != 1:
            raise ValueError("nodeTypes is either [auto] or a list of node type names")
        if self.min_gpus_per_replica > self.max_gpus_per_replica:
            raise ValueError("minGpusPerReplica must be <= maxGpusPerReplica")
        return self


class LatencySlo(_Model):
    """The TTFT, and optionally the time per output token, a share of requests must get (issue
    33). Only the builtin autoscaler holds it, so it is refused with any other mode rather than
    accepted and ignored. A TPOT target caps the batch each replica may run (the decode step
    grows with the batch, so a bigger batch is a slower stream), which the sizing then honours."""

    ttft_seconds: float = Field(
        gt=0,
        le=3600,
        description="time to first token the percentile of requests must get, in seconds",
    )
    percentile: float = Field(
        default=POLICY_DEFAULTS.slo_percentile,
        ge=50,
        lt=100,
        description="share of requests, in percent, whose TTFT ttftSeconds (and TPOT"
        " tpotSeconds) bounds",
    )
    tpot_seconds: float | None = Field(
        default=None,
        gt=0,
        le=60,
        description="time per output token after the first (a request's decode time over its"
        " output tokens but one) the percentile of requests must get, in seconds",
    )


class Autoscaling(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
            (
                "!has(self.slo) || self.mode == 'builtin'",
                "slo is held by the builtin autoscaler only: set mode builtin or remove slo",
            ),
        )
    )

    mode: AutoscalingMode = "builtin"
    min_replicas: int = Field(default=POLICY_DEFAULTS.min_replicas, ge=0, le=1000)
    max_replicas: int = Field(default=POLICY_DEFAULTS.max_replicas, ge=1, le=1000)
    target_queue_length: float = Field(
        default=POLICY_DEFAULTS.target_queue_length,
        gt=0,
        le=10_000,
        description="waiting requests per ready replica above which every request in flight"
        " gets a running slot",
    )
    target_kv_cache_utilization: float = Field(
        default=POLICY_DEFAULTS.target_kv_cache_utilization,
        gt=0,
        le=1,
        alias="targetKVCacheUtilization",
        description="KV-cache usage (1-minute mean, waiting requests counted as demand) the"
        " replica count aims at",
    )
    scale_up_stabilization_seconds: int = Field(
        default=int(POLICY_DEFAULTS.scale_up_stabilization_seconds), ge=0, le=3600
    )
    scale_down_stabilization_seconds: int = Field(
        default=int(POLICY_DEFAULTS.scale_down_stabilization_seconds), ge=0, le=86_400
    )
    scale_to_zero_idle_seconds: int = Field(
        default=int(POLICY_DEFAULTS.scale_to_zero_idle_seconds),
        ge=0,
        le=86_400,
        description="with minReplicas 0: no request in flight for this long scales to zero",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="total replicas when mode is off or external (the scale subresource's target)",
    )
    slo: LatencySlo | None = Field(
        default=None,
        description="a TTFT target the builtin autoscaler sizes the fleet for"
        " (docs/autoscaling.md); the queue and KV targets stay as guards",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must be <= maxReplicas")
        if self.slo is not None and self.mode != "builtin":
            raise ValueError(
                "slo is held by the builtin autoscaler only: set mode builtin or remove slo"
            )
        return self


class EnvVar(_Model):
    name: str = Field(min_length=1, max_length=256)
    value: str = ""


_ONE_DISK_VOLUME = (
    "kvOffload.disk: give at most one of claimName or hostPath (neither: an emptyDir)"
)
_OFFLOAD_NEEDS_ONE_GPU = (
    "runtime.kvOffload needs one GPU per replica (the runtime copies no other rank's KV shard):"
    " set placement.minGpusPerReplica to 1 or remove kvOffload"
)
_OFFLOAD_NO_DRAFT = (
    "runtime.kvOffload does not work with speculative method draft_model (the draft's own KV is"
    " not copied): use ngram or remove kvOffload"
)


class KvOffloadDisk(_Model):
    """The disk tier: KV blocks the host tier evicts, one file each, on a volume mounted at a
    fixed path. An emptyDir lives as long as the pod; a PersistentVolumeClaim or a hostPath
    outlives it, so a pod restarted with the same volume (on the same node, for a hostPath)
    starts with a warm prefix cache. Replicas that mount the same directory share its files."""

    model_config = ConfigDict(
        json_schema_extra=_cel(("!(has(self.claimName) && has(self.hostPath))", _ONE_DISK_VOLUME))
    )

    size_gi_b: float = Field(
        alias="sizeGiB", gt=0, le=1_048_576, description="GiB of block files the tier keeps"
    )
    claim_name: str | None = Field(
        default=None,
        pattern=DNS_SUBDOMAIN_PATTERN,
        max_length=253,
        description="a PersistentVolumeClaim in this namespace (ReadWriteMany for replicas on"
        " several nodes); default: an emptyDir of sizeGiB",
    )
    host_path: str | None = Field(
        default=None,
        pattern=r"^/[^\s]*$",
        max_length=1024,
        description="a directory on the node (created if missing); default: an emptyDir",
    )

    @model_validator(mode="after")
    def _one_volume(self) -> KvOffloadDisk:
        if self.claim_name is not None and self.host_path is not None:
            raise ValueError(_ONE_DISK_VOLUME)
        return self


class KvOffload(_Model):
    """KV tiers below the GPU pool (the runtime's --kv-offloading-size and its disk tier):
    evicted prefix blocks are kept in host memory, then on disk, and a later prefix hit copies
    them back instead of recomputing them. The container's memory request (and its limit, if
    one is set) grows by hostGiB, and the planner counts it against each node type's memory."""

    host_gi_b: float = Field(
        alias="hostGiB",
        gt=0,
        le=65_536,
        description="GiB of host memory per replica for KV blocks evicted from the GPU pool",
    )
    disk: KvOffloadDisk | None = Field(
        default=None, description="a disk tier under the host tier; none when absent"
    )

    @property
    def host_bytes(self) -> int:
        """The host tier's memory, rounded up to a whole MiB."""
        return math.ceil(self.host_gi_b * GIB / MIB) * MIB


class Runtime(_Model):
    image: str | None = Field(default=None, description="default: the operator's runtime image")
    engine: Literal["kvpilot"] = "kvpilot"
    resources: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="requests/limits for cpu and memory, merged with the GPUs"
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    pod_template: dict[str, Any] = Field(
        default_factory=dict,
        description="merged over the generated pod template (metadata, spec)",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    kv_offload: KvOffload | None = Field(
        default=None, description="host-memory and disk KV tiers below the GPU pool"
    )


class Monitoring(_Model):
    pod_monitor: bool = Field(
        default=False, description="create a PodMonitor when monitoring.coreos.com is installed"
    )


class SecretKeyRef(_Model):
    """One key of a Secret in the ModelDeployment's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    key: str = Field(pattern=SECRET_KEY_PATTERN, max_length=253)


class ProviderFallback(_Model):
    """An external OpenAI-compatible endpoint (its base URL includes /v1)."""

    base_url: str = Field(
        alias="baseURL",
        pattern=BASE_URL_PATTERN,
        max_length=2048,
        description="e.g. https://api.example.com/v1",
    )
    model: str = Field(min_length=1, max_length=256, description="the provider's model name")
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="the Secret key holding the API key (sent as a bearer token); none: no key",
    )


class Fallback(_Model):
    """Exactly one of another ModelDeployment in this namespace or an external provider."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "has(self.modelDeployment) != has(self.provider)",
                "a fallback names exactly one of modelDeployment or provider",
            )
        )
    )

    model_deployment: str | None = Field(
        default=None,
        pattern=DNS_LABEL_PATTERN,
        max_length=63,
        description="another ModelDeployment in this namespace (e.g. a smaller model)",
    )
    provider: ProviderFallback | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Fallback:
        if (self.model_deployment is None) == (self.provider is None):
            raise ValueError("a fallback names exactly one of modelDeployment or provider")
        return self


class PortNumber(_Model):
    number: int = Field(ge=1, le=65535)


class EndpointPickerRef(_Model):
    """The Gateway API Inference Extension's endpoint picker for this model's InferencePool
    (the same field as InferencePool's spec.endpointPickerRef)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.kind != 'Service' || has(self.port)",
                "port is required when kind is 'Service' or unspecified",
            )
        )
    )

    group: str = Field(default="", max_length=253, pattern=r"^$|^" + DNS_SUBDOMAIN_PATTERN[1:])
    kind: str = Field(
        default="Service",
        min_length=1,
        max_length=63,
        pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
    )
    name: str = Field(min_length=1, max_length=253)
    port: PortNumber | None = Field(
        default=None, description="the picker Service's port (not the target port)"
    )
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"

    @model_validator(mode="after")
    def _port_for_service(self) -> EndpointPickerRef:
        if self.kind == "Service" and self.port is None:
            raise ValueError("port is required when kind is 'Service' or unspecified")
        return self


class CascadeWhen(_Model):
    """What a request must be for a cascade rule to send it elsewhere (every condition given)."""

    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="at most this many prompt tokens, counted by the gateway as the prompt's"
        " UTF-8 bytes (an upper bound: every token covers at least one byte)",
    )
    no_tools: bool = Field(default=False, description="true: only requests without tools")


class CascadeRule(_Model):
    """Send matching requests to another ModelDeployment (e.g. a smaller, cheaper model)."""

    when: CascadeWhen = Field(default_factory=CascadeWhen)
    model_deployment: str = Field(
        pattern=DNS_LABEL_PATTERN,
        max_length=63,
        description="another ModelDeployment in this namespace; the gateway uses its served name",
    )


class Routing(_Model):
    """How kvpilot-gateway routes to this model when its replicas cannot serve in time."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.fallbacks.all(f, !has(f.modelDeployment) || self.fallbacks.exists_one("
                "g, has(g.modelDeployment) && g.modelDeployment == f.modelDeployment))",
                "fallbacks name a ModelDeployment twice",
            ),
            (
                "self.fallbacks.all(f, !has(f.provider) || self.fallbacks.exists_one("
                "g, has(g.provider) && g.provider.baseURL == f.provider.baseURL"
                " && g.provider.model == f.provider.model))",
                "fallbacks name a provider (baseURL and model) twice",
            ),
        )
    )

    fallbacks: list[Fallback] = Field(
        default_factory=list,
        max_length=MAX_FALLBACKS,
        description="tried in order when no replica can take a request within"
        " fallbackAfterSeconds (cold start, saturation, failing replicas)",
    )
    fallback_after_seconds: int = Field(
        default=30, ge=1, le=600, description="how long a request waits for a replica first"
    )
    cascade: list[CascadeRule] = Field(
        default_factory=list,
        max_length=MAX_CASCADE_RULES,
        description="rules tried in order before a replica is picked: the first whose"
        " conditions hold sends the request to its modelDeployment instead",
    )
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        default=None,
        description="an Inference Extension endpoint picker: the operator then makes an"
        " InferencePool for this model where that CRD is installed",
    )

    @model_validator(mode="after")
    def _no_duplicates(self) -> Routing:
        keys = [fallback_key(f) for f in self.fallbacks]
        doubled = sorted({k for k in keys if keys.count(k) > 1})
        if doubled:
            raise ValueError(f"fallbacks name {', '.join(doubled)} twice")
        return self


_CPU_LORAS_BELOW = "lora.maxCpuLoras must be >= lora.maxLoras"
_ADAPTER_IS_BASE = "spec.adapters: an adapter's name is the base model's served name"
FETCHED_PREFIXES = tuple(f"{scheme}://" for scheme in FETCHED_SCHEMES)
_ADAPTERS_CACHE_VARIANTS = (
    "spec.adapters with hf:// or s3:// URIs, spec.model.cache and spec.model.variants together:"
    " the adapters are fetched into spec.model's cache, which the pods of a node type serving a"
    " variant do not mount; remove spec.model.cache or the variants, or give the adapters as"
    " pvc:// or file:// URIs"
)


class Adapter(_Model):
    """A LoRA adapter (PEFT format) served beside the base model: clients send its name as the
    request's `model`."""

    name: AdapterName = Field(
        max_length=128,
        description="the model name clients send; unique, and not the base model's served name",
    )
    uri: AdapterUri = Field(
        max_length=1024,
        description="hf://org/name[@revision], s3://bucket/prefix, pvc://claim/path or"
        " file:///path of a PEFT adapter directory (adapter_config.json and"
        " adapter_model.safetensors); a pvc:// claim is mounted read-only in the pods (a claim"
        " new to the spec rolls them once)",
    )
    secret_ref: SecretRef | None = Field(
        default=None,
        description="a Secret in this namespace whose keys (HF_TOKEN; AWS_ACCESS_KEY_ID,"
        " AWS_SECRET_ACCESS_KEY) the runtime fetches this adapter with; default:"
        " spec.model.secretRef's",
    )


class Lora(_Model):
    """The runtime's adapter slots (--max-loras, --max-lora-rank, --max-cpu-loras): fixed per
    pod, so adapters can come and go without a restart while these stay."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras", _CPU_LORAS_BELOW)
        )
    )

    max_loras: int = Field(
        default=DEFAULT_MAX_LORAS,
        ge=1,
        le=256,
        description="adapters resident for batching: one step mixes up to this many; each slot"
        " holds GPU memory the planner counts",
    )
    max_lora_rank: int = Field(
        default=DEFAULT_MAX_LORA_RANK,
        ge=1,
        le=512,
        description="the largest rank an adapter may have; adapters above it are refused",
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="adapters kept in host memory (least recently used evicted, re-read on"
        " demand); default: maxLoras",
    )

    @model_validator(mode="after")
    def _cpu_holds_the_resident(self) -> Lora:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(_CPU_LORAS_BELOW)
        return self


class ModelDeploymentSpec(_Model):
    model_config = ConfigDict(
        protected_namespaces=(),
        # The default served name comes from the URI, which CEL cannot parse: the operator
        # checks that one (_adapter_names); the apiserver the explicit one.
        json_schema_extra=_cel(
            (
                "!has(self.runtime) || !has(self.runtime.kvOffload) || !has(self.placement)"
                " || !has(self.placement.minGpusPerReplica)"
                " || self.placement.minGpusPerReplica <= 1",
                _OFFLOAD_NEEDS_ONE_GPU,
            ),
            (
                "!has(self.runtime) || !has(self.runtime.kvOffload) || !has(self.serving)"
                " || !has(self.serving.speculative)"
                " || self.serving.speculative.method != 'draft_model'",
                _OFFLOAD_NO_DRAFT,
            ),
            (
                "!has(self.model.servedName) || !has(self.adapters)"
                " || self.adapters.all(a, a.name != self.model.servedName)",
                _ADAPTER_IS_BASE,
            ),
            (
                "!has(self.adapters) || !has(self.model.cache) || !has(self.model.variants)"
                " || size(self.model.variants) == 0 || !self.adapters.exists(a,"
                " a.uri.startsWith('hf://') || a.uri.startsWith('s3://'))",
                _ADAPTERS_CACHE_VARIANTS,
            ),
        ),
    )

    model: ModelSource
    serving: Serving = Field(default_factory=Serving)
    quantization: QuantizationPolicy = Field(default_factory=QuantizationPolicy)
    placement: Placement = Field(default_factory=Placement)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    runtime: Runtime = Field(default_factory=Runtime)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    routing: Routing = Field(default_factory=Routing)
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters on this model, loaded into the running pods (added or"
        " removed without a restart)",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    lora: Lora | None = Field(
        default=None,
        description="the pods' adapter slots; LoRA is on when this or adapters is given",
    )

    @model_validator(mode="after")
    def _adapters_cache_one_claim(self) -> ModelDeploymentSpec:
        """Adapters are filled into spec.model's cache claim only (adapters/cache_fill.py)."""
        fetched = any(a.uri.startswith(FETCHED_PREFIXES) for a in self.adapters)
        if fetched and self.model.cache is not None and self.model.variants:
            raise ValueError(_ADAPTERS_CACHE_VARIANTS)
        return self

    @model_validator(mode="after")
    def _adapter_names(self) -> ModelDeploymentSpec:
        names = [a.name for a in self.adapters]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"spec.adapters: name {', '.join(doubled)} is given twice")
        base = served_name(self.model)
        if base in names:
            raise ValueError(
                f"spec.adapters: name {base!r} is the base model's served name; clients could"
                " not tell them apart: give the adapter another name"
            )
        secrets = adapter_secrets(self)
        if len(secrets) > 1:
            raise ValueError(
                f"spec.adapters: the adapters are fetched with Secrets {', '.join(secrets)}"
                " (their secretRef, else spec.model.secretRef); the runtime fetches every"
                " adapter with one environment: give them all the same Secret"
            )
        return self

    @property
    def lora_enabled(self) -> bool:
        return self.lora is not None or bool(self.adapters)

    @property
    def lora_slots(self) -> Lora:
        return self.lora or Lora()

    @model_validator(mode="after")
    def _kv_offload_runs(self) -> ModelDeploymentSpec:
        """What the runtime refuses beside --kv-offloading-size (engine_config), refused here."""
        if self.runtime.kv_offload is None:
            return self
        if self.placement.min_gpus_per_replica > 1:
            raise ValueError(_OFFLOAD_NEEDS_ONE_GPU)
        speculative = self.serving.speculative
        if speculative is not None and speculative.method == "draft_model":
            raise ValueError(_OFFLOAD_NO_DRAFT)
        return self


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0


class PlanEntry(_Model):
    """One node type's verdict: what runs there, or why nothing can."""

    node_type: str
    fits: bool
    quantization: str = ""
    tensor_parallel: int = 0
    weights_gi_b: float = Field(default=0.0, alias="weightsGiB")
    kv_cache_gi_b: float = Field(default=0.0, alias="kvCacheGiB")
    overhead_gi_b: float = Field(default=0.0, alias="overheadGiB")
    usable_gi_b: float = Field(default=0.0, alias="usableGiB")
    max_concurrency: int = 0
    price_per_hour: float = 0.0
    replicas: int = 0
    variant: str = Field(
        default="",
        description="the spec.model.variants[] entry served here; empty: spec.model itself",
    )
    quality_loss: float | None = Field(
        default=None, description="the level's measured loss in percent; null: not measured"
    )
    reason: str = Field(
        default="",
        description="why nothing fits; where it fits and several sources fit its level, why"
        " this one won (fewer GPUs, fewer weight bytes, a lower measured loss, or listed first)",
    )


class QualityMeasurement(_Model):
    """One level, or one spec.model.variants[] checkpoint, measured on the eval set by
    `kvpilot-runtime eval` (quality/admission.py)."""

    level: str = Field(description="the level measured; a variant's: the level it runs at")
    variant: str = Field(
        default="",
        description="the spec.model.variants[] name measured; empty: kvpilot's level of spec.model",
    )
    metric: str
    value: float
    relative_loss: float = Field(description="percent worse than the unquantised model")
    dataset_digest: str
    model_revision: str = Field(default="", description="the model URI with its revision")
    measured_at: str = ""
    node_type: str = Field(default="", description="where the eval Job ran")
    reference: str = Field(
        default="bf16",
        description="the level relativeLoss is measured against: bf16 (the unquantised weights),"
        " or the largest level a node type fits when none fits bf16",
    )


class ColdStartSample(_Model):
    pod: str
    ready_at: float = Field(description="unix seconds the pod became Ready")
    seconds: float = Field(description="pod created -> Ready")
    node_type: str = Field(default="", description="the node type the pod ran on")


class ColdStartSpread(_Model):
    """Median and p95 of one node type's cold starts."""

    median_seconds: float
    p95_seconds: float
    samples: int


class ColdStartStatus(_Model):
    """Pod created -> Ready of the recent replicas (issue 33): how far ahead a TTFT SLO's
    forecast looks (the median)."""

    median_seconds: float
    p95_seconds: float
    samples: int
    by_node_type: dict[str, ColdStartSpread] = Field(
        default_factory=dict,
        description="per node type: the forecast looks ahead by the median of the node type new"
        " replicas go to, once it has samples",
    )
    recent: list[ColdStartSample] = Field(default_factory=list, max_length=100)


class SloStatus(_Model):
    """How the SLO holds: the share of requests over the last window whose time to first token
    (and time per output token) met the target, from the runtimes' histograms (issue 33)."""

    ttft_seconds: float
    percentile: float
    window_seconds: int
    attainment: float | None = Field(
        default=None, description="share of requests (0-1) within ttftSeconds; null: no requests"
    )
    tpot_seconds: float | None = None
    tpot_attainment: float | None = Field(
        default=None,
        description="share of requests (0-1) within tpotSeconds; null: no TPOT target, or no"
        " request made two tokens",
    )
    met: bool | None = Field(
        default=None,
        description="every attainment measured >= percentile/100; null: nothing measured yet",
    )


class AutoscalingStatus(_Model):
    """Written by the autoscaler; kept in status so a restart loses nothing (DESIGN.md §3.5)."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )

    desired_replicas: int | None = None
    last_decision: str | None = None
    last_scale_time: str | None = None
    metrics: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    replicas_per_node_type: dict[str, int] = Field(
        default_factory=dict, description="the autoscaler's spread; the reconcile applies it"
    )
    cold_start: ColdStartStatus | None = None
    slo: SloStatus | None = None


class CacheStatus(_Model):
    """The model cache as the fill Job reports it."""

    claim_name: str
    variant: str = Field(
        default="", description="the spec.model.variants[] it holds; '': spec.model"
    )
    phase: Literal["Pending", "Downloading", "Cached", "Failed"]
    bytes: int | None = None
    files: int | None = None
    duration_seconds: float | None = None
    message: str = ""


class CostFigures(_Model):
    """Price of the replicas running and the traffic they completed over the window."""

    price_per_hour: float = Field(description="replicas x price of a replica-hour")
    requests_per_second: float
    output_tokens_per_second: float
    # None (no traffic or no price) is written as a removal (merge patch): never required
    per_thousand_requests: float | None = Field(
        default=None, description="None: no traffic or no price"
    )
    per_million_output_tokens: float | None = None


class NodeTypeCost(CostFigures):
    replicas: int


class CostStatus(CostFigures):
    """Cost per 1,000 requests and per 1M output tokens on measured traffic (planning/cost.py)."""

    currency: str = "USD"
    window: str = Field(description="the PromQL range the rates were taken over, e.g. 5m")
    measured_at: str = ""
    reason: str = Field(default="", description="why a figure is null")
    node_types: dict[str, NodeTypeCost] = Field(default_factory=dict)


class AdapterStatus(_Model):
    """Where one spec.adapters entry is loaded (written by the adapter sync, adapters/sync.py)."""

    name: str
    uri: str
    pods: list[str] = Field(
        default_factory=list, description="the ready runtime pods that serve it now"
    )
    message: str = Field(default="", description="why a pod could not load it, if one could not")


class ModelDeploymentStatus(_Model):
    model_config = ConfigDict(extra="ignore")

    observed_generation: int = 0
    conditions: list[Condition] = Field(default_factory=list)
    plan: list[PlanEntry] = Field(default_factory=list)
    replicas: int = 0
    ready_replicas: int = 0
    selector: str = ""
    quantization: str = Field(default="", description="quantisation of the first node type in use")
    endpoint: str = ""
    autoscaling: AutoscalingStatus = Field(default_factory=AutoscalingStatus)
    cache: CacheStatus | None = None
    variant_caches: list[CacheStatus] = Field(
        default_factory=list,
        max_length=MAX_VARIANTS,
        description="with spec.model.cache, each variant's cache (status.cache is spec.model's)",
    )
    cost: CostStatus | None = None
    quality: list[QualityMeasurement] = Field(default_factory=list)
    adapters: list[AdapterStatus] = Field(default_factory=list, max_length=MAX_ADAPTERS)


def parse_spec(spec: dict[str, Any]) -> ModelDeploymentSpec:
    """The spec as the apiserver stored it (defaults applied there, too) as a typed model."""
    return ModelDeploymentSpec.model_validate(dict(spec))


def allowed_quantizations(policy: QuantizationPolicy) -> tuple[str, ...]:
    """The user's preference order, without the levels their tolerated quality loss excludes."""
    admitted = QUALITY_LOSS_LEVELS[policy.max_quality_loss]
    return tuple(q for q in policy.allowed if q in admitted)


def draft_source(spec: ModelDeploymentSpec) -> ModelSource | None:
    """spec.serving.speculative's draft model as a model source (its facts come from the catalog
    or its config.json, as spec.model's do); None when the spec names no draft."""
    speculative = spec.serving.speculative
    if speculative is None or speculative.model is None:
        return None
    return ModelSource(uri=speculative.model)


def served_name(source: ModelSource) -> str:
    """The spec's servedName, else the URI's last path element (without an hf:// @revision)."""
    return resource.served_name(source.uri, source.served_name)


def adapter_secrets(spec: ModelDeploymentSpec) -> list[str]:
    """The Secrets the adapters are fetched with, sorted: each one's secretRef, else
    spec.model's."""
    refs = [a.secret_ref or spec.model.secret_ref for a in spec.adapters]
    return sorted({ref.name for ref in refs if ref is not None})


def fallback_key(fallback: Fallback) -> str:
    """What makes two fallbacks the same: the ModelDeployment, or the provider's URL and model."""
    if fallback.provider is not None:
        return f"provider {fallback.provider.base_url} {fallback.provider.model}"
    return f"modelDeployment {fallback.model_deployment}"


def check_routing(md_name: str, spec: ModelDeploymentSpec) -> None:
    """What the spec alone cannot check: a ModelDeployment falling back to itself or cascading
    to itself (the CRD's root CEL rules say the same at `kubectl apply`)."""
    if any(f.model_deployment == md_name for f in spec.routing.fallbacks):
        raise ValueError(f"spec.routing.fallbacks: {md_name} cannot fall back to itself")
    if any(rule.model_deployment == md_name for rule in spec.routing.cascade):
        raise ValueError(f"spec.routing.cascade: {md_name} cannot cascade to itself")
