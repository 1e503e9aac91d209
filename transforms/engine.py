"""The Jacobian engine: compiled per-sample Jacobians of a model, built once per worker.

Pure TensorFlow, no Beam. The engine chooses how to differentiate (``transforms.strategies``),
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
from transforms.spec import EngineOptions
from transforms.strategies import MODES, ForwardModeUnsupported, build_block

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
    scale = max(float(np.max(np.abs(expected))), np.finfo(np.float32).tiny)
    return float(np.max(np.abs(actual.astype(np.float64) - expected))) / scale


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
        self._activations = _activation_size(self.model, self.input_shapes, self._dtype)
        self._plan = self._choose()
        self.telemetry["setup_seconds"] = round(time.perf_counter() - began, 3)
        self._traces_after_setup = self.traces
        log.info("engine ready: %s", self.describe())

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

    def _extent(self, mode: str, k: int) -> int:
        return self._size(k) if mode == "forward" else self._outputs

    def _sizing(self, mode: str) -> tuple[int, dict[int, int], list[str]]:
        """Batch and block sizes that keep one block's working set within the memory budget.

        Estimated working set in bytes, per sample: the batch's finished Jacobians (``m * d``) plus,
        for a block of ``c`` rows, ``c`` copies of the per-sample intermediates (``a``) and of the
        differentiated input (reverse: cotangents) or of input and output (forward: tangents).
        """
        item = np.dtype(self.options.compute_dtype).itemsize
        budget, m = self.options.memory_budget, self._outputs
        result = sum(m * self._size(k) for k in self._wrt) * item
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

    def _block(self, mode: str, jit: bool, k: int, rows: int):
        key = (mode, jit, k, rows)
        if key not in self._blocks:
            self._blocks[key] = build_block(
                mode, self.model.call, self.input_shapes, k, rows, self._extent(mode, k), self._dtype, jit
            )
        return self._blocks[key]

    def _try(self, mode: str, jit: bool, timed: bool) -> tuple[dict[str, np.ndarray], float]:
        """Trace and run a path on the probe batch: its results, and (``timed``) the best of two
        runs on one full batch."""
        batch, rows, _ = self._sizing(mode)
        plan = _Plan(mode, jit, batch, rows)
        with _capture_pfor_fallbacks() as fallbacks:
            result = self._compute([x[:batch] for x in self._probe], plan)
        for op in fallbacks.ops:
            if op not in self.telemetry["pfor_fallbacks"]:
                log.warning("pfor could not vectorise %s: it runs in a while_loop (slow)", op)
                self.telemetry["pfor_fallbacks"].append(op)
        if not timed:
            return result, 0.0
        full = self._make_probe(batch)
        timings = []
        for _ in range(2):
            began = time.perf_counter()
            self._compute(full, plan)
            timings.append(time.perf_counter() - began)
        return result, min(timings) / batch

    def _candidates(self) -> tuple[list[str], str]:
        mode = self.options.mode
        if mode in MODES:
            return [mode], f"mode {mode} (configured)"
        inputs = sum(self._size(k) for k in self._wrt)
        by_size = "forward" if inputs < self._outputs else "reverse"
        reason = f"{inputs} input entries vs {self._outputs} outputs"
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
            raise ModelError(f"{self.model.source}: no way to compute Jacobians worked: {self.telemetry['candidates']}")
        return plan

    def _first_good(self, modes: list[str], notes: list[str]) -> _Plan | None:
        """Try each (mode, XLA) path; keep the best that works and agrees with the reference.

        The plain graph of the first mode runs first and is the reference every other path must
        agree with (a fast path can be wrong: forward mode through max-pooling under XLA is). Best
        is the fastest per sample under ``autotune``, else the first mode, XLA before plain graph.
        """
        jit_options = {True: [True], False: [False], "auto": [False, True]}[self.options.jit_compile]
        autotune = self.options.mode == "autotune"
        reference: dict[str, np.ndarray] | None = None
        tried = self.telemetry.setdefault("candidates", [])
        best: tuple[tuple, str, bool] | None = None
        for mode in modes:
            for jit in jit_options:
                label = f"{mode}{' + XLA' if jit else ''}"
                try:
                    result, seconds = self._try(mode, jit, timed=autotune)
                except ForwardModeUnsupported as err:
                    if self.options.mode == "forward":
                        raise ModelError(f"{self.model.source}: {err}") from err
                    notes.append(f"forward: {err}")
                    tried.append({"path": label, "error": "an op has no forward-mode rule"})
                    break
                except (tf.errors.OpError, ValueError, TypeError, NotImplementedError) as err:
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
                if autotune:
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
                rank = (seconds,) if autotune else (modes.index(mode), not jit)
                if best is None or rank < best[0]:
                    best = (rank, mode, jit)
        if best is None:
            return None
        _, mode, jit = best
        batch, rows, sizing = self._sizing(mode)
        return _Plan(mode, jit, batch, rows, [*notes, *sizing])

    # -- computing ----------------------------------------------------------------------------

    def _compute(self, xs: Sequence[np.ndarray], plan: _Plan) -> dict[str, np.ndarray]:
        """Jacobians of ``xs`` in compute dtype, block by block; halves blocks on out-of-memory."""
        n, m = len(xs[0]), self._outputs
        jacobians = {k: np.empty((n, m, self._size(k)), self.options.compute_dtype) for k in self._wrt}
        output = np.empty((n, m), self.options.compute_dtype)
        for lo in range(0, n, plan.batch):
            hi = min(lo + plan.batch, n)
            batch = [tf.constant(x[lo:hi]) for x in xs]
            if plan.jit and hi - lo < plan.batch:  # XLA compiles per shape: pad, never recompile
                pad = plan.batch - (hi - lo)
                batch = [tf.pad(x, [(0, pad)] + [(0, 0)] * (x.shape.rank - 1)) for x in batch]
            for k in self._wrt:
                start = 0
                extent = self._extent(plan.mode, k)
                while start < extent:
                    rows = plan.rows[k]
                    first = min(start, extent - rows)  # keep every block full-size: no retrace
                    try:
                        y, block = self._block(plan.mode, plan.jit, k, rows)(batch, first)
                    except tf.errors.ResourceExhaustedError:
                        self._shrink(plan, k)
                        continue
                    block = block.numpy()[: hi - lo]
                    if plan.mode == "forward":
                        jacobians[k][lo:hi, :, first : first + rows] = block
                    else:
                        jacobians[k][lo:hi, first : first + rows] = block
                    output[lo:hi] = y.numpy()[: hi - lo]
                    start = first + rows
        return {"output": output, **{self._name(k): jac for k, jac in jacobians.items()}}

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

    def __call__(self, x: np.ndarray | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        xs = [x[name] for name in self.input_names] if isinstance(x, Mapping) else [x]
        xs = [np.asarray(part, self.options.compute_dtype) for part in xs]
        result = self._compute(xs, self._plan)
        n = len(xs[0])
        store = _store_dtype(self.options.store_dtype)
        shaped = {"output": result.pop("output").reshape((n, *self.output_shape)).astype(store, copy=False)}
        for k in self._wrt:
            name = self._name(k)
            shaped[name] = result[name].reshape((n, *self.output_shape, *self.input_shapes[k])).astype(store, copy=False)
        return shaped

    # -- reporting ----------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Samples per call that keep the working set within the memory budget."""
        return self._plan.batch

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.input_shapes[0]

    @property
    def traces(self) -> int:
        return sum(fn.experimental_get_tracing_count() for fn in self._blocks.values())

    def describe(self) -> dict[str, Any]:
        """What runs and why: for logs, Beam metrics and the manifest."""
        plan = self._plan
        return {
            "mode": plan.mode,
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
