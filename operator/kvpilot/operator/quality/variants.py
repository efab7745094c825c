"""The quality gate over spec.model.variants[]: each variant (an AWQ, GPTQ, FP8 or
compressed-tensors checkpoint of the same model) is measured by its own eval Job
(`kvpilot-runtime eval --checkpoint NAME=PATH`, against the same reference, eval set and metric as
kvpilot's levels, quality/job.py), so its row in status.quality compares with theirs.

Pure. While an eval set is given, a variant is planned only once measured within
`maxQualityLoss`: a calibrated checkpoint has no category to stand in for it (its loss is the
publisher's, not a level's), so one that is not measured yet, or whose eval failed, is not served,
and QualityMeasured says why. Records live in the model's cache ConfigMap beside the levels',
keyed by the variant's name and a hash of its URI (a new URI is measured again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.operator import api
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning.planner import NodePlan, rank_level
from kvpilot.operator.quality import admission
from kvpilot.operator.quality import job as quality_job
from kvpilot.operator.reconcile import manifests

Obj = admission.Obj


@dataclass(frozen=True)
class Keys:
    """What names a variant's measurement: its Job, record and failure count."""

    uri: str  # spec.model's
    metric: str
    digest: str  # dataset_key
    reference: str = "bf16"

    def job(self, variant: api.ModelVariant) -> str:
        return quality_job.variant_job_name(
            self.uri, variant, self.metric, self.digest, self.reference
        )

    def record(self, variant: api.ModelVariant) -> str:
        return admission.record_key(_subject(variant), self.metric, self.digest, self.reference)

    def failures(self, variant: api.ModelVariant) -> str:
        return admission.failure_key(_subject(variant), self.metric, self.digest, self.reference)


def _subject(variant: api.ModelVariant) -> str:
    """A ConfigMap-key-safe stand-in for the level in a record key."""
    return f"variant-{variant.name}-{manifests.spec_hash(variant.uri)}"


@dataclass(frozen=True)
class Verdict:
    """The variants' side of a pass: measured rows, who may be served, who waits and why."""

    measured: dict[str, api.QualityMeasurement]  # by variant name
    admitted: tuple[tuple[str, str], ...]  # (name, level it ranks as)
    excluded: tuple[str, ...]  # "variant awq: +3.10% > 2%"
    waiting: tuple[str, ...]  # "variant awq: measuring ..." (not served until measured)
    failed: tuple[str, ...]  # "variant awq: <log tail> [attempt 1, next in 10 min]"
    jobs_to_create: tuple[manifests.Manifest, ...] = ()
    jobs_to_delete: tuple[Obj, ...] = ()
    new_records: Mapping[str, str] = dataclasses.field(default_factory=dict)


def judge(
    variant: api.ModelVariant, measured: api.QualityMeasurement | None, budget: float
) -> tuple[str, str] | str:
    """(name, level) when it may be served; else why not (for the condition)."""
    if measured is None:
        return f"variant {variant.name}: not measured yet, not served until it is"
    if measured.relative_loss > budget:
        return f"variant {variant.name}: {measured.relative_loss:+.2f}% > {budget:g}%"
    return variant.name, rank_level(measured.level)


def verdict(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    observed: admission.Observed,
    reference: NodePlan | None,
    config: OperatorConfig,
    now: str,
) -> Verdict:
    """Every variant's measurement (cached, or read from its finished Job), and the Jobs to make
    for the ones still missing (none without a reference node)."""
    evaluation = spec.quantization.evaluation
    if evaluation is None:
        raise ValueError("spec.quantization.evaluation is not set")
    if observed.dataset_error:  # nothing can be measured: none is served (the condition says why)
        unmeasured = tuple(f"variant {v.name}: not measured" for v in spec.model.variants)
        return Verdict({}, (), (), unmeasured, ())
    ref_level = admission.reference_level(reference)
    keys = Keys(spec.model.uri, evaluation.metric, observed.dataset_key, ref_level)
    reads = [_read(variant, keys, observed, now) for variant in spec.model.variants]
    judged = [
        (r, judge(r.variant, r.measured, evaluation.max_quality_loss))
        for r in reads
        if not r.failure
    ]
    missing = [r for r in reads if r.measured is None and r.run is None]
    return Verdict(
        measured={r.variant.name: r.measured for r in reads if r.measured is not None},
        admitted=tuple(j for _, j in judged if isinstance(j, tuple)),
        excluded=tuple(j for r, j in judged if isinstance(j, str) and r.measured is not None),
        waiting=tuple(j for r, j in judged if isinstance(j, str) and r.measured is None),
        failed=tuple(_failure_text(r) for r in reads if r.failure),
        jobs_to_create=()
        if reference is None
        else tuple(
            _eval_job(md, spec, r.variant, reference, keys, observed, config) for r in missing
        ),
        jobs_to_delete=tuple(r.run.job for r in reads if r.measured and r.run is not None),
        new_records=_new_records(reads, keys),
    )


