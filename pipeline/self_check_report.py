"""The self-check's results in words: the lines ``jacobeam run``'s summary and ``jacobeam inspect`` print
from the manifest's ``self_check`` (``transforms.self_check.summary``). The numbers are the self-check's;
the wording is here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jacobeam.transforms.self_check import TRUTH_FLOAT64


def checks_line(summary: Mapping[str, Any]) -> str:
    """What the checks found, in one line: ``12 sample(s) in 3 shard(s) recomputed on their own: 10 passed,
    2 at a kink (...), 0 mismatches; max relative error 3.1e-07 (tolerance 0.0001)``."""
    if not summary["samples_per_shard"]:
        return "off (jacobian.self_check.samples: 0)"
    checked = summary["samples_checked"]
    if not checked:
        return "no sample checked"
    kinks, mismatches = len(summary["kinks"]), len(summary["mismatches"])
    error = summary["max_rel_error"]
    shown = "n/a" if error is None else error if isinstance(error, str) else f"{error:.2g}"
    why = " (within float32's noise of the derivative a few rounding units away, not at the sample)" if kinks else ""
    line = (
        f"{checked:,} sample(s) in {summary['shards_checked']:,} shard(s) recomputed on their own: "
        f"{checked - kinks - mismatches:,} passed, {kinks:,} at a kink{why}, {mismatches:,} mismatch(es); "
        f"max relative error {shown} (tolerance {summary['tolerance']:g})"
    )
    if mismatches:
        first = summary["mismatches"][0]
        line += f"; MISMATCH, e.g. sample {first['id']} {first['dataset']} (recorded under on_mismatch: warn)"
    return line


# The unit roundoff of each dtype (half its machine epsilon).
_ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def precision_line(summary: Mapping[str, Any], compute_dtype: str, store_dtype: str = "float32") -> str | None:
    """The run's precision in one line, for its result datasets (``output`` aside where there are others):
    ``saliency: float32 error against a float64 copy of the model median 2.2e-3, max 1.7e-2 on 28 checked
    samples (TensorFlow's own per-sample gradient: median 3.3e-3, max 1.7e-2); jacobian.compute_dtype:
    float64 for more``, the hint where a value that passed is more than 1e-4 off, and more than storing it in
    ``store_dtype`` puts it off (float16's rounding alone is 4.9e-4: float64 would not help)."""
    found = (summary or {}).get("precision")
    if not found:
        return None
    datasets = found["datasets"]
    names = [name for name in datasets if name != "output"] or list(datasets)
    truth = found["against"]
    reference = f"a {truth}" if truth == TRUTH_FLOAT64 else f"the {compute_dtype} per-sample reference ({truth})"

    def show(value) -> str:
        return value if isinstance(value, str) else f"{value:.2g}"

    coarser = _ROUNDING.get(store_dtype, 0.0) > _ROUNDING.get(compute_dtype, 0.0)
    what = f"{compute_dtype} stored as {store_dtype}" if coarser else compute_dtype  # the error is the stored values'
    parts = []
    for name in names:
        error, noise = datasets[name]["error"], datasets[name]["noise"]
        if error["max"] == 0 and truth == TRUTH_FLOAT64:  # a float64 run: the same numbers once both are stored
            parts.append(f"{name}: {compute_dtype} values identical, as stored, to those of {reference}")
            continue
        part = f"{name}: {what} error against {reference} median {show(error['median'])}, max {show(error['max'])}"
        if truth == TRUTH_FLOAT64 and compute_dtype != "float64":
            part += f" (TensorFlow's own per-sample gradient: median {show(noise['median'])}, max {show(noise['max'])})"
        parts.append(part)
    line = f"{'; '.join(parts)} on {found['samples']:,} checked sample(s)"
    # float64 helps where the values that passed are far off (not where one is wrong: that is a mismatch).
    passed = [datasets[name]["passed_max"] for name in names if datasets[name]["passed_max"] is not None]
    worst = max(passed, key=lambda v: float("inf") if v == "inf" else v, default=None)
    rounding = 4 * _ROUNDING.get(store_dtype, 0.0)  # a few roundings of the stored values
    if truth == TRUTH_FLOAT64 and compute_dtype != "float64" and worst is not None and (
            worst == "inf" or worst > max(1e-4, rounding)):
        line += "; jacobian.compute_dtype: float64 for more"
    return line
