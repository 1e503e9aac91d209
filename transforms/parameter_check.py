"""The self-check of the parameter side (``jacobian.wrt: parameters``): a checked sample's per-sample
gradients recomputed by a plain ``tf.GradientTape`` of that one sample, one row at a time, in a float64
copy of the model (the truth) and in the compute dtype (its noise), with no vectorisation shared with the
engine; the rows chosen again (``indices`` from the configuration, ``label`` from the label read,
``argmax``/``top_k`` from the truth's outputs); every stored dataset rebuilt from its definition in
float64 numpy (the projection from ``parameter_space.projection_rows``, weight by weight); and each judged
row by row by the input side's rule (``self_check._Judgement``: the larger of the tolerance and 4 times
float32's own error, with moved points for kinks). ``frobenius_by_layer`` is judged layer by layer, each
against its own norm, so a layer's norm that is wrong cannot hide behind a larger layer's.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jacobeam.transforms.engine.models import last_activation
from jacobeam.transforms.reference_datasets import least_scales, probability_rows
from jacobeam.transforms.self_check import (
    PROBABILITIES,
    TRUTH_FLOAT64,
    _finfo,
    _Judgement,
    moved_points,
    tied,
    verdict,
)
from jacobeam.transforms.spec import SelfCheck, store_dtype

_ONE_ROW = ("output", "objective", "frobenius")


class _Rows:
    """How the parameter side's datasets split into judged rows (``_Judgement``'s ``plain``); the outputs
    of a model ending in a softmax or a sigmoid as themselves and their logs, as on the input side
    (``transforms.reference_datasets``)."""

    def __init__(self, log_floor: float | None = None):
        self.log_floor = log_floor

    def least_scales(self, name: str, rows: int) -> np.ndarray:
        return least_scales(name, rows, self.log_floor)

    def split_rows(self, name: str, values: np.ndarray, rows: int) -> np.ndarray:
        values = np.asarray(values, np.float64)
        if name == "output" and self.log_floor is not None:
            return probability_rows(values, self.log_floor)
        if name in _ONE_ROW:
            return values.reshape(1, -1)
        if name == "frobenius_by_layer":
            return values.reshape(-1, 1)
        return values.reshape(rows, -1)


class ParameterSelfChecker:
    """Checks samples of one ``ParameterEngine``; the interface of ``self_check.SelfChecker``."""

    def __init__(self, engine, options: SelfCheck):
        from jacobeam.transforms.engine import reference

        self.engine, self.options = engine, options
        self.compute = engine.options.compute_dtype
        self.selection = engine.options.outputs
        self.side = engine.side
        self.tolerance = reference.tolerance(reference.RTOL[self.compute], engine.options.store_dtype)
        self._floor = float(_finfo(store_dtype(engine.options.store_dtype)).tiny)
        probabilities = last_activation(getattr(engine.model, "keras_model", None)) in PROBABILITIES
        self.plain = _Rows(self._floor if probabilities else None)
        self.method = "tf.GradientTape gradient of the weights for one sample, one row at a time"
        self.truth = TRUTH_FLOAT64
        self._functions: dict[str, Any] | None = None
        self._block_product = None  # the compiled product with one block of P (``_projected``)
        self._lock = threading.Lock()
        self._preparing: threading.Thread | None = None
        # A run's worker holds a shard's checks back to its end, to project them together (``judge_all``).
        self.checks_together = engine.options.reduce.kind == "project"

    # -- references, built once -----------------------------------------------------------------------

    def prepare(self) -> None:
        """Build the references on a thread of their own (as ``SelfChecker.prepare``)."""
        with self._lock:
            if self._preparing is not None or self._functions is not None:
                return
            self._preparing = threading.Thread(target=self._prepare, name="jacobeam-self-check", daemon=True)
        self._preparing.start()

    def _prepare(self) -> None:
        try:
            self._references()
        except Exception:  # noqa: BLE001 - reported by the first check, which builds them again
            pass

    def ready(self) -> bool:
        thread = self._preparing
        return self._functions is not None and (thread is None or not thread.is_alive())

    def wait_prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()

    def _references(self) -> tuple[dict[str, Any], bool]:
        with self._lock:
            if self._functions is not None:
                return self._functions, False
            engine = self.engine
            models = {self.compute: engine.model}
            if self.compute != "float64":
                models["float64"] = engine.model.with_dtype("float64")
            self._functions = {dtype: self._function(model, dtype) for dtype, model in models.items()}
            return self._functions, True

    def _function(self, model, dtype: str):
        """``(xs (1, ...) per input, label, row) -> (y (m,), value, [gradient per weight])``: one sample's
        objective (or output row) and its gradient by a plain tape, in ``dtype``."""
        import tensorflow as tf

        from jacobeam.transforms.engine.parameter_space import layout, objective_value

        engine, side = self.engine, self.side
        _, variables = layout(model.keras_model, side.layers, model.source)
        tf_dtype = tf.as_dtype(dtype)
        specs = [tf.TensorSpec((1, *shape), tf_dtype) for shape in engine.input_shapes]

        @tf.function(input_signature=[specs, tf.TensorSpec((), tf.int32), tf.TensorSpec((), tf.int32)], autograph=False)
        def gradient(xs, label, row):
            with tf.GradientTape() as tape:
                y = tf.reshape(model.call(list(xs)), (-1,))
                value = objective_value(side.objective, side.loss, y, label, row)
            grads = tape.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            # the logits of a model ending in a softmax (``objective_model``): its outputs are their softmax
            shown = tf.nn.softmax(y) if engine.softmax else y
            return shown, value, [tf.convert_to_tensor(g) for g in grads]  # an embedding's: IndexedSlices

        return gradient

    # -- one check ------------------------------------------------------------------------------------

    def check(self, xs: Sequence[np.ndarray], stored: Mapping[str, np.ndarray], sample_id: int,
              label: int | None = None) -> dict[str, Any]:
        return self.judge(xs, stored, sample_id, label)[0]

    def _per_row(self, dtype: str, xs: Sequence[np.ndarray], label: int | None, rows: np.ndarray):
        """``(y, value, gradient (rows, p))`` float64 of one sample computed in ``dtype``."""
        import tensorflow as tf

        function = self._functions[dtype]
        args = [tf.constant(np.asarray(x, dtype)) for x in xs]
        found, y, value = [], None, None
        for row in rows:
            y, value, grads = function(args, tf.constant(int(label or 0), tf.int32), tf.constant(int(row), tf.int32))
            found.append(np.concatenate([np.asarray(g, np.float64).reshape(-1) for g in grads]))
        return np.asarray(y, np.float64), float(value), np.stack(found)

    def _projected(self, gradients: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Each gradient ``(rows, p)`` times ``P``, in float64, block by block as ``parameter_space`` defines
        it (``P`` whole would be gigabytes): each block generated and multiplied in one compiled call."""
        import tensorflow as tf

        from jacobeam.transforms.engine.parameter_space import BLOCK_ROWS, factored, projection_factors

        reduction = self.engine.options.reduce
        if self._block_product is None:
            from jacobeam.transforms.engine.parameter_space import projection_block

            @tf.function(input_signature=[tf.TensorSpec((None, None), tf.float64), tf.TensorSpec((), tf.int64),
                                          tf.TensorSpec((), tf.int64)], autograph=False)
            def block_product(g, weight, block):
                rows = tf.cast(projection_block(reduction.project_seed, reduction.project_kind, weight, block,
                                                reduction.project_dim, tf.float32, tf.shape(g)[1]), tf.float64)
                return tf.matmul(g, rows)

            self._block_product = block_product
        stacked = np.concatenate(gradients)
        product = np.zeros((len(stacked), reduction.project_dim))
        for weight in self.engine.layout.weights:
            matrix = factored(weight) if reduction.project_structure == "kronecker" else None
            if matrix is not None:  # kron(A, B): A^T G B, in float64
                a, b = (np.asarray(f, np.float64) for f in projection_factors(
                    reduction.project_seed, reduction.project_kind, weight.index, matrix, reduction.project_dim,
                    tf.float32))
                g = stacked[:, weight.offset: weight.offset + weight.size].reshape(-1, *matrix)
                product += np.einsum("nil,ik->nkl", g @ b, a).reshape(len(stacked), -1)
                continue
            for j, start in enumerate(range(0, weight.size, BLOCK_ROWS)):
                part = stacked[:, weight.offset + start: weight.offset + min(start + BLOCK_ROWS, weight.size)]
                product += self._block_product(tf.constant(part), tf.constant(weight.index, tf.int64),
                                               tf.constant(j, tf.int64)).numpy()
        return np.split(product, np.cumsum([len(g) for g in gradients])[:-1])

    def _datasets(self, y: np.ndarray, value: float, gradient: np.ndarray, index: np.ndarray | None,
                  product: np.ndarray | None = None) -> dict:
        """The datasets the run stores for one sample, rebuilt from their definitions in float64 (``product``:
        the gradient times ``P``, for ``reduce: project``)."""
        engine, kind = self.engine, self.engine.options.reduce.kind
        rows_shape = engine.rows_shape
        out: dict[str, np.ndarray] = {"output": y.reshape(1, *engine.output_shape)}
        if index is not None:
            out["output_index"] = index.reshape(1, -1)
        if self.side.objective != "outputs":
            out["objective"] = np.array([value])
        if kind == "none":
            out["gradient"] = gradient.reshape(1, *rows_shape, -1)
        elif kind == "project":
            out["projection"] = product.reshape(1, *rows_shape, -1)
        else:
            layers = engine.layout.layers
            squares = np.zeros(len(layers))
            for w in engine.layout.weights:
                squares[layers.index(w.layer)] += float(np.sum(gradient[:, w.offset: w.offset + w.size] ** 2))
            out["frobenius"] = np.array([np.sqrt(squares.sum())])
            out["frobenius_by_layer"] = np.sqrt(squares).reshape(1, -1)
        return out

    def _rows_of(self, y_truth: np.ndarray, y_own: np.ndarray, stored, label) -> tuple[np.ndarray | None, str | None]:
        """The rows ``(1, k)`` the check differentiates (None: all rows, or the objective), chosen again,
        and what is wrong with the stored rows, or None (as ``SelfChecker._rows_of``)."""
        selection = self.selection
        if self.side.objective != "outputs" or selection.rule == "all":
            return None, None
        if selection.rule == "indices":
            want, why = np.asarray(selection.indices, np.int64), "the configured indices"
        elif selection.rule == "label":
            want, why = np.asarray([int(label)], np.int64), "the sample's label"
        else:
            want = np.argsort(-y_truth, kind="stable")[: selection.count].astype(np.int64)
            why = "the model's largest outputs"
        got = np.asarray(stored.get("output_index", np.zeros((1, 0))), np.int64).reshape(-1)
        if np.array_equal(got, want):
            return want[None], None
        if selection.rule in ("argmax", "top_k") and tied(self.tolerance, y_truth, y_own, got, want, self.plain.log_floor):
            return got[None], None
        return want[None], f"output_index: stored rows {got.tolist()}, the reference chooses {want.tolist()} ({why})"

    def _rows(self, index: np.ndarray | None) -> np.ndarray:
        if index is not None:
            return index.reshape(-1)
        if self.side.objective != "outputs":
            return np.zeros(1, np.int64)
        return np.arange(self.engine.outputs)

    def judge(self, xs: Sequence[np.ndarray], stored: Mapping[str, np.ndarray], sample_id: int,
              label: int | None = None) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
        """``check``'s record and, per dataset, ``(error, bound)`` of its row nearest its bound (``jacobeam
        verify`` reports them)."""
        return self.judge_all([(xs, stored, sample_id, label)])[0]

    def check_all(self, samples: Sequence[tuple]) -> list[dict[str, Any]]:
        """``check`` of each of ``samples`` (its arguments), their gradients projected together
        (``judge_all``)."""
        return [record for record, _ in self.judge_all(samples)]

    def judge_all(self, samples: Sequence[tuple]) -> list[tuple[dict[str, Any], dict[str, tuple[float, float]]]]:
        """``judge`` of each of ``samples`` (its arguments): each sample's gradients recomputed on its own,
        then all of them projected in one pass over ``P``, since drawing ``P``'s blocks, not their products
        with a few rows, is most of a dense check's cost. Each record's time is its own recomputing and
        judging and its share of the projection."""
        began = time.perf_counter()
        _, first = self._references()
        shared = time.perf_counter() - began  # building the references, where this call did
        staged = []
        for xs, stored, _, label in samples:
            start = time.perf_counter()
            staged.append((*self._recomputed(xs, stored, label), time.perf_counter() - start))
        start = time.perf_counter()
        projecting = self.engine.options.reduce.kind == "project"
        products = iter(self._projected([g for _, _, computed, _ in staged for _, _, g in computed])) if projecting \
            else None
        shared = (shared + time.perf_counter() - start) / max(1, len(samples))
        found = []
        for (xs, stored, sample_id, label), (index, rows_differ, computed, own) in zip(samples, staged):
            start = time.perf_counter()
            product = [next(products) if projecting else None for _ in computed]
            truth, *owns = [self._datasets(*each, index, p) for each, p in zip(computed, product)]
            names = [name for name, value in truth.items() if value.dtype.kind == "f"]
            rows = self._rows(index)
            judged = _Judgement(self, names, truth, stored, owns, {name: None for name in names}, len(rows))
            moved = functools.partial(self._moved, xs, label, rows, index, sample_id)  # called only at a failure
            found.append(verdict(self, judged, rows_differ, moved, sample_id, start - own - shared, first and not found))
        return found

    def _recomputed(self, xs: Sequence[np.ndarray], stored: Mapping[str, np.ndarray], label: int | None):
        """``(index, rows_differ, computed)``: the rows chosen again and what is wrong with the stored ones
        (``_rows_of``), and the sample's ``(y, value, gradient)`` by the float64 tape (the truth) and, in a
        float32 run, by the compute dtype's (its noise)."""
        exact = "float64"
        y_truth = y_own = None
        if self.side.objective == "outputs" and self.selection.rule in ("argmax", "top_k"):  # rows chosen by outputs
            y_truth = self._per_row(exact, xs, label, np.zeros(1, np.int64))[0]
            y_own = self._per_row(self.compute, xs, label, np.zeros(1, np.int64))[0] if self.compute != exact else y_truth
        index, rows_differ = self._rows_of(y_truth, y_own, stored, label)
        rows = self._rows(index)
        computed = [self._per_row(exact, xs, label, rows)]
        if self.compute != exact:
            computed.append(self._per_row(self.compute, xs, label, rows))
        return index, rows_differ, computed

    def _moved(self, xs, label, rows, index, sample_id):
        """The truth at the sample's entries each moved by up to ``KINK_UNITS`` units of rounding of the
        compute dtype (``moved_points``, as ``SelfChecker._moved``): the derivatives near a sample at a kink,
        all projected in one pass over ``P`` (as ``judge_all``: a draw of ``P`` per point cost more than
        the points' tapes)."""
        found = [self._per_row("float64", points, label, rows) for points in moved_points(xs, self.compute, sample_id)]
        products = self._projected([g for _, _, g in found]) if self.engine.options.reduce.kind == "project" \
            else [None] * len(found)
        return [self._datasets(*each, index, product) for each, product in zip(found, products)]