@dataclass(frozen=True)
class _Read:
    """What this pass found for one variant: its measurement, the Job it read (None: none, or
    the measurement was cached), and why that Job failed for good."""

    variant: api.ModelVariant
    measured: api.QualityMeasurement | None = None
    run: admission.EvalRun | None = None
    failure: str = ""


def _read(variant: api.ModelVariant, keys: Keys, observed: admission.Observed, now: str) -> _Read:
    cached = admission.parse_record(observed.records.get(keys.record(variant), ""))
    if cached is not None:
        return _Read(variant, cached)
    run = observed.runs.get(keys.job(variant))
    if run is None:
        return _Read(variant)
    outcome = admission.job_outcome(run, "", keys.uri, now, variant=variant.name)
    if isinstance(outcome, api.QualityMeasurement):
        return _Read(variant, outcome, run)
    return _Read(variant, None, run, outcome or "")


def _failure_text(read: _Read) -> str:
    tried = admission.attempt(read.run) if read.run is not None else 1
    minutes = quality_job.retry_delay_seconds(tried) // 60
    return f"variant {read.variant.name}: {read.failure} [attempt {tried}, next in {minutes} min]"


def _new_records(reads: list[_Read], keys: Keys) -> dict[str, str]:
    """The measurements read from Jobs, and the attempt each failed Job was."""
    records = {
        keys.record(r.variant): r.measured.model_dump_json(by_alias=True)
        for r in reads
        if r.measured is not None and r.run is not None
    }
    failed = {
        keys.failures(r.variant): str(admission.attempt(r.run))
        for r in reads
        if r.failure and r.run is not None
    }
    return {**records, **failed}


def _eval_job(
    md: Obj,
    spec: api.ModelDeploymentSpec,
    variant: api.ModelVariant,
    reference: NodePlan,
    keys: Keys,
    observed: admission.Observed,
    config: OperatorConfig,
) -> manifests.Manifest:
    """The next attempt at measuring `variant`: one more than the failed Jobs recorded."""
    attempt = 1 + admission.failed_attempts(observed.records, keys.failures(variant))
    return quality_job.build_eval_job(
        md, spec, "", reference, keys.digest, config, attempt, variant
    )


def fold(base: admission.Assessment, variants: Verdict) -> admission.Assessment:
    """The levels' assessment with the variants' rows, Jobs, records and gate folded in."""
    condition = base.condition
    if condition is not None:
        condition = _fold_condition(condition, variants)
    return dataclasses.replace(
        base,
        admission=dataclasses.replace(base.admission, variants=variants.admitted),
        measurements=(*base.measurements, *variants.measured.values()),
        condition=condition,
        jobs_to_create=(*base.jobs_to_create, *variants.jobs_to_create),
        jobs_to_delete=(*base.jobs_to_delete, *variants.jobs_to_delete),
        new_records={**base.new_records, **variants.new_records},
    )


def _fold_condition(condition: api.Condition, variants: Verdict) -> api.Condition:
    """A level's condition, the variants' losses and verdicts appended; False while a variant
    is not measured (Measuring) or its eval failed (EvalFailed, which outranks Measuring)."""
    rows = ", ".join(
        f"variant {name} ({m.level}) {m.relative_loss:+.2f}%"
        for name, m in variants.measured.items()
    )
    parts = [condition.message, *([f"variants: {rows}"] if rows else [])]
    parts += [*variants.excluded, *variants.failed, *variants.waiting]
    message = "; ".join(parts)
    if variants.failed and condition.reason != "DatasetUnreadable":
        return condition.model_copy(
            update={"status": "False", "reason": "EvalFailed", "message": message}
        )
    if variants.waiting and condition.status == "True":
        return condition.model_copy(
            update={"status": "False", "reason": "Measuring", "message": message}
        )
    return condition.model_copy(update={"message": message})
