"""``ParameterEngine``: per-sample gradients and Jacobians with respect to a model's weights
(``jacobian.wrt: parameters``), reduced inside the compiled function to what is stored.

Each element of a call is one sample and one scalar: an output row (``objective: outputs``, each row of
the selection its own element) or the sample's objective (``margin``, a loss). ``tf.vectorized_map``
turns the per-element gradient into batched kernels (a dense layer's per-sample weight gradient becomes a
batched outer product, not a loop), as ``torch.func.vmap(grad)`` and JAX's ``vmap(grad)`` do. Where pfor
cannot convert the model, a ``tf.map_fn`` loop of the same gradient runs instead, and says so.

What a call stores, per sample (``rows``: ``()`` for an objective, the output shape for ``outputs: all``,
``(k,)`` for a selection; ``p`` differentiated weight entries):

- ``projection`` ``(n, *rows, dim)``: the gradient times the seeded ``P`` (``reduce: project``), block by
  block (``parameter_space``), never forming ``P`` or ``(n, p)`` products beyond one block;
- ``frobenius`` ``(n,)`` and ``frobenius_by_layer`` ``(n, L)``: the gradient's norm, in total and per layer
  (``reduce: frobenius``; GraNd scores for a loss), short sums of squares in the compute dtype, the rest
  in float64 (``parameter_rules._squared_norms``);
- ``gradient`` ``(n, *rows, p)``: the gradient itself (``reduce: none``), only where it is small;
- ``output``, and ``output_index`` for a selection, ``objective`` for an objective, as on the input side.

``jit_compile`` applies to the chosen path as on the input side (``_choose_jit``): ``true`` compiles it by
XLA, ``auto`` where XLA also ran a full call faster at set-up; a call under XLA is padded to the full
number of elements, since XLA compiles once per shape.
"""

from __future__ import annotations

import logging
import math
import resource
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobeam.transforms import model_identity
from jacobeam.transforms.engine import model_checks, parameter_rules
from jacobeam.transforms.engine.diagnostics import AGREEMENT, activation_size, per_sample_relative_error
from jacobeam.transforms.engine.models import LoadedModel
from jacobeam.transforms.engine.parameter_space import (
    BLOCK_ROWS,
    Weight,
    factored,
    layout,
    objective_model,
    objective_value,
    objective_values,
    outputs_are_probabilities,
    projection_block,
    projection_factors,
    rows_shape,
)
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import EngineOptions, store_dtype

log = logging.getLogger(__name__)

