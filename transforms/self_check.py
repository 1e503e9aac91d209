"""The run's self-check: in every shard, a few samples recomputed each on its own and judged against
what the compute dtype can achieve on the model at that sample.

The engine computes each batch in compiled, vectorised blocks; the self-check recomputes chosen
samples of each shard with independent per-sample methods (``transforms.engine.reference``: reverse
mode pulls one-hot cotangents back through copies of each sample; where the engine ran in forward
mode, one forward-mode JVP per input entry or product vector, each pushed through a copy of the
sample of its own), a shard's samples in
one call of each reference (``judge_all``: its fixed cost shared, each derivative still its own sample's;
a run's worker checks a shard's samples together after its last batch), chooses the rows again
itself (``indices`` from the configuration, ``label`` from the label read from the input, ``argmax``
and ``top_k`` from the truth's own outputs), rebuilds every stored dataset from its definition
(``transforms.reference_datasets``: float64 numpy, no code shared with the engine's assembly) and
compares dataset by dataset, row by row. ``jacobeam verify`` judges by the same ``judge``.

Why not a fixed tolerance against a float32 tape. On a deep ReLU conv net every float32 computation
of a gradient is about 1e-3 off the float64 truth, in every framework (ResNet50: median 2.5e-3, max
2.6e-2; measurements in docs/verifying.md), because float32 rounding flips units that sit near their
kink, and where they flip depends on the batch shape's kernels. A stored value that is as good as
float32 gets is not a failure; one clearly worse than an independent float32 computation is.

The rule, per checked sample (``_Judgement``):

- the truth is the reference computed by a float64 copy of the model (``LoadedModel.with_dtype``,
  verified to compute in float64: ``reference.foreign_float_op``); where none can be built, the
  per-sample reference in the compute dtype;
- each dataset is split into rows (``ReferenceDatasets.split_rows``: one per output row, selected row
  or product vector), each judged at its own scale: its largest true entry, at least its float32 noise;
- a row's ``noise`` is how far independent computations in the compute dtype are from the truth: the
  per-sample reference itself in one pass over the samples checked together and, where the stored value
  is beyond the bound the first gives, again with one more copy per batch (in reverse mode: oneDNN rounds
  other batch shapes differently); without a float64 copy, the spread of the two;
- a row fails when its error exceeds ``min(max(tolerance, NOISE_FACTOR * noise), MAX_BOUND)``: the tolerance of the
  compute dtype (``reference.RTOL``, at least twice the store dtype's epsilon) where the model is
  well-conditioned, and clearly worse than float32 itself where it is not; a noise that is not finite
  counts as none (it would bound nothing), and a row whose stored value and truth disagree on which
  entries are finite always fails;
- at a kink the derivative is a set (ReLU at 0, max-pooling ties): where some row fails against the
  truth, the truth is computed again at the sample moved by up to one unit of rounding of the compute
  dtype and by up to 16 (``KINK_UNITS``; ``KINK_DIRECTIONS`` seeded directions each, both ways), and the
  value passes as ``kink`` if every row of every dataset is within the *same* bounds of the derivatives
  at one of those points. The moved points offer other derivatives the value may be close to; they
  never widen a bound, so a value that no derivative near the sample has (scaled, negated, another
  row's) fails however different those derivatives are from each other (the README's flat images:
  about 5x the Jacobian's largest entry);
- stored rows (``output_index``) other than the check's choice fail, unless the outputs chosen are,
  rank by rank, within float32's noise of the largest ones (a tie: then either choice is right), compared
  as their logs where they are probabilities (``tied``).

Every check records the stored value's error against the truth and the noise, per dataset its worst
row's, so the manifest reports the run's precision (``summary``).

Which samples: ``samples`` per 4,096 ids of a shard (``PER_IDS``, the default shard's size), rounded up,
so at least one in every shard: the checked share of a run, and so the check's cost, does not grow as
shards get smaller (``checked_count``). ``chosen_ids`` draws them from a generator seeded with the
shard's first id, among the shard's stored (not rejected) ids, so a resumed run checks, and records,
exactly what an uninterrupted one does. Errors are stored rounded to 3 significant digits (and check
times only in the manifest), so that a shard's bytes do not depend on the last bits of a reference.

Numpy at import; TensorFlow only once a check runs (in the worker).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jacobeam.transforms.spec import SelfCheck, ShardRange

SEED = 0x5E1FC  # with the shard's first id: which samples a shard checks
PER_IDS = 4096  # jacobian.self_check.samples are per this many ids of a shard (the default shard's size)
OK, KINK, MISMATCH = "ok", "kink", "mismatch"
NOISE_FACTOR = 4  # "clearly worse": a value 10x the noise fails; batched and per-sample float32 measured within 1x
# However noisy the compute dtype is on a row, no error beyond this share of the row's scale passes: a row
# float32 cannot compute (a saturated softmax's, where 1 - p rounds away: its own gradient 75% off the
# truth) would otherwise pass any value within 3x its scale, zeros and the negated row included. Float32's
# largest noise measured on a real net, ResNet50's, is 2.6e-2 (bound 0.1).
MAX_BOUND = 0.25
KINK_DIRECTIONS = 3  # seeded moves of the sample at each of KINK_UNITS, each both ways
# Units of rounding the sample is moved by: one, and 16, since float32 round-off accumulates through a deep
# net: a ReLU of ResNet-20 at 1.6e-7 (5e-7 in float64) went the other way in the engine's batched float32,
# 1e-3 of the gradient, and only moves of 16 units reached that side (about 1.5% of random normal inputs).
KINK_UNITS = (1, 16)
KINK_NOTE = "at a kink: within float32's noise of the derivative at a point a few rounding units away, not at the sample"
TRUTH_FLOAT64 = "float64 copy of the model"
# Last activations whose outputs are probabilities, each computed to its own relative precision: judged as
# their logs too (``ReferenceDatasets.log_floor``), and rows chosen by them compared so (``tied``).
PROBABILITIES = ("softmax", "sigmoid")
# Reverse-mode references pull rows back through this many bytes of copies at most per call.
REFERENCE_BUDGET = 2**30


def checked_count(rows: int, samples: int) -> int:
    """How many of a shard's ``rows`` ids it checks: ``samples`` per ``PER_IDS`` ids, rounded up, at least
    one and at most all of them. The share of a run that is checked does not depend on the shard size, so
    small shards (incremental runs) do not multiply the self-check's cost; every shard is still checked."""
    if samples <= 0 or rows <= 0:
        return 0
    return min(rows, -(-samples * rows // PER_IDS))


def chosen_ids(shard: ShardRange, samples: int) -> np.ndarray:
    """The ids a shard checks: ``checked_count`` of its range's ids, increasing; one whose sample the reading
    rejects is not checked (which ids are bad is known only once read)."""
    return drawn(shard, checked_count(shard.rows, samples))


def drawn(shard: ShardRange, count: int) -> np.ndarray:
    """``count`` of the shard's ids (all of them if it has fewer), increasing, drawn by a generator seeded
    with its first id: the same for a shard however often it is computed."""
    if count <= 0 or shard.rows <= 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng((SEED, shard.start))
    return shard.start + np.sort(rng.choice(shard.rows, size=min(count, shard.rows), replace=False)).astype(np.int64)


def checker_for(engine, options: SelfCheck):
    """The self-check of ``engine``: ``SelfChecker``, or on the parameter side (an engine with a weight
    ``layout``) ``transforms.parameter_check.ParameterSelfChecker``."""
    if getattr(engine, "layout", None) is not None:
        from jacobeam.transforms.parameter_check import ParameterSelfChecker

        return ParameterSelfChecker(engine, options)
    return SelfChecker(engine, options)


def rounded(value: float) -> float | str:
    """A relative error as recorded: 3 significant digits; ``"inf"`` (non-finite entries differ) as a string,
    which JSON can hold."""
    return float(f"{value:.3g}") if np.isfinite(value) else "inf"


class SelfChecker:
    """Checks samples of one engine (``transforms.engine.JacobianEngine``); one per worker process.

    What it reads of the engine: its model, options, shapes and mode (to compute the reference the same
    way round), never its post-processing. The reference functions (in the compute dtype and, for float32,
    in a float64 copy of the model) are built and traced once, by ``prepare`` (a run's worker calls it at
    set-up) or else at the first check (``check`` may be called from several threads).
    """

    def __init__(self, engine, options: SelfCheck):
        from jacobeam.transforms.engine import reference
        from jacobeam.transforms.engine.models import last_activation
        from jacobeam.transforms.reference_datasets import ReferenceDatasets
        from jacobeam.transforms.spec import store_dtype

        self.engine, self.options = engine, options
        self.forward = engine.describe()["mode"] == "forward"
        self.compute = engine.options.compute_dtype
        self.selection = engine.options.outputs
        self.tolerance = reference.tolerance(reference.RTOL[self.compute], engine.options.store_dtype)
        # Below the store dtype's smallest normal number its relative precision is gone: no row is judged
        # against a smaller scale.
        self._floor = float(_finfo(store_dtype(engine.options.store_dtype)).tiny)
        probabilities = last_activation(getattr(engine.model, "keras_model", None)) in PROBABILITIES
        self.plain = ReferenceDatasets(engine.options, engine.output_shape, engine.input_shapes, engine.input_names,
                                       engine.wrt, log_floor=self._floor if probabilities else None)
        # Forward mode with input-side vectors (jvp, project, an input basis): the JVPs run along them, as
        # the engine's do, rather than along every input entry; the vectors are the reference's own.
        self._directions = self.plain.directions if self.forward else None
        # Selected rows (by index, not a matrix) are all the reverse-mode reference differentiates.
        self._rows = not self.forward and self.selection.rule != "all" and self.plain.left is None
        self.method = (
            ("forward-mode JVPs along the product's vectors" if self._directions is not None
             else "forward-mode JVPs per input entry") + ", one copy of the sample each"
            if self.forward
            else "tf.GradientTape gradient of one sample, one output row per copy"
        )
        self.truth = None  # what the errors are measured against: TRUTH_FLOAT64, or why there is none
        self._functions: tuple | None = None
        self._twin = None  # the float64 copy of the model, once built
        self._outputs: dict[str, Any] = {}  # forward passes by dtype, for rows chosen by the outputs
        self._lock = threading.Lock()
        self._preparing: threading.Thread | None = None
        # A run's worker holds a shard's checks back to its end, to recompute them together (``judge_all``).
        self.checks_together = True

    def prepare(self) -> None:
        """Build the references on a thread of their own, each called once, while the first batches compute
        (once; a check called before they are built waits for them, so a run's worker holds its checks back
        until ``ready``: ``ComputeJacobiansFn``). The first check of a worker process otherwise pays their
        building, tracing and graph optimisation in line: 0.2 s on W1, about 5 s on ResNet50. A failure is
        left to the first check, which builds them again and reports it."""
        with self._lock:
            if self._preparing is not None or self._functions is not None:
                return
            self._preparing = threading.Thread(target=self._prepare, name="jacobeam-self-check", daemon=True)
        self._preparing.start()

    def ready(self) -> bool:
        """Whether the references are built and ``prepare``'s thread, if any, is done: a check now waits for
        nothing and competes with nothing."""
        thread = self._preparing
        return self._functions is not None and (thread is None or not thread.is_alive())

    def wait_prepared(self) -> None:
        """Wait for ``prepare``'s thread, if any, to be done."""
        if self._preparing is not None:
            self._preparing.join()

    def _prepare(self) -> None:
        try:
            own, truth = self._references()[0]
            for function in {id(f): f for f in (own, truth) if f is not None}.values():
                if getattr(function, "warm", None) is not None:
                    function.warm()
        except Exception:  # noqa: BLE001 - reported by the first check, which builds them again
            pass

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
                    self._twin = self.engine.model.with_dtype("float64")
                    truth = self._function(self._twin, "float64")
                    foreign = reference.foreign_float_op(truth.graph, "float64")
                    if foreign is not None:
                        truth, self.truth = None, f"no float64 copy: the rebuilt model still computes {foreign}"
                    else:
                        self.truth = TRUTH_FLOAT64
                except (ModelError, ValueError, TypeError) as err:  # not Keras, layers without a config
                    truth, self.truth = None, f"no float64 copy: {self._no_copy(err)}"
            self._functions = (own, truth)
            return self._functions, True

    def _no_copy(self, err: BaseException) -> str:
        """Why no float64 copy of the model could be built, in words for a user who never asked for one."""
        model = self.engine.model
        if getattr(model, "keras_model", None) is None:
            return (f"{model.source} is not a Keras model (a SavedModel or a plain tf.Module) and cannot be rebuilt in "
                    "float64; judged against its own float32 per-sample gradient, in two batch shapes")
        return str(err).splitlines()[0][:200] if str(err) else type(err).__name__

    def _outputs_of(self, dtype: str, xs: Sequence[np.ndarray]) -> np.ndarray:
        """The model's outputs at ``n`` samples (``xs``: ``(n, *shape)`` per model input), ``(n, m)``, computed
        in ``dtype`` (the float64 copy for float64)."""
        import tensorflow as tf

        with self._lock:
            if dtype not in self._outputs:
                from jacobeam.transforms.engine import reference

                model = self.engine.model if dtype == self.compute else self._twin
                self._outputs[dtype] = reference.forward_function(model.call, list(self.engine.input_shapes), dtype)
            forward = self._outputs[dtype]
        values = forward(*[tf.constant(np.asarray(x, dtype)) for x in xs])
        return np.asarray(values, np.float64).reshape(len(xs[0]), -1)

    def computed(self, function, xs: Sequence[np.ndarray], indices: Sequence[np.ndarray] | None, pad: bool = False):
        """Per sample of ``xs`` (``(n, *shape)`` per model input), ``(datasets, jacobians)``: the datasets the
        run would store for it, computed by the reference ``function`` in one call for all of them (``pad``:
        with another batch shape) for its rows ``indices[i]`` ``(1, k)`` (or None for all rows), each rebuilt
        from its definition (``ReferenceDatasets``); and its Jacobians as the reference computed them,
        ``(rows, columns)`` per differentiated input."""
        n = len(xs[0])
        arguments = list(xs)
        if self._rows:
            arguments.append(np.concatenate([np.asarray(index, np.int32).reshape(1, -1) for index in indices]))
        y, found = function(*arguments, pad=pad)
        y = np.asarray(y, np.float64).reshape(n, -1)
        rows = indices[0].shape[1] if self._rows else y.shape[1]
        found = [np.asarray(j, np.float64).reshape(n, rows, -1) for j in found]
        along = self._directions is not None
        results = []
        for i in range(n):
            index = None if indices is None else indices[i]
            jacobians = {k: j[i] for k, j in zip(self.engine.wrt, found)}
            results.append((self.plain.datasets(y[i], jacobians, index, selected=self._rows, along=along), jacobians))
        return results

    def datasets(self, function, xs: Sequence[np.ndarray], index: np.ndarray | None, pad: bool = False):
        """``computed`` of one sample (``xs``: ``(1, *shape)`` per model input; ``index``: its rows ``(1, k)``
        or None)."""
        return self.computed(function, xs, None if index is None else [index], pad)[0]

    def check(
        self, xs: Sequence[np.ndarray], stored: Mapping[str, np.ndarray], sample_id: int, label: int | None = None
    ) -> dict[str, Any]:
        """Recompute one sample and judge what the engine computed for it (``stored``: each dataset's row
        ``(1, ...)``; ``label``: the sample's label as read from its input, for ``outputs: label``) by the
        rule of the module docstring. Returns the record of the check (see ``transforms.write``)."""
        return self.judge(xs, stored, sample_id, label)[0]

    def check_all(self, samples: Sequence[tuple]) -> list[dict[str, Any]]:
        """``check`` of each of ``samples`` (its arguments), recomputed together (``judge_all``)."""
        return [record for record, _ in self.judge_all(samples)]

    def judge(
        self, xs: Sequence[np.ndarray], stored: Mapping[str, np.ndarray], sample_id: int, label: int | None = None
    ) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
        """``check``'s record and, per dataset, ``(error, bound)`` of its row nearest its bound (``jacobeam
        verify`` reports them all; a shard records only the worst dataset's)."""
        return self.judge_all([(xs, stored, sample_id, label)])[0]

    def judge_all(self, samples: Sequence[tuple]) -> list[tuple[dict[str, Any], dict[str, tuple[float, float]]]]:
        """``judge`` of each of ``samples`` (``check``'s arguments), each reference pass one call for all of
        them: a pass's fixed cost (a call of a traced function, most of a check on a small model) is shared,
        while every sample's derivatives are still its own (``reference.tape_function``). Each record's time
        is its own judging and its share of the passes."""
        began = time.perf_counter()
        (own, truth), first = self._references()  # traced at the first check of the process: timed with it
        exact = truth or own  # the truth: the float64 copy, or the compute dtype's reference without one
        exact_dtype = np.dtype(np.float64 if truth is not None else self.compute)

        def stacked(dtype, chosen) -> list[np.ndarray]:
            """The ``chosen`` samples' inputs in ``dtype``, ``(n, *shape)`` per model input."""
            return [np.concatenate([np.asarray(samples[i][0][j], dtype) for i in chosen]) for j in range(len(samples[0][0]))]

        everyone = range(len(samples))
        at, mine = stacked(exact_dtype, everyone), stacked(self.compute, everyone)
        chosen = self._rows_all(at, mine, samples)
        indices = None if chosen[0][0] is None else [index for index, _ in chosen]
        truths = self.computed(exact, at, indices)
        if truth is None:  # the compute dtype's reference is the truth; the noise is its spread over batch shapes
            owns = [] if self.forward else [self.computed(own, mine, indices, pad=True)]
        elif truth is own:  # a float64 run: nothing is more accurate than its own reference
            owns = []
        else:
            owns = [self.computed(own, mine, indices)]
        judged = [self._judgement(samples[i][1], truths[i], [each[i][0] for each in owns], indices, i) for i in everyone]
        wide = [i for i in everyone if judged[i].worst_ratio() > 1]
        if truth is not None and truth is not own and not self.forward and wide:
            # Batch shapes n and n + 1 round differently (oneDNN's kernels): both are float32's own. Measured
            # only where the bound of the first does not pass the value: a second noise can only widen a
            # row's bound (and its scale with it), so a value that passes without it passes with it, and the
            # verdict is the one measuring both would give (on ResNet50 this saves a third of a check).
            again = self.computed(own, stacked(self.compute, wide), None if indices is None else [indices[i] for i in wide],
                                  pad=True)
            for i, (second, _) in zip(wide, again):
                judged[i] = self._judgement(samples[i][1], truths[i], [each[i][0] for each in owns] + [second], indices, i)
        shared = (time.perf_counter() - began) / len(samples)
        found = []
        for i, (xs, _, sample_id, _) in enumerate(samples):
            start = time.perf_counter()
            index = None if indices is None else indices[i]
            moved = functools.partial(self._moved, exact, exact_dtype, xs, index, sample_id)  # called only at a failure
            found.append(verdict(self, judged[i], chosen[i][1], moved, sample_id, start - shared, first and i == 0))
        return found

    def _judgement(self, stored, truth: tuple, owns: list, indices, i: int) -> _Judgement:
        """Sample ``i``'s ``_Judgement`` (``truth``: its ``(datasets, jacobians)``; ``owns``: its datasets by
        the compute dtype's own passes)."""
        reference, jacobians = truth
        names = [name for name, value in reference.items() if value.dtype.kind == "f"]
        rows = indices[i].shape[1] if indices is not None else self.plain.m
        scales = {name: self.plain.scale(name, jacobians) for name in names}
        return _Judgement(self, names, reference, stored, owns, scales, rows)

    def _rows_all(self, at, mine, samples) -> list[tuple[np.ndarray | None, str | None]]:
        """``_rows_of`` of each of ``samples`` (``at``, ``mine``: their inputs stacked in the truth's and the
        compute dtype), the truth's outputs computed for all of them in one pass where the rows are chosen
        by them."""
        if self.selection.rule == "all":
            return [(None, None)] * len(samples)
        outputs = None
        if self.selection.rule in ("argmax", "top_k"):
            outputs = self._outputs_of("float64" if self.truth == TRUTH_FLOAT64 else self.compute, at)
        return [
            self._rows_of(None if outputs is None else outputs[i], [x[i : i + 1] for x in mine], stored, label)
            for i, (_, stored, _, label) in enumerate(samples)
        ]

    def _rows_of(self, truth, mine, stored, label) -> tuple[np.ndarray | None, str | None]:
        """The rows ``(1, k)`` the sample's reference differentiates (None for all), chosen again without the
        run's choice: ``indices`` from the configuration, ``label`` from the sample's label as read from its
        input, ``argmax`` and ``top_k`` from the truth's own outputs ``truth`` (ties broken towards the
        smaller index; where the stored rows differ only by outputs within float32's noise of each other,
        the stored ones are as right, and judged). Also what is wrong with the stored rows, or None."""
        selection = self.selection
        if selection.rule == "indices":
            want, why = np.asarray(selection.indices, np.int64), "the configured indices"
        elif selection.rule == "label":
            if label is None:
                raise ValueError("jacobian.outputs label: the self-check needs the sample's label")
            want, why = np.asarray([int(label)], np.int64), "the sample's label"
        else:
            want, why = np.argsort(-truth, kind="stable")[: selection.count].astype(np.int64), "the model's largest outputs"
        got = np.asarray(stored.get("output_index", np.zeros((1, 0))), np.int64).reshape(-1)
        if np.array_equal(got, want):
            return want[None], None
        if selection.rule in ("argmax", "top_k"):
            own = self._outputs_of(self.compute, mine)[0] if self.compute != "float64" else truth
            if tied(self.tolerance, truth, own, got, want, self.plain.log_floor):
                return got[None], None
        return want[None], f"output_index: stored rows {got.tolist()}, the reference chooses {want.tolist()} ({why})"

    def _moved(self, function, dtype, xs, index, sample_id) -> Iterator[dict[str, np.ndarray]]:
        """The truth (``function``, computing in ``dtype``) at the sample's entries each moved by up to
        ``KINK_UNITS`` units of rounding of the compute dtype (seeded uniform fractions of its spacing, both ways): the
        derivatives near the sample, one datasets dict per moved point."""
        for points in moved_points(xs, self.compute, sample_id):
            yield self.datasets(function, [point.astype(dtype) for point in points], index)[0]


def verdict(checker, judged: _Judgement, rows_differ: str | None, moved, sample_id: int, began: float,
            first: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """A checked sample's record and each dataset's bound, from its judgement (``rows_differ``: what is
    wrong with the stored rows, or None; ``moved``: a callable giving the datasets at the moved points,
    called only where a value fails, to tell a kink from a mismatch)."""
    outcome, nearest = OK, None
    if rows_differ:
        outcome = MISMATCH
    elif judged.worst_ratio() > 1:
        nearest = min(judged.ratio_against(point) for point in moved())
        outcome = KINK if nearest <= 1 else MISMATCH
    worst, nearest_bound = judged.worst(), judged.nearest_bound()
    record: dict[str, Any] = {
        "id": int(sample_id),
        "verdict": outcome,
        "dataset": "output_index" if rows_differ else worst,
        "max_rel_error": "inf" if rows_differ else rounded(judged.errors[worst]),
        "errors": {name: rounded(value) for name, value in judged.errors.items()},
        "noise": {name: rounded(value) for name, value in judged.noise.items()},
        "bound": rounded(nearest_bound[worst][1]),
        "tolerance": checker.tolerance,
        "reference": checker.method,
        "truth": checker.truth,
    }
    if rows_differ:
        record["detail"] = rows_differ
    elif outcome == MISMATCH:
        record["failing"] = judged.failing()
    if nearest is not None:  # how far from the nearest derivative the moved points found, in bounds
        record["nearest"] = rounded(nearest)
    if outcome == KINK:
        record["note"] = KINK_NOTE
    record["timing"] = {"seconds": round(time.perf_counter() - began, 4), "traced": first}
    return record, nearest_bound


def tied(tolerance: float, truth: np.ndarray, own: np.ndarray, got: np.ndarray, want: np.ndarray,
         log_floor: float | None = None) -> bool:
    """Whether the stored rows ``got`` are as good a choice as ``want``: distinct outputs whose true values
    are, rank by rank, within float32's noise of the largest ones (measured: the compute dtype's own
    outputs ``own`` against the truth's) or within ``tolerance`` of the largest output. Probabilities
    (``log_floor``: ``ReferenceDatasets.log_floor``) are compared as their logs, absolutely: their order is
    the same, and a class at 1e-25 is not within float32's noise of one at 1e-7."""
    if len(got) != len(want) or len(set(got.tolist())) != len(got) or not all(0 <= i < len(truth) for i in got):
        return False
    scale = float(np.abs(truth).max())
    if log_floor is not None:
        from jacobeam.transforms.reference_datasets import clipped_log

        truth, own, scale = clipped_log(truth, log_floor), clipped_log(own, log_floor), 1.0
    band = max(tolerance * scale, NOISE_FACTOR * float(np.abs(own - truth).max()))
    return bool(np.all(np.abs(truth[got] - truth[want]) <= band))


def moved_points(xs: Sequence[np.ndarray], compute: str, sample_id: int) -> Iterator[list[np.ndarray]]:
    """The sample's entries each moved by up to ``KINK_UNITS`` units of rounding of the compute dtype (seeded
    uniform fractions of its spacing, both ways), in float64: where the derivatives near a sample at a kink
    are."""
    rng = np.random.default_rng((SEED, int(sample_id)))
    for units in KINK_UNITS:
        for _ in range(KINK_DIRECTIONS):
            steps = [units * rng.uniform(-1.0, 1.0, np.shape(x)) * np.spacing(np.abs(np.asarray(x, compute))) for x in xs]
            for way in (1.0, -1.0):
                yield [np.asarray(x, np.float64) + way * step for x, step in zip(xs, steps)]


class _Judgement:
    """One sample's datasets judged row by row against the truth (the rule of the module docstring).

    Per dataset and row ``r``: ``deviation_r`` is the largest difference over the row's entries (inf where
    the two disagree on which entries are finite); the row's scale is its own largest true entry, at least
    the largest deviation of the compute dtype's own per-sample computations (``owns``: the row's float32
    noise; a row float32 cannot resolve is judged against that noise), the compute dtype's epsilon of the
    dataset's largest entry, the store dtype's smallest normal number, and the dataset's least scale for
    the row (``least_scales``: 1 for the logs of probabilities); ``error_r`` and ``noise_r`` are the
    deviations of the stored value and of the own computations over that scale, and the row fails when
    ``error_r > min(max(tolerance, NOISE_FACTOR * noise_r), MAX_BOUND)``. ``trace``, ``diagonal`` and ``logabsdet`` have one
    row and a scale of their own (``ReferenceDatasets.scale``).
    """

    def __init__(self, checker: SelfChecker, names, truth, stored, owns, scales, rows):
        self.tolerance, self.names, self.stored = checker.tolerance, names, stored
        self._split = lambda name, values: checker.plain.split_rows(name, values, rows)
        eps = float(_finfo(checker.compute).eps)
        self._scale, self._bound, self._rows = {}, {}, {}
        self.errors, self.noise = {}, {}  # per dataset, its worst row's
        for name in names:
            t = self._split(name, truth[name])
            finite = np.where(np.isfinite(t), np.abs(t), 0.0)
            noise = np.zeros(len(t))
            for own in owns:
                noise = np.maximum(noise, _deviation(self._split(name, own[name]), t))
            scale = finite.max(axis=1, initial=0.0) if scales[name] is None else np.full(len(t), scales[name])
            if name != "logabsdet":  # compared absolutely
                scale = np.maximum(scale, eps * float(finite.max(initial=0.0)))
            scale = np.maximum(scale, checker.plain.least_scales(name, len(t)))
            # A row the own computations cannot even make finite (float32 overflowing where the truth does
            # not) has no noise to widen its bound by: an infinite bound would pass any value, inf included.
            noise = np.where(np.isfinite(noise), noise, 0.0)
            self._scale[name] = np.maximum(np.maximum(scale, noise), checker._floor)
            relative_noise = noise / self._scale[name]
            self._bound[name] = np.minimum(np.maximum(checker.tolerance, NOISE_FACTOR * relative_noise), MAX_BOUND)
            self._rows[name] = self._error(name, truth[name])
            self.errors[name] = float(self._rows[name].max(initial=0.0))
            self.noise[name] = float(relative_noise.max(initial=0.0))

    def _error(self, name: str, against: np.ndarray) -> np.ndarray:
        """Each row's error of the stored value against ``against`` (the truth's dataset, or a moved point's)."""
        stored = np.asarray(self.stored[name])
        if stored.shape != np.shape(against):
            return np.full(len(self._scale[name]), np.inf)
        return _deviation(self._split(name, stored), self._split(name, against)) / self._scale[name]

    def _ratio(self, name: str) -> float:
        return float(np.max(_over(self._rows[name], self._bound[name]), initial=0.0))

    def worst_ratio(self) -> float:
        """The worst row's error over its bound: beyond 1, the value fails against the truth."""
        return max((self._ratio(name) for name in self.names), default=0.0)

    def ratio_against(self, moved: Mapping[str, np.ndarray]) -> float:
        """The worst row's error over its bound, judged against a moved point's derivatives instead."""
        return max((float(np.max(_over(self._error(name, moved[name]), self._bound[name]), initial=0.0)) for name in self.names),
                   default=0.0)

    def failing(self) -> list[str]:
        """The datasets with a row beyond its bound, worst first."""
        return sorted((name for name in self.names if self._ratio(name) > 1), key=self._ratio, reverse=True)

    def worst(self) -> str:
        return max(self.names, key=self._ratio)

    def nearest_bound(self) -> dict[str, tuple[float, float]]:
        """Per dataset, ``(error, bound)`` of its row nearest its bound (the worst): the largest error may be
        another row's, with a wider bound."""
        nearest = {}
        for name in self.names:
            if not len(self._bound[name]):
                nearest[name] = (0.0, self.tolerance)
                continue
            row = int(np.argmax(_over(self._rows[name], self._bound[name])))
            nearest[name] = (float(self._rows[name][row]), float(self._bound[name][row]))
        return nearest


def mismatch_text(check: Mapping[str, Any]) -> str:
    """What a mismatch's record says is wrong, in words: the rows the check chose otherwise, or the dataset,
    its error and its bound."""
    if "detail" in check:
        return check["detail"]
    noise = (check.get("noise") or {}).get(check["dataset"], 0.0)
    beyond = noise == "inf" or NOISE_FACTOR * float(noise) > MAX_BOUND
    return (f"{check['dataset']} differs from the reference ({check['reference']}, {check['truth']}) by max relative "
            f"error {check['max_rel_error']}, bound {check['bound']} (tolerance {check['tolerance']:g}, or "
            f"{NOISE_FACTOR}x the error of an independent per-sample computation, at most {MAX_BOUND:g})"
            + "".join(f"; {name} too" for name in check.get("failing", []) if name != check["dataset"])
            + (f"; that independent computation is {noise} off the truth too: the compute dtype cannot compute this "
               "value (compute_dtype: float64, or model.logits: true for a softmax's probabilities)" if beyond else ""))


def _over(errors: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each row's error over its bound; inf where that is undefined (NaN, inf over inf), so that it fails."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.asarray(errors) / np.asarray(bounds)
    return np.where(np.isnan(ratio), np.inf, ratio)


def _deviation(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per row of ``(rows, entries)`` arrays, the largest difference over the entries finite in ``expected``;
    inf for a row where the two disagree on which entries are finite (a NaN would otherwise pass)."""
    finite = np.isfinite(expected)
    differ = np.any(finite != np.isfinite(actual), axis=1)
    gap = np.where(finite, np.abs(np.where(finite, actual, 0.0) - np.where(finite, expected, 0.0)), 0.0)
    return np.where(differ, np.inf, gap.max(axis=1, initial=0.0))


def _finfo(name: str):
    if str(name) == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(ml_dtypes.bfloat16)
    return np.finfo(np.dtype(name))




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
        "samples_per_shard": options.samples,  # per PER_IDS ids of a shard, at least one (checked_count)
        "per_ids": PER_IDS,
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
    (median and max, and the max of those that passed, None if none did) and the same of the per-sample reference in the
    compute dtype (``noise``: what TensorFlow's own gradient of one sample achieves); None without checks."""
    checks = [check for check in checks if "noise" in check]  # shards of runs before the precision report
    if not checks:
        return None
    truth = checks[0].get("truth")

    def spread(values: list) -> dict[str, float | str]:
        numbers = [float("inf") if value == "inf" else float(value) for value in values]
        return {"median": rounded(statistics.median(numbers)), "max": rounded(max(numbers))}

    passed = [c for c in checks if c["verdict"] != MISMATCH]
    datasets = {
        name: {
            "error": spread([c["errors"][name] for c in checks]),
            "noise": spread([c["noise"][name] for c in checks]),
            # Mismatches aside; None where every check was one.
            "passed_max": spread([c["errors"][name] for c in passed])["max"] if passed else None,
        }
        for name in checks[0]["errors"]
    }
    return {"against": truth, "samples": len(checks), "datasets": datasets}
