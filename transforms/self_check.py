"""The run's self-check: in every shard, a few samples recomputed one at a time and compared.

The engine computes each batch in compiled, vectorised blocks; the self-check recomputes chosen
samples of each shard with an independent per-sample method (``transforms.engine.reference``: a
``tf.GradientTape`` gradient of the one sample per output row, or, where the engine ran in forward mode,
one forward-mode JVP per input entry or product column in a plain loop), turns that full Jacobian into
what the run stores with the engine's own post-processing (``operands.apply``, ``assemble``: the
selected rows, products, reductions, store dtype), and compares dataset by dataset.

Which samples: ``chosen_ids`` draws them from a generator seeded with the shard's first id, among the
shard's stored (not rejected) ids, so a resumed run checks, and records, exactly what an uninterrupted
one does. Errors are stored rounded to 3 significant digits (and check times only in the manifest), so
that a shard's bytes do not depend on the last bits of a reference.

Errors are relative to the reference's largest entry, per sample and dataset (as
``transforms.engine.relative_error``: finite entries only, and the non-finite entries must be the same),
except where that scale is ill-conditioned: ``logabsdet`` is compared absolutely (the relative error of
``|det|``), ``trace`` relative to the sum of the absolute diagonal entries and ``diagonal`` relative to the
Jacobian's largest entry. The tolerance is that of the compute dtype (``reference.RTOL``), at least twice
the store dtype's epsilon.

Kinks. A ReLU or max-pool model is not differentiable where a unit sits at its kink, and there the
batched and the per-sample computation can round onto different sides (on a trained MobileNetV2, 1 of
130 samples differed from the per-sample tape by 4e-2). A sample beyond the tolerance is therefore
nudged: the reference is recomputed at ``x +- h u`` for a few seeded random sign vectors ``u`` and two
steps ``h`` (``1e-4`` and ``1e-5`` of the sample's largest entry). If the reference jumps by more than the
tolerance between the two sides and the jump does not shrink with the step (it would, about tenfold,
where the model is smooth), the derivative is not unique at the sample; if the stored value lies within
the spread of the references (entrywise, with the tolerance as margin), the check records "kink", a note.
Anything else is a mismatch.

Numpy at import; TensorFlow only once a check runs (in the worker).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jacobeam.transforms.spec import SelfCheck, ShardRange

SEED = 0x5E1FC  # with the shard's first id: which samples a shard checks
OK, KINK, MISMATCH = "ok", "kink", "mismatch"
KINK_STEPS = (1e-4, 1e-5)  # nudges, relative to the sample's largest entry
KINK_DIRECTIONS = 3
KINK_NOTE = "at a kink: derivative not unique"


def chosen_ids(shard: ShardRange, samples: int) -> np.ndarray:
    """The ids a shard checks: ``samples`` of its stored ids (all of them if it has fewer), increasing."""
    if samples <= 0 or shard.rows <= 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng((SEED, shard.start))
    positions = np.sort(rng.choice(shard.rows, size=min(samples, shard.rows), replace=False))
    ids = np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in shard.kept()])
    return ids[positions]


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


def _within(name: str, stored: np.ndarray, references: list[np.ndarray], margin: float, jacobian_scale: float) -> bool:
    """Does ``stored`` lie in the entrywise spread of ``references`` (widened by ``margin`` of their scale)?"""
    stored = np.asarray(stored, np.float64)
    stack = np.stack([np.asarray(r, np.float64) for r in references])
    finite = np.isfinite(stack).all(axis=0)
    if not np.array_equal(finite, np.isfinite(stored)):
        return False
    if not finite.any():
        return True
    values = stack[:, finite]
    if name == "logabsdet":
        scale = 1.0
    else:
        scale = max(float(np.abs(values).max()), jacobian_scale, np.finfo(np.float32).tiny)
    slack = margin * scale
    inside = (stored[finite] >= values.min(axis=0) - slack) & (stored[finite] <= values.max(axis=0) + slack)
    return bool(inside.all())


class SelfChecker:
    """Checks samples of one engine (``transforms.engine.JacobianEngine``); one per worker process.

    The reference function is built and traced at the first check, once (``check`` may be called from
    several threads).
    """

    def __init__(self, engine, options: SelfCheck):
        from jacobeam.transforms.engine import reference

        self.engine, self.options = engine, options
        described = engine.describe()
        self.forward = described["mode"] == "forward"
        compute, store = engine.options.compute_dtype, engine.options.store_dtype
        self.tolerance = reference.tolerance(reference.RTOL[compute], store)
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
            else "tf.GradientTape gradient of one sample, one output row at a time"
        )
        self._function = None
        self._lock = threading.Lock()

    def _reference(self):
        with self._lock:
            if self._function is None:
                from jacobeam.transforms.engine import reference

                engine = self.engine
                self._function = reference.tape_function(
                    engine.model.call, list(engine.input_shapes), forward=self.forward,
                    dtype=engine.options.compute_dtype, wrt=engine.wrt, directions=self._directions,
                    rows=self._rows,
                )
                return self._function, True
            return self._function, False

    def datasets(self, xs: Sequence[np.ndarray], index: np.ndarray | None) -> tuple[dict[str, np.ndarray], float]:
        """The datasets the run would store for one sample (``xs``: ``(1, *shape)`` per model input), from
        the reference, with the stored rows ``index`` ``(1, k)`` (or None); and the Jacobian's scale
        for the ``trace`` and ``diagonal`` comparisons."""
        import tensorflow as tf

        engine = self.engine
        function, _ = self._reference()
        arguments = [tf.constant(x) for x in xs]
        if self._rows:
            arguments.append(tf.constant(np.asarray(index, np.int32).reshape(1, -1)))
        y, jacobians = function(*arguments)
        y = np.asarray(y, engine.options.compute_dtype).reshape(1, -1)
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
        """Recompute one sample and compare it with what the engine computed for it (``stored``: each
        dataset's row ``(1, ...)``). Returns the record of the check (see ``transforms.write``)."""
        began = time.perf_counter()
        _, first = self._reference()  # traced at the first check of the process: timed with it
        dtype = self.engine.options.compute_dtype
        xs = [np.asarray(x, dtype) for x in xs]
        index = None if "output_index" not in stored else np.asarray(stored["output_index"], np.int32).reshape(1, -1)
        reference, scale = self.datasets(xs, index)
        # Every float dataset (output, jacobian, a reduction's); not output_index, which was taken as stored.
        names = [name for name, value in reference.items() if value.dtype.kind == "f" or value.dtype.name == "bfloat16"]
        errors = {name: _error(name, stored[name], reference[name], scale) for name in names}
        worst = max(names, key=lambda name: errors[name])
        verdict = OK if all(error <= self.tolerance for error in errors.values()) else MISMATCH
        record: dict[str, Any] = {
            "id": int(sample_id),
            "verdict": verdict,
            "dataset": worst,
            "max_rel_error": rounded(errors[worst]),
            "errors": {name: rounded(error) for name, error in errors.items()},
            "tolerance": self.tolerance,
            "reference": self.method,
        }
        if verdict == MISMATCH and self._at_kink(xs, index, stored, reference, names, errors, sample_id):
            record["verdict"] = KINK
            record["note"] = (
                f"{KINK_NOTE}: the reference itself jumps between points 1e-4 apart, and the stored value lies between them"
            )
        record["timing"] = {"seconds": round(time.perf_counter() - began, 4), "traced": first}
        return record

    def _at_kink(self, xs, index, stored, reference, names, errors, sample_id) -> bool:
        """Is the sample at a kink of the model, and the stored value one of the derivatives around it?"""
        if any(not np.isfinite(errors[name]) for name in names):
            return False  # NaN/inf in other places: not a matter of sides
        rng = np.random.default_rng((SEED, int(sample_id)))
        dtype = self.engine.options.compute_dtype
        scales = [float(np.abs(x).max()) or 1.0 for x in xs]  # an all-zero sample moves by 1e-4
        around = [reference]
        jumps = {step: 0.0 for step in KINK_STEPS}
        scale = 0.0
        for _ in range(KINK_DIRECTIONS):
            signs = [rng.choice([-1.0, 1.0], size=x.shape) for x in xs]
            for step in KINK_STEPS:
                sides = []
                for sign in (1.0, -1.0):
                    moved = [(x + sign * step * s * u).astype(dtype) for x, s, u in zip(xs, scales, signs)]
                    datasets, scale = self.datasets(moved, index)
                    sides.append(datasets)
                around += sides
                jump = max(_error(name, sides[0][name], sides[1][name], scale) for name in names)
                jumps[step] = max(jumps[step], jump)
        large, small = (jumps[step] for step in KINK_STEPS)
        if not (large > self.tolerance and small > 0.5 * large):
            return False  # the reference is smooth here: the stored value is wrong
        return all(
            _within(name, stored[name], [datasets[name] for datasets in around], self.tolerance, scale) for name in names
        )


def summary(options: SelfCheck, records: Sequence[Any]) -> dict[str, Any]:
    """The manifest's ``self_check``: what was asked, what was checked, the largest error (kinks aside),
    and every kink and mismatch. ``records`` are ``ShardRecord``s."""
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
        # Time spent checking in this run (shards computed now), the first check's tracing included.
        "seconds": round(sum(t.get("seconds", 0.0) for t in timings), 3),
    }
