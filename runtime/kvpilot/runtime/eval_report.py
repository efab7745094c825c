"""What `kvpilot-runtime eval` prints (a table, or --json) and the short summary a Job's
termination message carries back to the operator (quality/admission.py reads it)."""

from __future__ import annotations

from typing import Any

# The right-aligned columns (the metric, rel. loss, weight MiB): one width each for the header
# and every row, so a value ends under its column's title.
COLUMN_WIDTHS = (11, 10, 11)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What a Job's termination message carries back to the operator (well under its 4 KiB)."""
    keep = ("value", "relative_loss", "weight_bytes")
    return {
        "metric": result["metric"],
        "dataset_digest": result["dataset_digest"],
        "num_samples": result["num_samples"],
        "baseline": result["baseline"]["value"],
        "reference": result["baseline"]["quantization"],
        "levels": {k: {f: v[f] for f in keep} for k, v in result["levels"].items()},
        # a candidate checkpoint's row also says the level it runs at (int4 for an AWQ int4)
        "checkpoints": {
            k: {f: v[f] for f in (*keep, "level")} for k, v in result["checkpoints"].items()
        },
    }


def format_table(result: dict[str, Any]) -> str:
    base, kv_name, metric = result["baseline"], result["kv_cache_dtype"], result["metric"]
    suffix = "" if kv_name == "auto" else f"+{kv_name}"  # e.g. none+fp8: that level, fp8 KV
    rows = [(level + suffix, row) for level, row in result["levels"].items()]
    # a checkpoint as NAME (its level); its format is in --json
    rows += [(f"{name} ({row['level']})", row) for name, row in result["checkpoints"].items()]
    width = max([9, *(len(label) for label, _ in rows)])
    value_w, loss_w, mib_w = COLUMN_WIDTHS
    lines = [
        f"model {result['model']}  dataset {result['dataset']}  samples {result['num_samples']}  "
        f"tokens {result['num_tokens']}  KV cache {kv_name} "
        f"(baseline: {base['quantization']}, KV auto)",
        f"{'level':<{width}} {metric:>{value_w}} {'rel. loss':>{loss_w}} {'weight MiB':>{mib_w}}",
        f"{base['quantization']:<{width}} {base['value']:>{value_w}.4g} {'-':>{loss_w}} "
        f"{base['weight_bytes'] / 2**20:>{mib_w}.2f}",
    ]
    for label, row in rows:
        lines.append(
            f"{label:<{width}} {row['value']:>{value_w}.4g} {row['relative_loss']:>+{loss_w}.2%} "
            f"{row['weight_bytes'] / 2**20:>{mib_w}.2f}"
        )
    return "\n".join(lines)
