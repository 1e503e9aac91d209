"""The run's self-check: in every shard, a few samples recomputed one at a time and judged against
what the compute dtype can achieve on the model at that sample.

The engine computes each batch in compiled, vectorised blocks; the self-check recomputes chosen
samples of each shard with independent per-sample methods (``transforms.engine.reference``: reverse
mode pulls one-hot cotangents back through copies of the one sample; where the engine ran in forward
mode, one forward-mode JVP per input entry or product column in a plain loop), turns each full Jacobian
into what the run stores with the engine's own post-processing (``operands.apply``, ``assemble``: the
selected rows, products, reductions, store dtype), and compares dataset by dataset.

Why not a fixed tolerance against a float32 tape. On a deep ReLU conv net every float32 computation
of a gradient is about 1e-3 off the float64 truth, in every framework (ResNet50: median 2.5e-3, max
2.6e-2; measurements in docs/verifying.md), because float32 rounding flips units that sit near their
kink, and where they flip depends on the batch shape's kernels. A stored value that is as good as
float32 gets is not a failure; one clearly worse than an independent float32 computation is.

The rule, per checked sample and dataset (errors relative to the reference's largest entry, as
``transforms.engine.relative_error``):

- the truth is the reference computed by a float64 copy of the model (``LoadedModel.with_dtype``,
  verified to compute in float64: ``reference.foreign_float_op``); where none can be built, the
  per-sample reference in the compute dtype (then the error is measured against it);
- ``noise`` is how far independent computations in the compute dtype are from the truth: the
  per-sample reference itself (TensorFlow's own per-sample gradient) with batch shapes 1 and, where
  the stored value is beyond the tolerance, 2 (in reverse mode: oneDNN rounds them differently, and
  one of them is often 100x luckier than any batched computation), and, only where the bound is
  still exceeded, the truth itself at the sample's entries moved by one unit of rounding of the
  compute dtype (a sample at a kink, or so ill-conditioned that rounding the input already changes its
  derivative); without a float64 copy, the spread of the two per-sample computations;
- the stored value fails when its error exceeds ``max(tolerance, NOISE_FACTOR * noise)``: the
  tolerance of the compute dtype (``reference.RTOL``, at least twice the store dtype's epsilon) where
  the model is well-conditioned, and clearly worse than float32 itself where it is not.

The later terms are computed only where they can change the verdict (the bound only grows with them,
so the verdict is the same); a check that needed the moved inputs is recorded as ``kink``: passed, with
a note. Every check records the stored value's error against the truth and the noise before the moved
inputs, so the manifest reports the run's precision (``summary``).

Which samples: ``chosen_ids`` draws them from a generator seeded with the shard's first id, among the
shard's stored (not rejected) ids, so a resumed run checks, and records, exactly what an uninterrupted
one does. Errors are stored rounded to 3 significant digits (and check times only in the manifest), so
that a shard's bytes do not depend on the last bits of a reference. ``logabsdet`` is compared absolutely
(the relative error of ``|det|``), ``trace`` relative to the sum of the absolute diagonal entries and
``diagonal`` relative to the Jacobian's largest entry.

Numpy at import; TensorFlow only once a check runs (in the worker).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jacobeam.transforms.spec import SelfCheck, ShardRange

SEED = 0x5E1FC  # with the shard's first id: which samples a shard checks
OK, KINK, MISMATCH = "ok", "kink", "mismatch"
NOISE_FACTOR = 4  # "clearly worse": a value 10x the noise fails; batched and per-sample float32 measured within 1x
KINK_DIRECTIONS = 3  # seeded moves of the sample by up to one unit of rounding, each both ways
KINK_NOTE = "at a kink or ill-conditioned: rounding the input by one unit moves the derivative as much"
TRUTH_FLOAT64 = "float64 copy of the model"
# Reverse-mode references pull rows back through this many bytes of copies at most per call.
REFERENCE_BUDGET = 2**30


def chosen_ids(shard: ShardRange, samples: int) -> np.ndarray:
    """The ids a shard checks: ``samples`` of its range's ids (all of them if it has fewer), increasing;
    one whose sample the reading rejects is not checked (which ids are bad is known only once read)."""
    if samples <= 0 or shard.rows <= 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng((SEED, shard.start))
    return shard.start + np.sort(rng.choice(shard.rows, size=min(samples, shard.rows), replace=False)).astype(np.int64)


def rounded(value: float) -> float | str:
    """A relative error as recorded: 3 significant digits; ``"inf"`` (non-finite entries differ) as a string,
    which JSON can hold."""
    return float(f"{value:.3g}") if np.isfinite(value) else "inf"


def _error(name: str, stored: np.ndarray, reference: np.ndarray, jacobian_scale: float = 0.0) -> float:
    """How far ``stored`` is from ``reference`` (one sample's dataset ``name``; see the module docstring)."""
    from jacobeam.transforms.engine import relative_error

    if name == "logabsdet":
        return relative_error(stored, reference, scale=1.0)
    if name in ("trace", "diagonal"):
        return relative_error(stored, reference, floor=jacobian_scale)
    return relative_error(stored, reference)


class SelfChecker:
    """Checks samples of one engine (``transforms.engine.JacobianEngine``); one per worker process.

    The reference functions (in the compute dtype and, for float32, in a float64 copy of the model) are
    built and traced at the first check, once (``check`` may be called from several threads).
    """

    def __init__(self, engine, options: SelfCheck):
        from jacobeam.transforms.engine import reference

        self.engine, self.options = engine, options
        self.forward = engine.describe()["mode"] == "forward"
        self.compute = engine.options.compute_dtype
        self.tolerance = reference.tolerance(reference.RTOL[self.compute], engine.options.store_dtype)
        operands = engine.operands
        # Forward mode with fixed input-side vectors (jvp, project, an input basis): the JVPs run along
        # them, as the engine's do, rather than along every input entry.
        self._directions = operands.right if self.forward else None
        # Selected rows (outputs other than all) are all the reverse-mode reference differentiates.
        self._rows = not self.forward and operands.kind("reverse") == "index"
        self.method = (
            ("forward-mode JVPs along the product's vectors" if self._directions is not None
             else "forward-mode JVPs per input entry") + ", one sample, in a plain loop"
            if self.forward
            else "tf.GradientTape gradient of one sample, one output row per copy"
        )
        self.truth = None  # what the errors are measured against: TRUTH_FLOAT64, or why there is none
        self._functions: tuple | None = None
        self._lock = threading.Lock()

    def _function(self, model, dtype: str):
        from jacobeam.transforms.engine import reference

        engine = self.engine
        # Copies of one sample per reverse-mode call: as many as the budget holds of the forward pass.
        bytes_per_copy = 3 * max(engine.activations, 1) * np.dtype(dtype).itemsize
        return reference.tape_function(
            model.call, list(engine.input_shapes), forward=self.forward, dtype=dtype, wrt=engine.wrt,
            directions=self._directions, rows=self._rows, chunk=int(max(1, min(64, REFERENCE_BUDGET // bytes_per_copy))),
        )

    def _references(self) -> tuple[tuple, bool]:
        """``(own, truth)``: the per-sample reference in the compute dtype and the float64 one (the same
        function where the run computes in float64; None where no float64 copy can be built); and whether
        this call built them."""
        with self._lock:
            if self._functions is not None:
                return self._functions, False
            from jacobeam.transforms.engine import reference
            from jacobeam.transforms.errors import ModelError

            own = self._function(self.engine.model, self.compute)
            truth, self.truth = (own, TRUTH_FLOAT64) if self.compute == "float64" else (None, None)
            if truth is None:
                try:
                    truth = self._function(self.engine.model.with_dtype("float64"), "float64")
                    foreign = reference.foreign_float_op(truth.graph, "float64")
                    if foreign is not None:
                        truth, self.truth = None, f"no float64 copy: the rebuilt model still computes {foreign}"
                    else:
                        self.truth = TRUTH_FLOAT64
                except (ModelError, ValueError, TypeError) as err:  # not Keras, layers without a config
                    truth, self.truth = None, f"no float64 copy: {str(err).splitlines()[0][:200]}"
            self._functions = (own, truth)
            return self._functions, True

    def datasets(
        self, function, xs: Sequence[np.ndarray], index: np.ndarray | None, pad: bool = False
    ) -> tuple[dict[str, np.ndarray], float]:
        """The datasets the run would store for one sample (``xs``: ``(1, *shape)`` per model input), from
        the reference ``function`` (``pad``: with another batch shape), with the stored rows ``index``
        ``(1, k)`` (or None); and the Jacobian's scale for the ``trace`` and ``diagonal`` comparisons."""
        import tensorflow as tf

        engine = self.engine
        arguments = [tf.constant(x) for x in xs]
        if self._rows:
            arguments.append(tf.constant(np.asarray(index, np.int32).reshape(1, -1)))
        y, jacobians = function(*arguments, pad=True) if pad else function(*arguments)
        y = np.asarray(y).reshape(1, -1)
        m = y.shape[1]
        products, scale = {}, 0.0
        for k, jacobian in zip(engine.wrt, jacobians):
            jacobian = np.asarray(jacobian).reshape(1, index.shape[1] if self._rows else m, -1)
            if self._rows:  # already the selected rows: only a projection's columns are left to apply
                products[k] = engine.operands.apply(jacobian, None)
            elif self._directions is not None:  # already J R: only the rows are left to choose
                products[k] = jacobian if index is None else np.take_along_axis(jacobian, index[:, :, None], axis=1)
            else:
                products[k] = engine.operands.apply(jacobian, index)
            if engine.options.reduce.kind == "trace":
                scale = float(np.abs(np.diagonal(jacobian[0].astype(np.float64))).sum())
            elif engine.options.reduce.kind == "diagonal":
                finite = jacobian[np.isfinite(jacobian)]
                scale = float(np.abs(finite).max()) if finite.size else 0.0
        datasets, _ = engine.assemble(y, products, index)
        return datasets, scale

    def check(self, xs: Sequence[np.ndarray], stored: Mapping[str, np.ndarray], sample_id: int) -> dict[str, Any]:
        """Recompute one sample and judge what the engine computed for it (``stored``: each dataset's row
        ``(1, ...)``) by the rule of the module docstring. Returns the record of the check (see
        ``transforms.write``)."""
        return self.judge(xs, stored, sample_id)[0]

    def judge(
        self, xs: Sequence[np.ndarray], stored: Mapping[str, np.ndarray], sample_id: int
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """``check``'s record and each dataset's bound (``jacobeam verify`` reports them all; a shard
        records only the worst's)."""
        began = time.perf_counter()
        (own, truth), first = self._references()  # traced at the first check of the process: timed with it
        index = None if "output_index" not in stored else np.asarray(stored["output_index"], np.int32).reshape(1, -1)
        mine = [np.asarray(x, self.compute) for x in xs]
        computed, scale = self.datasets(own, mine, index)
        # Every float dataset (output, jacobian, a reduction's); not output_index, which was taken as stored.
        names = [name for name, value in computed.items() if value.dtype.kind == "f" or value.dtype.name == "bfloat16"]

        def errors(values: Mapping[str, np.ndarray], against: Mapping[str, np.ndarray], at: float) -> dict[str, float]:
            return {name: _error(name, values[name], against[name], at) for name in names}

        second = not self.forward  # the reverse reference runs with two batch shapes
        if truth is None:  # the compute dtype's reference is the truth; the noise is its spread
            reference, second = computed, False
            spread = None if self.forward else self.datasets(own, mine, index, pad=True)[0]
            noise = dict.fromkeys(names, 0.0) if spread is None else errors(spread, computed, scale)
        elif truth is own:  # a float64 run: nothing is more accurate than its own reference
            reference, noise = computed, dict.fromkeys(names, 0.0)
        else:
            reference, scale = self.datasets(truth, [np.asarray(x, np.float64) for x in xs], index)
            noise = errors(computed, reference, scale)
        error = errors(stored, reference, scale)
        if second and any(error[name] > self.tolerance for name in names):
            # Batch shapes 1 and 2 round differently (oneDNN's kernels): both are float32's own. Measured
            # only where the tolerance alone does not pass the value (a smooth model's check stays cheap).
            again = errors(self.datasets(own, mine, index, pad=True)[0], reference, scale)
            noise = {name: max(noise[name], again[name]) for name in names}
        measured = dict(noise)  # as the precision report shows it

        def failing() -> list[str]:
            return [name for name in names if not error[name] <= max(self.tolerance, NOISE_FACTOR * noise[name])]

        verdict = OK
        if failing():
            # The truth's own dtype: float64, or the compute dtype where the compute dtype's reference is it.
            dtype = np.dtype(np.float64 if truth is not None else self.compute)
            moved = self._moved(truth or own, dtype, xs, index, reference, scale, names, sample_id)
            noise = {name: max(noise[name], moved[name]) for name in names}
            verdict = MISMATCH if failing() else KINK

        def ratio(name: str) -> float:
            return error[name] / max(self.tolerance, NOISE_FACTOR * noise[name])

        worst = max(names, key=ratio)
        record: dict[str, Any] = {
            "id": int(sample_id),
            "verdict": verdict,
            "dataset": worst,
            "max_rel_error": rounded(error[worst]),
            "errors": {name: rounded(value) for name, value in error.items()},
            "noise": {name: rounded(value) for name, value in measured.items()},
            "bound": rounded(max(self.tolerance, NOISE_FACTOR * noise[worst])),
            "tolerance": self.tolerance,
            "reference": self.method,
            "truth": self.truth,
        }
        if verdict == KINK:
            record["note"] = KINK_NOTE
        record["timing"] = {"seconds": round(time.perf_counter() - began, 4), "traced": first}
        return record, {name: max(self.tolerance, NOISE_FACTOR * noise[name]) for name in names}

    def _moved(self, function, dtype, xs, index, reference, scale, names, sample_id) -> dict[str, float]:
        """How far the truth (``function``, computing in ``dtype``) moves when each entry of the sample
        moves by up to one unit of rounding of the compute dtype (seeded uniform fractions of its spacing,
        both ways): the largest error per dataset against ``reference``."""
        rng = np.random.default_rng((SEED, int(sample_id)))
        moved = dict.fromkeys(names, 0.0)
        for _ in range(KINK_DIRECTIONS):
            steps = [rng.uniform(-1.0, 1.0, np.shape(x)) * np.spacing(np.abs(np.asarray(x, self.compute))) for x in xs]
            for way in (1.0, -1.0):
                points = [(np.asarray(x, np.float64) + way * step).astype(dtype) for x, step in zip(xs, steps)]
                datasets, _ = self.datasets(function, points, index)
                for name in names:
                    moved[name] = max(moved[name], _error(name, datasets[name], reference[name], scale))
        return moved


def summary(options: SelfCheck, records: Sequence[Any]) -> dict[str, Any]:
    """The manifest's ``self_check``: what was asked, what was checked, the largest error (kinks aside),
    every kink and mismatch, and the run's precision. ``records`` are ``ShardRecord``s."""
    checked = [(record, check) for record in records for check in (record.self_check or {}).get("checked", [])]
    judged = [check["max_rel_error"] for _, check in checked if check["verdict"] != KINK]
    numbers = [float("inf") if error == "inf" else error for error in judged]
    timings = [check.get("timing", {}) for _, check in checked]

    def listed(verdict: str) -> list[dict[str, Any]]:
        return [
            {"file": record.file, "id": check["id"], "dataset": check["dataset"], "max_rel_error": check["max_rel_error"]}
            for record, check in checked
            if check["verdict"] == verdict
        ]

    return {
        "samples_per_shard": options.samples,
        "on_mismatch": options.on_mismatch,
        "shards_checked": sum(1 for record in records if (record.self_check or {}).get("checked")),
        "samples_checked": len(checked),
        "reference": next((check["reference"] for _, check in checked), None),
        "tolerance": max((check["tolerance"] for _, check in checked), default=None),
        "max_rel_error": (rounded(max(numbers)) if numbers else None),
        "kinks": listed(KINK),
        "mismatches": listed(MISMATCH),
        "precision": precision([check for _, check in checked]),
        # Time spent checking in this run (shards computed now), the first check's tracing included.
        "seconds": round(sum(t.get("seconds", 0.0) for t in timings), 3),
    }


def precision(checks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How accurate the stored values are: per dataset, the checked samples' error against the truth
    (median and max, and the max of those that passed) and the same of the per-sample reference in the
    compute dtype (``noise``: what TensorFlow's own gradient of one sample achieves); None without checks."""
    checks = [check for check in checks if "noise" in check]  # shards of runs before the precision report
    if not checks:
        return None
    truth = checks[0].get("truth")

    def spread(values: list) -> dict[str, float | str]:
        numbers = [float("inf") if value == "inf" else float(value) for value in values]
        return {"median": rounded(statistics.median(numbers)), "max": rounded(max(numbers))}

    passed = [c for c in checks if c["verdict"] != MISMATCH] or checks
    datasets = {
        name: {
            "error": spread([c["errors"][name] for c in checks]),
            "noise": spread([c["noise"][name] for c in checks]),
            "passed_max": spread([c["errors"][name] for c in passed])["max"],  # mismatches aside
        }
        for name in checks[0]["errors"]
    }
    return {"against": truth, "samples": len(checks), "datasets": datasets}


def precision_line(summary: Mapping[str, Any], compute_dtype: str) -> str | None:
    """The run's precision in one line, for its result datasets (``output`` aside where there are others):
    ``saliency: float32 error against a float64 copy of the model median 2.2e-3, max 1.7e-2 on 28 checked
    samples (TensorFlow's own per-sample gradient: median 3.3e-3, max 1.7e-2); jacobian.compute_dtype:
    float64 for more``, the hint where a value that passed is more than 1e-4 off."""
    found = (summary or {}).get("precision")
    if not found:
        return None
    datasets = found["datasets"]
    names = [name for name in datasets if name != "output"] or list(datasets)
    truth = found["against"]
    against = f"against a {truth}" if truth == TRUTH_FLOAT64 else f"against the {compute_dtype} per-sample reference ({truth})"

    def show(value) -> str:
        return value if isinstance(value, str) else f"{value:.2g}"

    parts = []
    for name in names:
        error, noise = datasets[name]["error"], datasets[name]["noise"]
        part = f"{name}: {compute_dtype} error {against} median {show(error['median'])}, max {show(error['max'])}"
        if truth == TRUTH_FLOAT64 and compute_dtype != "float64":
            part += f" (TensorFlow's own per-sample gradient: median {show(noise['median'])}, max {show(noise['max'])})"
        parts.append(part)
    line = f"{'; '.join(parts)} on {found['samples']:,} checked sample(s)"
    # float64 helps where the values that passed are far off (not where one is wrong: that is a mismatch).
    worst = max((datasets[name]["passed_max"] for name in names), key=lambda v: float("inf") if v == "inf" else v)
    if truth == TRUTH_FLOAT64 and compute_dtype != "float64" and (worst == "inf" or worst > 1e-4):
        line += "; jacobian.compute_dtype: float64 for more"
    return line
