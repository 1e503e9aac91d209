"""The Jacobian engine: compiled per-sample Jacobians of a model, built once per worker.

Pure TensorFlow, no Beam. The engine chooses how to differentiate (``transforms.engine.blocks``),
whether XLA runs, and how to cut a batch into blocks so that the working set stays within a memory
budget; it checks each fast path against a plain one before trusting it.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from transforms.errors import ModelError
from transforms.models import LoadedModel
from transforms.reductions import FULL, SQUARE, projection_matrix, reduce_full
from transforms.spec import EngineOptions
from transforms.engine.blocks import MODES, ForwardModeUnsupported, build_block

log = logging.getLogger(__name__)

_AGREEMENT = {"float32": 1e-4, "float64": 1e-9}  # max |a - b| / max |b| for two paths to agree
_PROBE_SEED = 0


@dataclass
class _Plan:
    mode: str
    jit: bool
    batch: int  # samples per block
    rows: dict[int, int]  # block size per differentiated input
    reasons: list[str] = field(default_factory=list)
    double_reverse: bool = False  # forward mode's blocks by double reverse (see transforms.engine.blocks)


class _FallbackLog(logging.Handler):
    """Collects pfor's "Using a while_loop for converting <op>" messages while a function traces."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.ops: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Using a while_loop for converting"):
            self.ops.append(message.split()[5])


@contextlib.contextmanager
def _capture_pfor_fallbacks() -> Iterator[_FallbackLog]:
    logger = logging.getLogger("tensorflow")
    handler, level = _FallbackLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest difference over the largest reference entry, both over the finite entries; inf where the
    two disagree on which entries are finite (a NaN anywhere would otherwise pass every comparison)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(actual)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = max(float(np.max(np.abs(expected[finite]))), np.finfo(np.float32).tiny)
    return float(np.max(np.abs(actual[finite] - expected[finite]))) / scale


def _activation_size(model: LoadedModel, shapes: Sequence[tuple[int, ...]], dtype: tf.DType) -> int:
    """Elements per sample of every intermediate tensor of the forward pass: what backpropagation
    keeps per output row. Found from the traced graph, so it needs no knowledge of the layers."""
    specs = [tf.TensorSpec((None, *s), dtype) for s in shapes]
    graph = tf.function(lambda *xs: model.call(list(xs))).get_concrete_function(*specs).graph
    total = 0
    for op in graph.get_operations():
        for out in op.outputs:
            dims = out.shape.as_list() if out.shape.rank else None
            if dims and dims[0] is None and out.dtype.is_floating and None not in dims[1:]:
                total += int(np.prod(dims[1:], dtype=np.int64))
    return total


