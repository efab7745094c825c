"""Quantisation admitted by quality measured on the user's eval set (spec.quantization.evaluation).

Pure. Each level in `allowed` is measured by an eval Job (`kvpilot-runtime eval` for that level
against the unquantised model, in the compute dtype the runtime serves in); its relative loss, in
percent, is admitted when within `evaluation.maxQualityLoss`. Until a level is measured the
category (`maxQualityLoss`, capped at `low`) decides for it, and the condition QualityMeasured
says False and why.

Measurements are cached in a ConfigMap per model URI in the namespace (quality_job.cache_name),
keyed by level, metric and dataset (its digest, or its URI: dataset_key), not in the operator's
memory: they survive a restart, a re-plan or a second ModelDeployment of the same model reads
them instead of measuring again, and `kubectl get cm` shows them. The eval Jobs (quality/job.py)
are named by what they measure, so two ModelDeployments waiting for the same level share one Job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.planner import NodePlan
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import manifests

Obj = Mapping[str, Any]

QUALITY_MEASURED = "QualityMeasured"
# The levels the category fallback may admit while nothing is measured: int4 only by measurement.
UNMEASURED_CAP = "low"
LOG_TAIL_CHARS = 600


@dataclass(frozen=True)
class EvalRun:
    """One eval Job and its pods, as the controller read them."""

    job: Obj
    pods: Sequence[Obj] = ()


@dataclass(frozen=True)
class Observed:
    """What the controller read for one pass: the dataset's key (dataset_key; or why it has
    none), the cache's records and the eval Jobs of this model, by Job name."""

    dataset_key: str = ""
    dataset_error: str = ""
    records: Mapping[str, str] = field(default_factory=dict)
    runs: Mapping[str, EvalRun] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    levels: tuple[str, ...]  # admitted, in the user's preference order
    pending: tuple[str, ...] = ()  # not measured yet: the category decided for them
    excluded: tuple[str, ...] = ()  # "int4: +3.10% > 0.50%"
    # spec.model.variants[] the planner may serve, as (name, level measured); None: not gated
    # (no eval set), every variant may be planned (quality/variants.py)
    variants: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class Assessment:
    """This pass's verdict on quality, and what the controller must write for it."""

    admission: Admission
    measurements: tuple[api.QualityMeasurement, ...] = ()
    condition: api.Condition | None = None
    jobs_to_create: tuple[manifests.Manifest, ...] = ()
    jobs_to_delete: tuple[Obj, ...] = ()  # read into the cache: no longer needed
    new_records: Mapping[str, str] = field(default_factory=dict)  # cache key -> JSON