REDUCTIONS = ("project", "frobenius", "none")
# reduce: none stores each sample's whole gradient: refused beyond this many bytes per sample.
MOST_GRADIENT_BYTES = 64 * 2**20
_PROBE_SEED = 0
_FIRST_BATCH = 8  # samples of the first real batch checked against the loop
# What a path that TensorFlow cannot run, or that disagrees with the loop, raises at set-up.
_CANNOT_RUN = (ValueError, TypeError, NotImplementedError, tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


class ParameterEngine:
    """Per-sample derivatives of a Keras model's outputs (or objective) with respect to its weights.

    Args:
        model: the loaded model; a Keras model (its weights are what is differentiated).
        input_shapes: one sample's shape, or ``{input name: shape}``.
        options: ``EngineOptions`` with ``parameters`` set.

    ``compute(x, labels)`` returns ``(datasets, None)`` (module docstring); ``labels`` ``(n,)`` are the
    samples' labels for ``margin``, a loss or ``outputs: label``.

    Raises:
        ModelError: the model is not a Keras model, has no such weights, its samples interact inside a
            batch, or the options do not fit it.
    """

    def __init__(self, model: LoadedModel, input_shapes, options: EngineOptions):
        began = time.perf_counter()
        side = options.parameters
        if side is None:
            raise ValueError("ParameterEngine needs EngineOptions.parameters")
        if options.reduce.kind not in REDUCTIONS:
            raise ModelError(f"jacobian.reduce: {options.reduce.kind} is not for wrt: parameters (use one of "
                             f"{', '.join(REDUCTIONS)})")
        self.options, self.side = options, side
        self.fingerprint = model.fingerprint()
        self.model_identity = model_identity.digest(model.identity) if model.identity else None
        if model.keras_model is None:
            raise ModelError(f"jacobian.wrt: parameters: {model.source} is not a Keras model (a SavedModel or a plain "
                             "tf.Module): its weights cannot be differentiated one layer at a time")
        self.probabilities = outputs_are_probabilities(model.keras_model)
        # softmax: the model differentiated is the logits, and the outputs stored are their softmax
        self.model, self.softmax = objective_model(model.with_dtype(options.compute_dtype), side.objective)
        source = self.model.source
        self.input_names, self.input_shapes = model_checks.resolve_inputs(self.model, input_shapes)
        keras_model = self.model.keras_model
        self.layout, self._variables = layout(keras_model, side.layers, source)
        self._described_layout = self.layout.describe()
        self.telemetry: dict[str, Any] = {}
        dtype = tf.as_dtype(options.compute_dtype)
        self._dtype = dtype
        specs = [tf.TensorSpec((None, *shape), dtype) for shape in self.input_shapes]
        self._forward_fn = tf.function(lambda xs: self.model.call(list(xs)), input_signature=[specs], autograph=False)
        self.output_shape = model_checks.output_shape(
            self._forward, self._probe(2), source, self.input_shapes, options.check_batch_independence,
            options.compute_dtype,
        )
        self.outputs = math.prod(self.output_shape)
        self._check_selection(source)
        self.rows_shape = rows_shape(side, options.outputs, self.output_shape)
        rows = math.prod(self.rows_shape)
        if options.reduce.kind == "none" and rows * self.layout.size * np.dtype(store_dtype(options.store_dtype)).itemsize \
                > MOST_GRADIENT_BYTES:
            raise ModelError(
                f"jacobian.reduce: none would store {rows * self.layout.size:,} entries per sample for {source} "
                f"({self.layout.size:,} weight entries x {rows} row(s)): use reduce: project or frobenius, or name "
                "fewer layers in jacobian.wrt"
            )
        self._activations = activation_size(self._forward_fn.get_concrete_function(specs).graph)
        self.elements = self._size("vectorized_map")
        self._probe_expected: dict | None = None  # the loop's values at the probe, once computed
        self.path = self._choose(source)
        self.elements = self._size(self.path)
        self.jit = self._choose_jit(source)
        # The seeded probe may miss what real data reaches (saturated units): the first real batch is
        # checked against the loop too (``_check_first_batch``), once, as the input side's engine does.
        self._unchecked, self._refused, self._first_batch = self.path != "map_fn", None, threading.Lock()
        self._traces_after_setup = self._step.experimental_get_tracing_count()
        self.telemetry["setup_seconds"] = round(time.perf_counter() - began, 3)
        log.info("parameter engine ready for %s: %d weight entries in %d layers, %s%s, %d element(s) per call",
                 source, self.layout.size, len(self.layout.layers), self.path, " + XLA" if self.jit else "",
                 self.elements)

    # -- set-up ------------------------------------------------------------------------------------

    def _size(self, path: str) -> int:
        """Elements per call that keep a call's working set within the memory budget: per element, its
        forward pass kept for the backward one and its gradients (every weight's at once, or, by layer rules
        reducing as they go, one layer's: ``parameter_rules.largest_transient``), each a few times over;
        per call, a block of ``P`` and its product. A batch that does not fit is cut into calls of equal
        size: a last call of a few elements would cost nearly a whole call (a projection draws all of ``P``
        in each)."""
        options, itemsize = self.options, np.dtype(self.options.compute_dtype).itemsize
        held, kept = self.layout.size, 3
        if path == "layer rules" and options.reduce.kind in ("project", "frobenius"):
            held = parameter_rules.largest_transient(self.model.keras_model, self._variables)
            # A projection's layer rules hold the forward pass about once (ResNet-20: 0.85x its activations
            # per element, 1.2x Kronecker, by TensorFlow's allocator; benchmarks/README.md), where the
            # ghost norms' float64 Grams and tape paths hold more.
            kept = 1.5 if options.reduce.kind == "project" else 3
        per_element = itemsize * (3 * held + kept * max(self._activations, 1) + 2 * options.reduce.project_dim)
        per_call = itemsize * 2 * BLOCK_ROWS * options.reduce.project_dim if options.reduce.kind == "project" else 0
        fit = int(max(1, (options.memory_budget - per_call) // per_element))
        wanted = options.batch_size * max(1, math.prod(self.rows_shape))
        return -(-wanted // -(-wanted // fit))  # the fewest calls that fit, of equal size

    def _probe(self, n: int) -> list[np.ndarray]:
        rng = np.random.default_rng(_PROBE_SEED)
        return [rng.standard_normal((n, *shape)).astype(self.options.compute_dtype) for shape in self.input_shapes]

    def _forward(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.asarray(self._forward_fn([tf.constant(x) for x in xs]))

    def _check_selection(self, source: str) -> None:
        selection, objective = self.options.outputs, self.side.objective
        if objective != "outputs" and selection.rule != "all":
            raise ModelError(f"jacobian.objective: {objective} is one value per sample; jacobian.outputs must be all")
        if selection.rule == "indices" and max(selection.indices) >= self.outputs:
            raise ModelError(f"jacobian.outputs: {source} has {self.outputs} outputs; indices {list(selection.indices)}")
        if selection.rule == "top_k" and selection.k > self.outputs:
            raise ModelError(f"jacobian.outputs: top_k {selection.k} of {self.outputs} outputs of {source}")
        if objective != "outputs" and self.outputs < 2:
            raise ModelError(f"jacobian.objective: {objective} needs a classifier's outputs; {source} has one output")
        if self.softmax and self.output_shape[-1] != self.outputs:
            raise ModelError(f"jacobian.objective: {objective} needs one softmax over a classifier's outputs; {source} "
                             f"outputs {tuple(self.output_shape)}, a softmax over the last axis")

    def _choose(self, source: str) -> str:
        """The first path that agrees with a loop of per-element tape gradients on two probe samples: layer
        rules (where every differentiated weight has one), then ``vectorized_map``, else that loop itself;
        a vectorised conversion of a model is trusted only once it agrees (as the input side's planner does)."""
        loop = self._loop = self._compiled("map_fn")
        paths = ["vectorized_map"]
        reason = parameter_rules.unsupported(self.model.keras_model, self._variables)
        if reason is None:
            paths.insert(0, "layer rules")
        else:
            self.telemetry["layer_rules"] = reason
        for path in paths:
            try:
                step = self._compiled(path)
                self._agrees_on_probe(step)
            except _CANNOT_RUN as err:
                why = _first_line(err)
                log.warning("%s: per-sample gradients by %s failed (%s)", source, path, why)
                self.telemetry[f"{path.replace(' ', '_')}_failure"] = why
                continue
            self._step = step
            return path
        self._step = loop
        return "map_fn"

    def _agrees_on_probe(self, step, pad: bool = False) -> None:
        """Run ``step`` on two probe samples; a ValueError where it disagrees with the loop of per-element
        tape gradients (computed once, at the first path that runs)."""
        xs, labels = self._probe(2), np.arange(2) % self.outputs
        found = self._call(step, xs, labels, pad=pad)
        if self._probe_expected is None:
            self._probe_expected = self._call(self._loop, xs, labels)
        for name, value in found.items():
            error = per_sample_relative_error(value, self._probe_expected[name])
            if not error <= AGREEMENT[self.options.compute_dtype]:
                raise ValueError(f"{name} disagrees with a loop of per-sample gradients (relative error {error:.2g})")

    def _choose_jit(self, source: str) -> bool:
        """Whether the chosen path runs under XLA (``jit_compile``): ``false``, never; ``true``, always, an error
        where XLA cannot compile it or disagrees with the loop on the probe; ``auto``, where it compiles, agrees
        and ran a full call faster than the plain graph (the best of two calls each, after one that compiles;
        XLA's CPU Philox is slower than TensorFlow's kernel, so dense projections seldom gain)."""
        wanted = self.options.jit_compile
        if wanted is False:
            return False
        try:
            step = self._compiled(self.path, jit=True)
            self._agrees_on_probe(step, pad=True)
        except _CANNOT_RUN as err:
            why = _first_line(err)
            if wanted is True:
                raise ModelError(f"{source}: XLA compilation of the per-sample gradients failed (jit_compile: true): "
                                 f"{why}") from err
            log.warning("%s: per-sample gradients by %s under XLA failed (%s)", source, self.path, why)
            self.telemetry["xla_failure"] = why
            return False
        if wanted == "auto":
            n = max(1, self.elements // max(1, math.prod(self.rows_shape)))
            full, full_labels = self._probe(n), np.arange(n) % self.outputs
            seconds = {}
            for name, candidate, pad in (("plain", self._step, False), ("xla", step, True)):
                times = []
                for _ in range(2):
                    began = time.perf_counter()
                    self._call(candidate, full, full_labels, pad=pad)
                    times.append(time.perf_counter() - began)
                seconds[name] = min(times)
            self.telemetry["xla_timed"] = {name: round(value, 6) for name, value in seconds.items()}
            if seconds["xla"] >= seconds["plain"]:
                return False
        self._step = step
        return True

    # -- the compiled step ---------------------------------------------------------------------------

    def _compiled(self, path: str, jit: bool = False):
        """``(xs (N, ...) per input, labels (N,), rows (N,)) -> {name: (N, ...)}`` for N elements, by ``path``:
        ``layer rules``, ``vectorized_map`` or ``map_fn``; compiled by XLA where ``jit``."""
        model, variables, side = self.model, self._variables, self.side
        reduction = self.options.reduce
        shown = tf.nn.softmax if self.softmax else tf.identity  # the outputs stored
        weights = self.layout.weights
        layer_of = {layer: i for i, layer in enumerate(self.layout.layers)}
        dtype = self._dtype

        def element(args):
            *parts, label, row = args
            with tf.GradientTape() as tape:
                y = tf.reshape(model.call([x[None] for x in parts]), (-1,))
                value = objective_value(side.objective, side.loss, y, label, row)
            grads = tape.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return shown(y), value, [tf.reshape(g, (-1,)) for g in grads]

        def by_layer(squares):
            found = [[] for _ in layer_of]
            for weight, square in zip(weights, squares):
                found[layer_of[weight.layer]].append(square)
            return tf.stack([tf.add_n(each) for each in found], axis=1)

        def reduce(y, values, grads):
            out = {"output": y, "objective": values}
            if reduction.kind == "none":
                out["gradient"] = tf.concat(grads, axis=1)
            elif reduction.kind == "frobenius":
                out["squares_by_layer"] = by_layer([tf.reduce_sum(tf.square(tf.cast(g, tf.float64)), axis=1) for g in grads])
            else:
                out["projection"] = tf.add_n([_projected(g, w, reduction, dtype) for g, w in zip(grads, weights)])
            return out

        def step(xs, labels, rows):
            if path == "layer rules":
                outputs = []  # the forward pass's, kept: the datasets' outputs without another pass

                def objective(y):
                    outputs.append(tf.reshape(y, (-1, self.outputs)))
                    return objective_values(side.objective, side.loss, outputs[0], labels, rows)

                if reduction.kind == "frobenius":  # the norms without forming the gradients where cheaper
                    values, squares = parameter_rules.gradients(model.keras_model, variables, list(xs), objective, True)
                    return {"output": shown(outputs[0]), "objective": values, "squares_by_layer": by_layer(squares)}
                if reduction.kind == "project":  # each weight projected as soon as formed: one layer's held
                    def project(k, g):
                        return _projected(tf.reshape(g, (-1, weights[k].size)), weights[k], reduction, dtype)

                    def factors(k):  # a kernel's A and B, its inputs and output gradients projected before their product
                        matrix = factored(weights[k]) if reduction.project_structure == "kronecker" else None
                        return None if matrix is None else projection_factors(
                            reduction.project_seed, reduction.project_kind, weights[k].index, matrix,
                            reduction.project_dim, dtype)

                    values, products = parameter_rules.gradients(model.keras_model, variables, list(xs), objective,
                                                                 reduce=project, factors=factors)
                    return {"output": shown(outputs[0]), "objective": values, "projection": tf.add_n(products)}
                values, grads = parameter_rules.gradients(model.keras_model, variables, list(xs), objective)
                y, grads = shown(outputs[0]), [tf.reshape(g, (-1, w.size)) for g, w in zip(grads, weights)]
            elif path == "vectorized_map":
                y, values, grads = tf.vectorized_map(element, (*xs, labels, rows), fallback_to_while_loop=False)
            else:
                signature = (tf.TensorSpec((self.outputs,), dtype), tf.TensorSpec((), dtype),
                             [tf.TensorSpec((w.size,), dtype) for w in weights])
                y, values, grads = tf.map_fn(element, (*xs, labels, rows), fn_output_signature=signature)
            return reduce(y, values, grads)

        specs = [tf.TensorSpec((None, *shape), dtype) for shape in self.input_shapes]
        return tf.function(step, input_signature=[specs, tf.TensorSpec((None,), tf.int32), tf.TensorSpec((None,), tf.int32)],
                           autograph=False, jit_compile=jit)

    def _call(self, step, xs: Sequence[np.ndarray], labels: np.ndarray | None, index: np.ndarray | None = None,
              pad: bool = False) -> dict:
        """Every element of the samples ``xs`` (one per sample and row), ``elements`` at a time; numpy, per
        element. ``pad``: a shorter call is padded with zeros to ``elements`` (XLA compiles per shape), its
        results cut back."""
        n, per = len(xs[0]), max(1, math.prod(self.rows_shape))
        if index is None:  # outputs: all (each output row), or an objective (one element)
            index = np.broadcast_to(np.arange(per, dtype=np.int64), (n, per)) if self.side.objective == "outputs" \
                else np.zeros((n, 1), np.int64)
        sample = np.repeat(np.arange(n), per)
        rows = np.asarray(index, np.int32).reshape(-1)
        label = np.zeros(n, np.int32) if labels is None else np.asarray(labels).astype(np.int32)
        pieces: list[dict] = []
        lo = 0
        while lo < len(sample):
            hi = lo + self.elements
            try:
                at = slice(lo, hi) if per == 1 else sample[lo:hi]  # one element per sample: views, not copies
                parts = [x[at] for x in xs] + [label[at], rows[lo:hi]]
                count = len(parts[-1])
                if pad and count < self.elements:
                    parts = [np.pad(part, [(0, self.elements - count)] + [(0, 0)] * (part.ndim - 1)) for part in parts]
                found = step([tf.constant(x) for x in parts[:-2]], tf.constant(parts[-2]), tf.constant(parts[-1]))
            except tf.errors.ResourceExhaustedError as err:  # fewer elements per call, for this call and later ones
                if self.elements == 1:
                    raise ModelError(f"{self.model.source}: out of memory even for one element per call (memory_budget "
                                     f"{self.options.memory_budget:,} bytes): {_first_line(err)}") from err
                self.elements = max(1, self.elements // 2)
                self.telemetry["oom_retries"] = self.telemetry.get("oom_retries", 0) + 1
                log.warning("%s: out of memory: retrying with %d element(s) per call", self.model.source, self.elements)
                continue
            pieces.append({k: v.numpy()[:count] for k, v in found.items()})
            lo = hi
        return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}

    # -- computing -----------------------------------------------------------------------------------

    def _select(self, n: int, y: np.ndarray | None, labels: np.ndarray | None) -> np.ndarray | None:
        """The output rows ``(n, k)`` differentiated per sample (None for all rows or an objective); ``y``, the
        outputs, needed only for ``argmax`` and ``top_k``."""
        selection = self.options.outputs
        if self.side.objective != "outputs" or selection.rule == "all":
            return None
        if selection.rule == "indices":
            return np.broadcast_to(np.asarray(selection.indices, np.int64), (n, len(selection.indices)))
        if selection.rule == "label":
            return np.asarray(labels, np.int64).reshape(n, 1)
        return np.argsort(-y.reshape(n, -1), axis=1, kind="stable")[:, : selection.count].astype(np.int64)

    def compute(self, x: np.ndarray | Mapping[str, np.ndarray], labels: np.ndarray | None = None) -> tuple[dict, None]:
        """The datasets to store for a batch (module docstring), and None (no aggregates on this side)."""
        xs = [x[name] for name in self.input_names] if isinstance(x, Mapping) else [x]
        xs = [np.asarray(part, self.options.compute_dtype) for part in xs]
        n = len(xs[0])
        needs_labels = self.options.needs_labels
        if needs_labels:
            if labels is None:
                raise ModelError("the samples come without labels, which the objective or outputs: label needs")
            labels = np.asarray(labels)
            bad = (labels < 0) | (labels >= self.outputs) | (labels != np.round(labels))
            if bad.any():
                raise ModelError(f"label {float(labels[bad][0]):g} is not an output index 0..{self.outputs - 1}")
        if self._refused is not None:
            raise ModelError(self._refused)
        chosen_by_outputs = self.side.objective == "outputs" and self.options.outputs.rule in ("argmax", "top_k")
        y = self._forward(xs) if chosen_by_outputs else None  # else the gradients' own forward pass gives them
        index = self._select(n, y, labels)
        raw = self._call(self._step, xs, labels, index, pad=self.jit)
        if self._unchecked:
            self._check_first_batch(xs, labels, index, raw)
        if y is None:
            y = raw["output"][:: max(1, math.prod(self.rows_shape))].reshape(n, *self.output_shape)
        return self._datasets(y, index, raw, n), None

    def _check_first_batch(self, xs, labels, index, raw: dict) -> None:
        """Once: up to ``_FIRST_BATCH`` samples of the first real batch by the loop of per-element tape
        gradients, against the chosen path; on disagreement the engine refuses this and every later call.
        Samples whose loop values are not all finite are not judged (derivatives undefined there)."""
        with self._first_batch:
            if self._refused is not None:
                raise ModelError(self._refused)
            if not self._unchecked:
                return
            m = min(len(xs[0]), _FIRST_BATCH)
            per = max(1, math.prod(self.rows_shape))
            expected = self._call(self._loop, [x[:m] for x in xs], None if labels is None else labels[:m],
                                  None if index is None else index[:m])
            for name, want in expected.items():
                got = raw[name][: m * per]
                finite = np.all(np.isfinite(want.reshape(len(want), -1)), axis=1)
                error = per_sample_relative_error(got[finite], want[finite]) if finite.any() else 0.0
                if not error <= AGREEMENT[self.options.compute_dtype]:
                    self._refused = (
                        f"{self.model.source}: per-sample gradients by {self.path} disagree with a loop of per-sample "
                        f"tape gradients on the first batch's samples ({name}: relative error {error:.2g}), though they "
                        "agreed on the probe: refused"
                    )
                    raise ModelError(self._refused)
            self._unchecked = False
            self.telemetry["first_batch_check"] = {"reference": "map_fn", "samples": m}

    def _datasets(self, y: np.ndarray, index: np.ndarray | None, raw: dict, n: int) -> dict[str, np.ndarray]:
        dtype = store_dtype(self.options.store_dtype)
        rows = self.rows_shape
        out = {"output": y.astype(dtype)}
        if index is not None:
            out["output_index"] = np.asarray(index, np.int64)
        if self.side.objective != "outputs":
            out["objective"] = raw["objective"].reshape(n).astype(dtype)
        if "projection" in raw:
            out["projection"] = raw["projection"].reshape(n, *rows, -1).astype(dtype)
        if "gradient" in raw:
            out["gradient"] = raw["gradient"].reshape(n, *rows, -1).astype(dtype)
        if "squares_by_layer" in raw:
            by_layer = raw["squares_by_layer"].reshape(n, -1, len(self.layout.layers)).sum(axis=1)
            out["frobenius"] = np.sqrt(by_layer.sum(axis=1)).astype(dtype)
            out["frobenius_by_layer"] = np.sqrt(by_layer).astype(dtype)
        return out

    def __call__(self, x, labels=None) -> dict[str, np.ndarray]:
        return self.compute(x, labels)[0]

    # -- reporting -----------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Samples per call that keep one call's elements within the memory budget."""
        return int(max(1, min(self.options.batch_size, self.elements // max(1, math.prod(self.rows_shape)))))

    @property
    def activations(self) -> int:
        return self._activations

    def describe(self) -> dict[str, Any]:
        """What runs and why (the input side's keys, for the metrics and the manifest, and this side's)."""
        return {
            "mode": "parameters",
            "path": self.path,
            "jit_compile": self.jit,
            "reasons": [f"per-sample gradients of {self.layout.size:,} weight entries in {len(self.layout.layers)} layers "
                        f"by {self.path}{' under XLA' if self.jit else ''}, {self.elements} (sample, row) element(s) per call"],
            "retraces_after_setup": self._step.experimental_get_tracing_count() - self._traces_after_setup,
            "pfor_fallbacks": [],
            "oom_retries": self.telemetry.get("oom_retries", 0),
            "batch_size": self.batch_size,
            "elements_per_call": self.elements,
            "parameters": self.layout.size,
            "layers": len(self.layout.layers),
            "objective": self.side.objective,
            "layout": self._described_layout,
            "outputs_are": "probabilities" if self.probabilities else "logits",
            "compute_dtype": self.options.compute_dtype,
            "store_dtype": self.options.store_dtype,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **self.telemetry,
        }


def _projected(grads: tf.Tensor, weight: Weight, reduction, dtype) -> tf.Tensor:
    """``grads`` ``(N, size)`` of one weight times its rows of ``P``, ``(N, dim)``: ``A^T G B`` (Kronecker), or
    one block at a time."""
    size = int(grads.shape[1])
    seed, kind, dim = reduction.project_seed, reduction.project_kind, reduction.project_dim
    matrix = factored(weight) if reduction.project_structure == "kronecker" else None
    if matrix is not None:
        a, b = projection_factors(seed, kind, weight.index, matrix, dim, dtype)
        right = tf.einsum("nio,ol->nil", tf.reshape(grads, (-1, *matrix)), b)
        return tf.reshape(tf.einsum("nil,ik->nkl", right, a), (-1, dim))
    whole, rest = divmod(size, BLOCK_ROWS)
    # The last block draws only the weight's rows (a shorter draw is the longer one's first rows), and each
    # block multiplies its slice of ``grads``: neither zero rows nor a transposed copy of ``grads``.
    pieces = []
    if whole:
        def body(j, total):
            part = tf.slice(grads, [0, j * BLOCK_ROWS], [-1, BLOCK_ROWS])
            return j + 1, total + tf.matmul(part, projection_block(seed, kind, weight.index, j, dim, dtype))

        total = tf.zeros((tf.shape(grads)[0], dim), dtype)
        pieces.append(tf.while_loop(lambda j, _: j < whole, body, (tf.constant(0), total))[1])
    if rest:
        part = grads[:, whole * BLOCK_ROWS :]
        pieces.append(tf.matmul(part, projection_block(seed, kind, weight.index, whole, dim, dtype, rest)))
    return tf.add_n(pieces)