class JacobianEngine:
    """Per-sample Jacobians ``d output_i / d input_i`` for whole batches.

    ``engine(x)`` with ``x`` of shape ``(n, *input_shape)`` (or a mapping input name -> array for a
    model with several inputs) returns numpy arrays in ``store_dtype``:

    - ``"jacobian"``: ``(n, *output_shape, *input_shape)`` for a one-input model, or
      ``"jacobian/<input name>"`` per differentiated input of a several-input model;
    - ``"output"``: ``(n, *output_shape)``, the model's outputs.

    Any ``n`` works; ``batch_size`` is the number of samples a caller should pass at a time (the
    configured batch size, or fewer where one sample's Jacobian is large for the memory budget).
    """

    def __init__(
        self,
        model: LoadedModel,
        input_shapes: tuple[int, ...] | Mapping[str, tuple[int, ...]],
        options: EngineOptions,
    ):
        self.options = options
        self.fingerprint = model.fingerprint()
        self.model = model.with_dtype(options.compute_dtype)
        self._dtype = tf.as_dtype(options.compute_dtype)
        self.input_names, self.input_shapes = self._resolve_inputs(input_shapes)
        self._wrt = self._resolve_wrt(options.wrt)
        self.telemetry: dict[str, Any] = {"pfor_fallbacks": [], "oom_retries": 0}
        self._blocks: dict[tuple[str, bool, int, int], Any] = {}
        self._probe = self._make_probe(min(options.batch_size, 8))
        began = time.perf_counter()
        self.output_shape = self._check_model()
        self._prepare_products()
        self._activations = _activation_size(self.model, self.input_shapes, self._dtype)
        self._plan = self._choose()
        self.telemetry["setup_seconds"] = round(time.perf_counter() - began, 3)
        self._traces_after_setup = self.traces
        plan = self._plan
        log.info(
            "engine ready for %s: mode %s%s, batch %d, blocks %s (%s)",
            self.model.source, plan.mode, " + XLA" if plan.jit else "", plan.batch,
            {self.input_names[k]: rows for k, rows in plan.rows.items()}, "; ".join(plan.reasons),
        )

    # -- set-up -------------------------------------------------------------------------------

    def _resolve_inputs(self, shapes) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
        names = self.model.input_names
        if not isinstance(shapes, Mapping):
            if len(names) != 1:
                raise ModelError(f"{self.model.source} takes inputs {list(names)}; give one shape per input")
            shapes = {names[0]: tuple(shapes)}
        missing = [name for name in names if name not in shapes]
        if missing:
            raise ModelError(f"{self.model.source}: no samples for model input(s) {missing}")
        found = tuple(tuple(int(d) for d in shapes[name]) for name in names)
        declared = self.model.input_shapes
        for name, want, got in zip(names, declared or (), found):
            if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got)):
                label = f"input {name!r}" if len(names) > 1 else "samples"
                raise ModelError(
                    f"{self.model.source} expects {label} of shape {tuple(want)}; "
                    f"the inputs hold samples of shape {got}"
                )
        return names, found

    def _resolve_wrt(self, wrt: tuple[str, ...] | None) -> list[int]:
        if wrt is None:
            return list(range(len(self.input_names)))
        unknown = [name for name in wrt if name not in self.input_names]
        if unknown:
            raise ModelError(f"jacobian.wrt: {self.model.source} has no input(s) {unknown}; it has {list(self.input_names)}")
        return [self.input_names.index(name) for name in wrt]

    def _make_probe(self, n: int) -> list[np.ndarray]:
        """Seeded standard-normal samples: used to check, compare and time paths during set-up."""
        rng = np.random.default_rng(_PROBE_SEED)
        return [rng.standard_normal((n, *shape)).astype(self.options.compute_dtype) for shape in self.input_shapes]

    def _forward(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.asarray(self.model.call([tf.constant(x) for x in xs]))

    def _check_model(self) -> tuple[int, ...]:
        """Output shape; and refuse a model whose samples interact inside a batch."""
        try:
            y = self._forward(self._probe)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
            raise ModelError(
                f"{self.model.source}: cannot call the model on samples of shape(s) {list(self.input_shapes)}: {err}"
            ) from err
        n = len(y)
        if self.options.check_batch_independence and n >= 2:
            half = n // 2
            parts = np.concatenate(
                [self._forward([x[:half] for x in self._probe]), self._forward([x[half:] for x in self._probe])]
            )
            error = relative_error(parts, y)
            if error > _AGREEMENT[self.options.compute_dtype]:
                raise ModelError(
                    f"{self.model.source}: a sample's output depends on the other samples in its batch "
                    f"(relative difference {error:.2g} between one batch and two halves), e.g. BatchNorm in "
                    "training mode or a batch-level op; per-sample Jacobians by batch_jacobian would be wrong"
                )
        return tuple(int(d) for d in y.shape[1:])

    @property
    def _outputs(self) -> int:
        return int(np.prod(self.output_shape, dtype=np.int64))

    def _size(self, k: int) -> int:
        return int(np.prod(self.input_shapes[k], dtype=np.int64))

    # -- what to compute ----------------------------------------------------------------------

    def _prepare_products(self) -> None:
        """Check the output selection and reduction against the model; load the fixed matrices of
        products: ``_left`` (rows over outputs, reverse mode), ``_right`` (rows over inputs, forward
        mode) and ``_after`` (applied to forward results: ``U^T`` of a two-sided basis)."""
        selection, reduction = self.options.outputs, self.options.reduce
        kind, m, source = reduction.kind, self._outputs, self.model.source
        self._left = self._right = self._after = None
        if kind != "none" and len(self.input_names) > 1:
            raise ModelError(f"jacobian.reduce {kind}: only for one-input models; {source} has {list(self.input_names)}")
        if selection.rule == "indices" and not all(0 <= i < m for i in selection.indices):
            raise ModelError(f"jacobian.outputs: indices {list(selection.indices)} out of range 0..{m - 1} for {source}")
        if selection.rule == "top_k" and not 1 <= selection.k <= m:
            raise ModelError(f"jacobian.outputs: top_k {selection.k} out of range 1..{m} for {source}")
        if selection.rule != "all" and kind not in ("none", "frobenius", "max_abs_over_outputs",
                                                    "sum_abs_over_channels", "project"):
            raise ModelError(f"jacobian.reduce {kind} cannot be combined with outputs {selection.rule!r}")
        d = self._size(0)
        if kind in SQUARE and m != d:
            raise ModelError(f"jacobian.reduce {kind}: needs a square Jacobian; {source} maps {d} input entries to {m} outputs")
        if kind == "vjp":
            self._left = self._matrix(reduction.vectors, "jacobian.vectors", self.output_shape)
        elif kind == "jvp":
            self._right = self._matrix(reduction.vectors, "jacobian.vectors", self.input_shapes[0])
        elif kind == "project":
            matrix = projection_matrix(d, reduction.project_dim, reduction.project_kind, reduction.project_seed)
            self._right = matrix.T.astype(self.options.compute_dtype)
        elif kind == "basis":
            inputs = self._matrix(reduction.basis_input, "jacobian.basis.input", (d,), basis=True)
            outputs = self._matrix(reduction.basis_output, "jacobian.basis.output", (m,), basis=True)
            if inputs is None and outputs is None:
                raise ModelError("jacobian.reduce basis: give jacobian.basis.input and/or jacobian.basis.output")
            if inputs is not None:
                self._right, self._after = inputs, outputs
            else:
                self._left = outputs

    def _matrix(self, path: str | None, key: str, shape: tuple[int, ...], basis: bool = False) -> np.ndarray | None:
        """Vectors from a .npy file as rows ``(r, prod(shape))``. Vectors are ``(r, *shape)`` (or one
        of ``shape``); a basis is ``(prod(shape), r)``: its columns are the vectors."""
        if path is None:
            if basis:
                return None
            raise ModelError(f"{key}: reduce {self.options.reduce.kind} needs a .npy file of vectors")
        try:
            with tf.io.gfile.GFile(path, "rb") as stream:
                array = np.load(stream)
        except (OSError, ValueError, tf.errors.OpError) as err:
            raise ModelError(f"{key} {path}: cannot read a .npy array: {err}") from err
        size = int(np.prod(shape, dtype=np.int64))
        if basis:
            if array.ndim != 2 or array.shape[0] != size:
                raise ModelError(f"{key} {path}: shape {array.shape}; expected ({size}, r): one column per basis vector")
            array = array.T
        elif array.shape == shape:
            array = array[None]
        elif array.shape[1:] != shape:
            raise ModelError(f"{key} {path}: shape {array.shape}; expected (r, {', '.join(map(str, shape))}) or {shape}")
        return np.ascontiguousarray(array.reshape(len(array), size), dtype=self.options.compute_dtype)

    def _operand(self, mode: str) -> str:
        if mode == "forward":
            return "identity" if self._right is None else "matrix"
        if self._left is not None:
            return "matrix"
        return "identity" if self.options.outputs.rule == "all" else "index"

    def _extent(self, mode: str, k: int) -> int:
        """Rows (reverse) or columns (forward) that the blocks of input ``k`` cover."""
        operand = self._operand(mode)
        if mode == "forward":
            return self._size(k) if operand == "identity" else len(self._right)
        if operand == "matrix":
            return len(self._left)
        return self.options.outputs.count or self._outputs

    def _select(self, y: np.ndarray, labels: np.ndarray | None) -> np.ndarray | None:
        """Per-sample flat output indices ``(n, k)``, or None for all outputs."""
        selection, n = self.options.outputs, len(y)
        flat = y.reshape(n, -1)
        if selection.rule == "all":
            return None
        if selection.rule == "indices":
            return np.broadcast_to(np.asarray(selection.indices, np.int32), (n, len(selection.indices)))
        if selection.rule == "argmax":
            return np.argmax(flat, axis=1).astype(np.int32)[:, None]
        if selection.rule == "top_k":
            return np.argsort(-flat, axis=1, kind="stable")[:, : selection.k].astype(np.int32)
        if labels is None:
            raise ModelError("jacobian.outputs label: no labels were given with the samples")
        labels = np.asarray(labels).reshape(n)
        bad = np.flatnonzero((labels < 0) | (labels >= flat.shape[1]) | (labels != np.round(labels)))
        if len(bad):
            raise ModelError(f"label {labels[bad[0]]} of batch row {bad[0]} is not an output index 0..{flat.shape[1] - 1}")
        return labels.astype(np.int32)[:, None]

    def _sizing(self, mode: str) -> tuple[int, dict[int, int], list[str]]:
        """Batch and block sizes that keep one block's working set within the memory budget.

        Estimated working set in bytes, per sample: the batch's finished Jacobians (``m * d``) plus,
        for a block of ``c`` rows, ``c`` copies of the per-sample intermediates (``a``) and of the
        differentiated input (reverse: cotangents) or of input and output (forward: tangents).
        """
        item = np.dtype(self.options.compute_dtype).itemsize
        budget, m = self.options.memory_budget, self._outputs
        forward = mode == "forward"
        # A block's finished result per sample: all outputs by the columns (forward), or the rows by
        # all input entries (reverse).
        result = sum(self._extent(mode, k) * (m if forward else self._size(k)) for k in self._wrt) * item
        batch = int(min(self.options.batch_size, max(1, (budget // 2) // max(result, 1))))
        notes = []
        if batch < self.options.batch_size:
            notes.append(f"batch {self.options.batch_size} -> {batch}: one sample's Jacobian is {result:,} bytes")
        rows = {}
        for k in self._wrt:
            per_row = (self._activations + self._size(k) + (m if mode == "forward" else 0)) * item * batch
            extent = self._extent(mode, k)
            rows[k] = int(min(extent, max(1, (budget - batch * result) // max(per_row, 1))))
            if rows[k] < extent:
                notes.append(f"{self.input_names[k]}: blocks of {rows[k]} of {extent} {'inputs' if mode == 'forward' else 'outputs'}")
        return batch, rows, notes

    def _block(self, plan: _Plan, k: int, rows: int):
        key = (plan.mode, plan.jit, plan.double_reverse, k, rows)
        if key not in self._blocks:
            self._blocks[key] = build_block(
                plan.mode, self.model.call, self.input_shapes, k, rows, self._extent(plan.mode, k), self._dtype,
                plan.jit, operand=self._operand(plan.mode), double_reverse=plan.double_reverse,
            )
        return self._blocks[key]

    def _try(self, mode: str, jit: bool, timed: bool, double_reverse: bool = False) -> tuple[dict[str, np.ndarray], float]:
        """Trace and run a path on the probe batch: its results, and (``timed``) the best of two
        runs on one full batch."""
        batch, rows, _ = self._sizing(mode)
        plan = _Plan(mode, jit, batch, rows, double_reverse=double_reverse)
        probe = [x[:batch] for x in self._probe]
        index = self._select(self._forward(probe), np.zeros(batch))
        with _capture_pfor_fallbacks() as fallbacks:
            result = self._compute(probe, plan, index)
        for op in fallbacks.ops:
            if op not in self.telemetry["pfor_fallbacks"]:
                log.warning("pfor could not vectorise %s: it runs in a while_loop (slow)", op)
                self.telemetry["pfor_fallbacks"].append(op)
        if not timed:
            return result, 0.0
        full = self._make_probe(batch)
        index = self._select(self._forward(full), np.zeros(batch))
        timings = []
        for _ in range(2):
            began = time.perf_counter()
            self._compute(full, plan, index)
            timings.append(time.perf_counter() - began)
        return result, min(timings) / batch

    def _candidates(self) -> tuple[list[str], str]:
        mode = self.options.mode
        kind = self.options.reduce.kind
        if self._right is not None:
            return ["forward"], f"reduce {kind}: products with input-side vectors run in forward mode"
        if self._left is not None:
            modes = ["reverse", "reverse_loop"] if mode == "autotune" else ["reverse_loop" if mode == "reverse_loop" else "reverse"]
            return modes, f"reduce {kind}: products with output-side vectors run in reverse mode"
        if mode in MODES:
            return [mode], f"mode {mode} (configured)"
        inputs = sum(self._size(k) for k in self._wrt)
        rows = self._extent("reverse", 0)
        by_size = "forward" if inputs <= rows else "reverse"
        reason = f"{inputs} input entries vs {rows} output rows"
        if mode == "auto":
            return [by_size], f"mode auto: {by_size} ({reason})"
        return [by_size] + [m for m in MODES if m != by_size], "mode autotune: fastest path agreeing with the others"

    def _choose(self) -> _Plan:
        modes, reason = self._candidates()
        notes = [reason]
        plan = self._first_good(modes, notes)
        fallbacks = [mode for mode in ("reverse", "reverse_loop") if mode not in modes]
        if plan is None and self.options.mode in ("auto", "autotune") and fallbacks:
            # The plain loop over outputs is last: it needs neither forward-mode rules nor pfor.
            notes.append(f"{', '.join(modes)} failed: trying {', '.join(fallbacks)}")
            plan = self._first_good(fallbacks, notes)
        if plan is None:
            hint = "; use jit_compile auto or false" if self.options.jit_compile is True else ""
            raise ModelError(f"{self.model.source}: no way to compute Jacobians worked: {'; '.join(notes[1:])}{hint}")
        return plan

    def _first_good(self, modes: list[str], notes: list[str]) -> _Plan | None:
        """Try each (mode, XLA) path; keep the best that works and agrees with the reference.

        The plain graph of the first mode runs first and is the reference every other path must
        agree with (a fast path can be wrong: forward mode through max-pooling under XLA is). Best
        is the fastest per sample under ``autotune``; else the first mode, and with ``jit_compile:
        auto`` the faster of its plain graph and XLA (XLA is not always faster: it loses on
        max-pooling CNNs and wins on small dense chains). With ``jit_compile: true`` the plain graph
        runs too, on the probe only, as the reference XLA must agree with; it is never used.
        """
        jit_options = {True: [False, True], False: [False], "auto": [False, True]}[self.options.jit_compile]
        autotune = self.options.mode == "autotune"
        timed = autotune or self.options.jit_compile == "auto"
        reference_only = self.options.jit_compile is True  # the plain graph: a reference, not a candidate
        reference: dict[str, np.ndarray] | None = None
        tried = self.telemetry.setdefault("candidates", [])
        first_tried = len(tried)
        best: tuple[tuple, str, bool, bool] | None = None  # (rank, mode, jit, double_reverse)
        for mode in modes:
            for jit, double_reverse in self._paths(mode, jit_options):
                label = f"{mode}{' by double reverse' if double_reverse else ''}{' + XLA' if jit else ''}"
                try:
                    result, seconds = self._try(mode, jit, timed=timed, double_reverse=double_reverse)
                except ForwardModeUnsupported as err:
                    if self.options.mode == "forward":
                        raise ModelError(f"{self.model.source}: {err}") from err
                    notes.append(f"forward: {err}")
                    tried.append({"path": label, "error": "an op has no forward-mode rule"})
                    break
                except (tf.errors.OpError, ValueError, TypeError, NotImplementedError, LookupError) as err:
                    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                    if jit and self.options.jit_compile is True:
                        raise ModelError(
                            f"{self.model.source}: XLA compilation failed (jit_compile: true): {first_line}"
                        ) from err
                    log.warning("%s failed for %s, falling back: %s", label, self.model.source, first_line)
                    notes.append(f"{label} failed: {first_line}")
                    tried.append({"path": label, "error": first_line})
                    continue
                entry: dict[str, Any] = {"path": label}
                if timed:
                    entry["seconds_per_sample"] = seconds
                if reference is None:
                    reference = result
                else:
                    error = max(relative_error(result[name], reference[name]) for name in reference)
                    entry["relative_error"] = error
                    if error > _AGREEMENT[self.options.compute_dtype]:
                        log.warning("%s disagrees with the reference path (relative error %.2g): not used", label, error)
                        notes.append(f"{label} disagrees with the reference (relative error {error:.2g})")
                        tried.append(entry)
                        continue
                tried.append(entry)
                if reference_only and not jit:
                    entry["reference_only"] = True
                    continue
                # Untimed, the double-reverse forward graph wins over the accumulator's it agrees with.
                rank = (seconds,) if autotune else (modes.index(mode), seconds, not double_reverse)
                if best is None or rank < best[0]:
                    best = (rank, mode, jit, double_reverse)
        if best is None:
            return None
        _, mode, jit, double_reverse = best
        if timed:
            speeds = [f"{e['path']} {1e6 * e['seconds_per_sample']:.1f} us/sample" for e in tried[first_tried:] if "seconds_per_sample" in e]
            notes.append(f"timed on a full batch: {', '.join(speeds)}")
        batch, rows, sizing = self._sizing(mode)
        return _Plan(mode, jit, batch, rows, [*notes, *sizing], double_reverse)

    def _paths(self, mode: str, jit_options: list[bool]) -> list[tuple[bool, bool]]:
        """``(jit, double_reverse)`` paths to try for ``mode``, the reference first. Forward mode's plain
        graph also runs by double reverse (faster, but only trusted where it agrees with the
        accumulator); not under XLA, where the accumulator's graph is the faster (W3, W4), nor where the
        plain graph is only a reference (``jit_compile: true``)."""
        paths = [(jit, False) for jit in jit_options]
        if mode == "forward" and self.options.jit_compile is not True:
            paths.insert(1, (False, True))
        return paths

    # -- computing ----------------------------------------------------------------------------

    def _compute(
        self, xs: Sequence[np.ndarray], plan: _Plan, index: np.ndarray | None = None
    ) -> dict[Any, np.ndarray]:
        """``L J R`` of every sample of ``xs`` in compute dtype, block by block, as
        ``{"output": (n, m), k: (n, rows, columns)}`` per differentiated input ``k``; rows are all
        outputs, the ``index``-selected ones or the rows of ``_left``; columns are all input entries
        or the rows of ``_right``. Halves blocks on out-of-memory and retries."""
        n, m = len(xs[0]), self._outputs
        forward = plan.mode == "forward"
        operand = self._operand(plan.mode)
        shape = {k: (n, m, self._extent("forward", k)) if forward else (n, self._extent(plan.mode, k), self._size(k))
                 for k in self._wrt}
        # Filled block by block, except in the common case of one block covering everything, which is
        # used as it comes (no copy).
        blocks: dict[int, np.ndarray] = {}
        output = np.empty((n, m), self.options.compute_dtype) if n > plan.batch else None

        def padded(x: np.ndarray, pad: int) -> np.ndarray:
            return np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x

        for lo in range(0, n, plan.batch):
            hi = min(lo + plan.batch, n)
            pad = plan.batch - (hi - lo) if plan.jit else 0  # XLA compiles per shape: pad, never recompile
            batch = [tf.constant(padded(x[lo:hi], pad)) for x in xs]
            if operand == "index":
                given = tf.constant(padded(index[lo:hi], pad))
            elif operand == "matrix":
                given = tf.constant(self._right if forward else self._left)
            else:
                given = tf.zeros((0, 0), self._dtype)
            for k in self._wrt:
                start, extent = 0, self._extent(plan.mode, k)
                while start < extent:
                    rows = plan.rows[k]
                    first = min(start, extent - rows)  # keep every block full-size: no retrace
                    try:
                        y, block = self._block(plan, k, rows)(batch, first, given)
                    except tf.errors.ResourceExhaustedError:
                        self._shrink(plan, k)
                        continue
                    block = np.asarray(block)[: hi - lo]  # read-only, no copy (.numpy() copies)
                    if hi - lo == n and rows == extent:
                        blocks[k] = block
                    else:
                        target = blocks.setdefault(k, np.empty(shape[k], self.options.compute_dtype))
                        if forward:
                            target[lo:hi, :, first : first + rows] = block
                        else:
                            target[lo:hi, first : first + rows] = block
                    if output is None:
                        output = np.asarray(y)[:n]  # one sub-batch: every block returns the same outputs
                    elif hi - lo < n:
                        output[lo:hi] = np.asarray(y)[: hi - lo]
                    start = first + rows
        if forward and index is not None:
            blocks = {k: np.take_along_axis(block, index[:, :, None], axis=1) for k, block in blocks.items()}
        return {"output": output, **blocks}

    def _shrink(self, plan: _Plan, k: int) -> None:
        self.telemetry["oom_retries"] += 1
        if plan.rows[k] > 1:
            plan.rows[k] = max(1, plan.rows[k] // 2)
        elif plan.batch > 1:
            plan.batch = max(1, plan.batch // 2)
        else:
            raise ModelError(f"{self.model.source}: out of memory even for one sample and one row per block")
        note = f"out of memory: retrying with batch {plan.batch}, blocks of {plan.rows[k]}"
        log.warning(note)
        plan.reasons.append(note)

    def _name(self, k: int) -> str:
        return "jacobian" if len(self.input_names) == 1 else f"jacobian/{self.input_names[k]}"

    def compute(
        self, x: np.ndarray | Mapping[str, np.ndarray], labels: np.ndarray | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """The datasets to store for a batch, and (where the full Jacobian was computed) the
        Jacobians ``(n, rows, d)`` in store dtype that aggregates are taken over.

        ``labels`` ``(n,)`` are each sample's target output for ``outputs: label``. Arrays may be
        read-only (views of TensorFlow's result buffers, not copies).
        """
        xs = [x[name] for name in self.input_names] if isinstance(x, Mapping) else [x]
        xs = [np.asarray(part, self.options.compute_dtype) for part in xs]
        n = len(xs[0])
        index = None if self.options.outputs.rule == "all" else self._select(self._forward(xs), labels)
        raw = self._compute(xs, self._plan, index)
        store = _store_dtype(self.options.store_dtype)
        datasets = {"output": raw["output"].reshape((n, *self.output_shape))}
        if index is not None:
            datasets["output_index"] = index.astype(np.int64)
        rows_shape = self.output_shape if index is None else (index.shape[1],)
        kind = self.options.reduce.kind
        full = None
        if kind in FULL:
            for k in self._wrt:
                full = raw[k].astype(store, copy=False)
                reduced = reduce_full(kind, raw[k], rows_shape, self.input_shapes[k])
                if "jacobian" in reduced and len(self.input_names) > 1:
                    reduced = {self._name(k): reduced.pop("jacobian")}
                datasets.update(reduced)
        else:
            datasets.update(self._products(kind, raw[0], rows_shape))
        stored = {
            name: value.astype(store, copy=False) if value.dtype.kind == "f" else value
            for name, value in datasets.items()
        }
        return stored, full if self.options.aggregate else None

    def _products(self, kind: str, raw: np.ndarray, rows_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        n, input_shape = len(raw), self.input_shapes[0]
        if kind == "vjp":  # (n, r, d): u^T J for each vector u
            return {"vjp": raw.reshape((n, len(raw[0]), *input_shape))}
        if kind == "jvp":  # (n, m, r) -> (n, r, *output_shape): J v for each vector v
            return {"jvp": np.moveaxis(raw, 2, 1).reshape((n, raw.shape[2], *self.output_shape))}
        if kind == "project":  # (n, rows, dim): J P
            return {"projection": raw.reshape((n, *rows_shape, raw.shape[2]))}
        if self._after is not None:  # basis, both sides: U^T (J V)
            return {"basis_projection": np.einsum("pm,nmq->npq", self._after, raw)}
        return {"basis_projection": raw}  # U^T J (reverse), or J V (forward) with the other side identity

    def __call__(self, x: np.ndarray | Mapping[str, np.ndarray], labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The datasets to store for a batch (see the class docstring)."""
        return self.compute(x, labels)[0]

    # -- reporting ----------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Samples per call that keep the working set within the memory budget."""
        return self._plan.batch

    @property
    def traces(self) -> int:
        return sum(fn.experimental_get_tracing_count() for fn in self._blocks.values())

    def describe(self) -> dict[str, Any]:
        """What runs and why: for logs, Beam metrics and the manifest."""
        plan = self._plan
        return {
            "mode": plan.mode,
            "double_reverse": plan.double_reverse,  # forward mode's blocks by double reverse
            "jit_compile": plan.jit,
            "requested": {"mode": self.options.mode, "jit_compile": self.options.jit_compile},
            "batch_size": plan.batch,
            "block_rows": {self.input_names[k]: rows for k, rows in plan.rows.items()},
            "reasons": plan.reasons,
            "compute_dtype": self.options.compute_dtype,
            "store_dtype": self.options.store_dtype,
            "retraces_after_setup": self.traces - self._traces_after_setup,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **self.telemetry,
        }


def _store_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