def dataset_digest(data: bytes) -> str:
    """The digest `kvpilot-runtime eval` reports for the same bytes (evaluate.dataset_digest)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def dataset_key(dataset: api.EvalDataset, content_digest: str = "") -> str:
    """What measurements are cached and eval Jobs named by: the content digest where the operator
    reads the eval set (a ConfigMap), else the URI's hash. Only the Job reads an hf://, s3:// or
    pvc:// file (with the model's credentials); it reports the content digest, which the
    measurement records. So pin hf:// revisions: a changed s3:// or pvc:// file under the same
    URI is measured again only once its records are dropped from the cache ConfigMap."""
    if dataset.uri is None:
        return content_digest
    return f"uri-{manifests.spec_hash(dataset.uri)}"


def record_key(level: str, metric: str, digest: str, reference: str = "bf16") -> str:
    """A ConfigMap key: [-._a-zA-Z0-9], so the digest's hex without its `sha256:` prefix.
    `digest`: a dataset_key. A loss against another reference than bf16 is another record."""
    against = "" if reference == "bf16" else f"vs-{reference}."
    return f"{level}.{against}{metric}.{digest.removeprefix('sha256:')[:32]}"


def failure_key(level: str, metric: str, digest: str, reference: str = "bf16") -> str:
    """The cache key counting the failed eval Jobs of one measurement (the retry's back-off)."""
    return f"failed.{record_key(level, metric, digest, reference)}"


def attempt(run: EvalRun) -> int:
    """Which attempt at its measurement a Job is (quality_job.ANNOTATION_ATTEMPT)."""
    raw = _annotation(run, quality_job.ANNOTATION_ATTEMPT, "1")
    return int(raw) if raw.isdigit() else 1


def failed_attempts(records: Mapping[str, str], key: str) -> int:
    raw = records.get(key, "0")
    return int(raw) if raw.isdigit() else 0


def reference_level(reference: NodePlan | None) -> str:
    """The level losses are relative to: the reference node's (bf16 unless none fits it)."""
    return reference.quantization if reference is not None else "bf16"


def fits_at(level: str, reference: str) -> bool:
    """A level no larger than the reference: one that some node type fits for an eval."""
    order = planner.REFERENCE_LEVELS
    return order.index(level) >= order.index(reference)


def fallback_levels(policy: api.QuantizationPolicy) -> tuple[str, ...]:
    """Levels admitted without a measurement: the category's, capped at `low` when an eval set
    is given (int4 must prove itself)."""
    if policy.evaluation is None:
        return api.allowed_quantizations(policy)
    order = list(api.QUALITY_LOSS_LEVELS)
    category = min(order.index(policy.max_quality_loss), order.index(UNMEASURED_CAP))
    admitted = api.QUALITY_LOSS_LEVELS[order[category]]
    return tuple(q for q in policy.allowed if q in admitted)


def admit(
    policy: api.QuantizationPolicy, losses: Mapping[str, float], reference: str = "bf16"
) -> Admission:
    """Levels within the budget by their measured loss (percent); unmeasured ones by the
    category fallback; levels larger than the `reference` fit no node type (so neither an eval
    nor a replica) and are excluded. Without an eval set: the category alone."""
    if policy.evaluation is None:
        return Admission(api.allowed_quantizations(policy))
    budget, fallback = policy.evaluation.max_quality_loss, fallback_levels(policy)
    levels, pending, excluded = [], [], []
    for level in policy.allowed:
        if not fits_at(level, reference):
            excluded.append(f"{level}: fits no node type")
        elif level not in losses:
            pending.append(level)
            if level in fallback:
                levels.append(level)
        elif losses[level] <= budget:
            levels.append(level)
        else:
            excluded.append(f"{level}: {losses[level]:+.2f}% > {budget:g}%")
    return Admission(tuple(levels), tuple(pending), tuple(excluded))


def parse_record(raw: str) -> api.QualityMeasurement | None:
    """A cached measurement; None for one that does not parse (then it is measured again)."""
    try:
        return api.QualityMeasurement.model_validate_json(raw)
    except ValueError:
        return None


def cached(
    records: Mapping[str, str],
    levels: Sequence[str],
    metric: str,
    digest: str,
    reference: str = "bf16",
) -> dict[str, api.QualityMeasurement]:
    found = {
        level: parse_record(records.get(record_key(level, metric, digest, reference), ""))
        for level in levels
    }
    return {level: m for level, m in found.items() if m is not None}


def job_outcome(
    run: EvalRun, level: str, uri: str, now: str, variant: str = ""
) -> api.QualityMeasurement | str | None:
    """The Job's measurement (of `level`, or of the checkpoint `variant`), why it failed for good
    (its last pod's log tail), or None while it runs (or retries)."""
    job_status = run.job.get("status") or {}
    finished = {
        c.get("type"): c for c in job_status.get("conditions") or [] if c.get("status") == "True"
    }
    if "Complete" in finished:
        found = _measurement(run, level, uri, now, variant)
        return found or "the eval Job finished without a summary"
    if "Failed" in finished:
        why = finished["Failed"].get("message") or finished["Failed"].get("reason") or "failed"
        tail = log_tail(run.pods)
        return f"{why}: {tail}" if tail else why
    return None


def _measurement(
    run: EvalRun, level: str, uri: str, now: str, variant: str = ""
) -> api.QualityMeasurement | None:
    """From the succeeded pod's termination message: the eval's JSON summary (eval_report.summary);
    a variant's row is under `checkpoints`, with the level it runs at."""
    for pod in run.pods:
        if (pod.get("status") or {}).get("phase") != "Succeeded":
            continue
        try:
            summary = json.loads(terminated(pod).get("message") or "")
            row = summary["checkpoints"][variant] if variant else summary["levels"][level]
            return api.QualityMeasurement(
                level=str(row["level"]) if variant else level,
                variant=variant,
                metric=summary["metric"],
                value=round(float(row["value"]), 6),
                relative_loss=round(100 * float(row["relative_loss"]), 4),
                dataset_digest=summary["dataset_digest"],
                model_revision=uri,
                # The Job's completion, not this pass's clock: every reader records the same.
                measured_at=(run.job.get("status") or {}).get("completionTime") or now,
                node_type=_annotation(run, quality_job.ANNOTATION_NODE_TYPE, ""),
                reference=_annotation(run, quality_job.ANNOTATION_REFERENCE, "bf16"),
            )
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _annotation(run: EvalRun, name: str, default: str) -> str:
    return str(((run.job.get("metadata") or {}).get("annotations") or {}).get(name, default))


def log_tail(pods: Sequence[Obj]) -> str:
    """The newest failed pod's termination message (its log's tail: FallbackToLogsOnError)."""
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    failed.sort(key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "")
    for pod in reversed(failed):
        text = " | ".join((terminated(pod).get("message") or "").strip().splitlines())
        if text:
            return text[-LOG_TAIL_CHARS:]
    return ""


def terminated(pod: Obj) -> Obj:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return (statuses[0].get("state") or {}).get("terminated") or {}


def assess(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    observed: Observed,
    reference: NodePlan | None,
    config: OperatorConfig,
    now: str,
) -> Assessment:
    """Admitted levels, status.quality, the condition, and the Jobs and records to write.

    `reference`: where an eval Job runs (planner.reference_plan: a node type that fits bf16, else
    the largest level some node type fits, which losses are then relative to), or None."""
    policy = spec.quantization
    if policy.evaluation is None:
        return Assessment(admit(policy, {}))
    if observed.dataset_error:
        admission = admit(policy, {})
        reason = f"{observed.dataset_error}; {_fallback_text(admission)}"
        return Assessment(admission, condition=_condition(False, "DatasetUnreadable", reason))
    evaluation = policy.evaluation
    keys = _Keys(
        spec.model.uri, evaluation.metric, observed.dataset_key, reference_level(reference)
    )
    measurable = [q for q in policy.allowed if fits_at(q, keys.reference)]
    measured = cached(observed.records, measurable, keys.metric, keys.digest, keys.reference)
    pending_jobs: dict[str, str] = {q: keys.job(q) for q in measurable if q not in measured}
    read = _read_runs(observed, pending_jobs, spec, now)
    measured.update(read.measured)
    admission = admit(policy, {q: m.relative_loss for q, m in measured.items()}, keys.reference)
    missing = [q for q in admission.pending if q not in read.failures and q not in read.running]
    return Assessment(
        admission,
        measurements=tuple(measured[q] for q in policy.allowed if q in measured),
        condition=_status_condition(admission, read, reference, evaluation, measured),
        jobs_to_create=()
        if reference is None
        else tuple(
            _eval_job(md, spec, q, reference, keys, observed.records, config) for q in missing
        ),
        jobs_to_delete=tuple(observed.runs[pending_jobs[q]].job for q in read.measured),
        new_records=_new_records(read, keys),
    )


@dataclass(frozen=True)
class _Keys:
    """What names a measurement's Job, record and failure count, but for its level."""

    uri: str
    metric: str
    digest: str  # dataset_key
    reference: str = "bf16"

    def job(self, level: str) -> str:
        return quality_job.job_name(self.uri, level, self.metric, self.digest, self.reference)

    def record(self, level: str) -> str:
        return record_key(level, self.metric, self.digest, self.reference)

    def failures(self, level: str) -> str:
        return failure_key(level, self.metric, self.digest, self.reference)


def _eval_job(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    level: str,
    reference: NodePlan,
    keys: _Keys,
    records: Mapping[str, str],
    config: OperatorConfig,
) -> manifests.Manifest:
    """The next attempt at measuring `level`: one more than the failed Jobs recorded."""
    attempt = 1 + failed_attempts(records, keys.failures(level))
    return quality_job.build_eval_job(md, spec, level, reference, keys.digest, config, attempt)


def _new_records(read: _Runs, keys: _Keys) -> dict[str, str]:
    """The measurements read from Jobs, and the attempt each failed Job was."""
    measured = {keys.record(q): m.model_dump_json(by_alias=True) for q, m in read.measured.items()}
    failed = {keys.failures(q): str(n) for q, n in read.failed_attempts.items()}
    return {**measured, **failed}


@dataclass(frozen=True)
class _Runs:
    measured: dict[str, api.QualityMeasurement]
    failures: dict[str, str]
    running: tuple[str, ...]
    failed_attempts: dict[str, int]  # level -> which attempt its failed Job was


def _read_runs(
    observed: Observed, names: Mapping[str, str], spec: api.ModelDeploymentSpec, now: str
) -> _Runs:
    """`names`: the eval Job's name per level still to be measured."""
    measured, failures, running, attempts = {}, {}, [], {}
    for level, name in names.items():
        run = observed.runs.get(name)
        outcome = None if run is None else job_outcome(run, level, spec.model.uri, now)
        if isinstance(outcome, api.QualityMeasurement):
            measured[level] = outcome
        elif isinstance(outcome, str) and run is not None:
            attempts[level] = attempt(run)
            minutes = quality_job.retry_delay_seconds(attempts[level]) // 60
            failures[level] = f"{outcome} [attempt {attempts[level]}, next in {minutes} min]"
        elif run is not None:
            running.append(level)
    return _Runs(measured, failures, tuple(running), attempts)


def _status_condition(
    admission: Admission,
    read: _Runs,
    reference: NodePlan | None,
    evaluation: api.Evaluation,
    measured: Mapping[str, api.QualityMeasurement],
) -> api.Condition:
    losses = ", ".join(f"{q} {m.relative_loss:+.2f}%" for q, m in measured.items())
    ref = reference_level(reference)
    against = "unquantised" if ref == "bf16" else f"{ref}, the largest level a node type fits"
    verdict = f"{evaluation.metric} loss vs {against}: {losses or 'none measured yet'}"
    verdict = f"{verdict}; budget {evaluation.max_quality_loss:g}%"
    if admission.excluded:
        verdict = f"{verdict}; excluded {', '.join(admission.excluded)}"
    if not admission.pending:
        return _condition(True, "Measured", verdict)
    if read.failures:
        failed = "; ".join(f"{q}: {why}" for q, why in read.failures.items())
        text = f"eval failed ({failed}); retried when the failed Job expires (the wait doubles)"
        return _condition(False, "EvalFailed", f"{text}; {_fallback_text(admission)}")
    if reference is None:
        text = "no node type fits the model at any level for an eval Job"
        return _condition(False, "NoReferenceNode", f"{text}; {_fallback_text(admission)}")
    where = f"measuring {', '.join(admission.pending)} on {reference.node_type.name}"
    return _condition(False, "Measuring", f"{where}; {verdict}; {_fallback_text(admission)}")


def _fallback_text(admission: Admission) -> str:
    pending = ", ".join(admission.pending)
    admitted = ", ".join(admission.levels) or "none"
    return f"until {pending} measured, the maxQualityLoss category decides; admitted: {admitted}"


def _condition(ok: bool, reason: str, message: str) -> api.Condition:
    return api.Condition(
        type=QUALITY_MEASURED, status="True" if ok else "False", reason=reason, message=message
    )


def needs_retry(verdict: Assessment) -> bool:
    """An unreadable eval set is read again later (with back-off); nothing else here needs it."""
    return verdict.condition is not None and verdict.condition.reason == "DatasetUnreadable"
