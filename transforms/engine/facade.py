"""``JacobianEngine``: compiled per-sample Jacobians of a model, built once per worker.

Separation of concerns (the seams of JAX's and functorch's ``jacrev``/``jacfwd``):

- ``blocks``: one block's compiled function for each way to differentiate;
- ``operands``: what a block differentiates (output selection, vectors, projections, bases);
- ``budget``: sizing sub-batches and blocks against the memory budget (arithmetic only);
- ``planner``: choosing and checking a path, as an immutable ``Plan``;
- ``executor``: running one call with the plan's sizes, fixed for the call;
- ``assembly``: turning products into the datasets stored;
- this facade: set-up, re-planning smaller on out-of-memory, and checking the plan on the first real batch.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobeam.transforms import model_identity
from jacobeam.transforms.engine import budget, layer_rules, model_checks, reverse_layer_rules
from jacobeam.transforms.engine import decisions as setup_decisions
from jacobeam.transforms.engine.assembly import DatasetAssembly
from jacobeam.transforms.engine.blocks import BlockCache
from jacobeam.transforms.engine.diagnostics import AGREEMENT, activation_size
from jacobeam.transforms.engine.executor import Plan, execute, join
from jacobeam.transforms.engine.models import LoadedModel
from jacobeam.transforms.engine.operands import Operands, build_operands
from jacobeam.transforms.engine.planner import Planner, disagreement
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import EngineOptions

log = logging.getLogger(__name__)

_PROBE_SEED = 0
_PROBE_SAMPLES = 8  # samples a path is checked on during set-up


class JacobianEngine(DatasetAssembly):
    """Per-sample Jacobians ``d output_i / d input_i`` for whole batches.

    Args:
        model: the loaded model (``transforms.engine.models.load`` or ``wrap_model``).
        input_shapes: one sample's shape, or ``{input name: shape}`` for a model with several inputs.
        options: how to compute and what to keep (``EngineOptions``).
        wrap_block: a test seam: applied to every compiled block function the engine builds (to inject
            out-of-memory errors, say); None in production.
        decisions: an earlier engine's ``decisions``: taken instead of probing where they were made for
            the same model, options, TensorFlow and device (``transforms.engine.decisions``), else
            ignored. The model's checks (it takes the samples, they do not interact) run either way.

    Raises:
        ModelError: the model does not take these samples, its samples interact inside a batch, the
            output selection, reduction or aggregate does not fit it, or no way to differentiate it
            works; and from ``compute``, where the chosen path disagrees with the reference on the first real batch.

    ``engine(x)`` with ``x`` of shape ``(n, *input_shape)`` (or a mapping input name -> array) returns
    numpy arrays in ``store_dtype``:

    - ``"jacobian"``: ``(n, *output_shape, *input_shape)`` for a one-input model, or
      ``"jacobian/<input name>"`` per differentiated input of a several-input model;
    - ``"output"``: ``(n, *output_shape)``, the model's outputs;
    - with ``outputs`` other than ``all``, ``"output_index"`` ``(n, k)``; with a ``reduce``, its datasets.

    Any ``n`` works; ``batch_size`` is the number of samples a caller should pass at a time (the
    configured batch size, or fewer where one sample's Jacobian is large for the memory budget).
    """

    def __init__(
        self,
        model: LoadedModel,
        input_shapes: Sequence[int] | Mapping[str, Sequence[int]],
        options: EngineOptions,
        wrap_block: Callable[[Callable], Callable] | None = None,
        decisions: Mapping[str, Any] | None = None,
    ):
        began = time.perf_counter()
        self.options = options
        self.fingerprint = model.fingerprint()
        # The digest of the model's identity (transforms.model_identity): a worker's shards are written
        # only for the model the run was planned with.
        self.model_identity = model_identity.digest(model.identity) if model.identity else None
        self.model = model.with_dtype(options.compute_dtype)
        source = self.model.source
        self.input_names, self.input_shapes = model_checks.resolve_inputs(self.model, input_shapes)
        self.wrt = model_checks.resolve_wrt(self.input_names, options.wrt, source)  # positions of the differentiated inputs
        self.telemetry: dict[str, Any] = {"pfor_fallbacks": [], "oom_retries": 0}
        dtype = tf.as_dtype(options.compute_dtype)
        self._blocks = BlockCache(self.model.call, self.input_shapes, dtype, wrap_block, self.model.keras_model)
        # The model's outputs without derivatives (set-up checks, argmax/top_k selections): compiled once,
        # as an eager call of a large Keras model costs more than its differentiated pass.
        self._specs = [tf.TensorSpec((None, *shape), dtype) for shape in self.input_shapes]
        self._compiled_forward = tf.function(
            lambda xs: self.model.call(list(xs)), input_signature=[self._specs], autograph=False
        )
        self._key = setup_decisions.key(model, self.fingerprint, self.input_shapes, options)
        # Checked even where decisions are reused: their key names the model's structure and weights, not
        # its code (a custom layer's call may have come to couple the samples since).
        self.output_shape = model_checks.output_shape(
            # Two samples decide whether samples interact inside a batch (one against two).
            self._forward, self._probe(2), source, self.input_shapes,
            options.check_batch_independence, options.compute_dtype,
        )
        # The first real batch's check (``_check_first_batch``): the reference path a probed plan agreed
        # with, until that batch agreed too; the message of its refusal; what waits for it (``when_trusted``).
        self._reference: Plan | None = None
        self._refused: str | None = None
        self._when_trusted: list[Callable[[], None]] = []
        self._first_batch = threading.Lock()
        if not self._reuse(decisions):
            self.operands: Operands = build_operands(options, self.output_shape, self.input_shapes, self.input_names, source)
            self._activations = activation_size(self._compiled_forward.get_concrete_function(self._specs).graph)
            planner = Planner(
                options, self.operands, self.wrt, source, self._size, self._run, self._forward, self._probe,
                _PROBE_SAMPLES, self.telemetry, layer_rules.unsupported(self.model.keras_model) is None,
                reverse_layer_rules=reverse_layer_rules.reverse_unsupported(self.model.keras_model) is None,
            )
            self._plan, self._reference = planner.choose(), planner.reference
            self.telemetry["plan_cache"] = "probed"
        self.telemetry["setup_seconds"] = round(time.perf_counter() - began, 3)
        self._traces_after_setup = self.traces
        plan = self._plan
        log.info(
            "engine ready for %s: %s, batch %d, blocks %s (%s)", source, plan.path.label, plan.sizes.batch,
            self._block_rows(plan), "; ".join(plan.reasons),
        )

    # -- set-up helpers -----------------------------------------------------------------------

    def _reuse(self, decisions: Mapping[str, Any] | None) -> bool:
        """Take an earlier engine's set-up decisions (``self.decisions``) if their key is this engine's:
        no probe or timing runs (their outcomes are decided by what the key holds; the model's checks
        ran before), and the plan's blocks are traced here as set-up would. A reused plan was checked on
        the first real batch of the run that cached it (``when_trusted``): not again. False (and a debug
        log) where they do not apply."""
        if decisions is None or self._key is None:
            return False
        source = self.model.source
        try:
            if decisions["key"] != self._key:
                changed = sorted(k for k in self._key if decisions["key"].get(k) != self._key[k])
                log.debug("%s: set-up decisions of another %s: probing", source, ", ".join(changed) or "key")
                return False
            plan = setup_decisions.decode_plan(decisions)
            if tuple(int(d) for d in decisions["output_shape"]) != self.output_shape:
                log.debug("%s: set-up decisions for outputs of another shape: probing", source)
                return False
            operands = build_operands(self.options, self.output_shape, self.input_shapes, self.input_names, source)
            if decisions["operands"] != setup_decisions.operands_digest(operands):
                log.debug("%s: set-up decisions for other operand matrices: probing", source)
                return False
            if sorted(k for k, _ in plan.sizes.rows) != sorted(self.wrt):
                raise ValueError(f"block rows for inputs {plan.sizes.rows}, differentiating {self.wrt}")
            activations = int(decisions["activations"])
            candidates, fallbacks = list(decisions["candidates"]), [str(op) for op in decisions["pfor_fallbacks"]]
        except (KeyError, TypeError, ValueError, AttributeError, ModelError) as err:
            log.debug("%s: unusable set-up decisions (%s: %s): probing", source, type(err).__name__, err)
            return False
        self.operands, self._activations, self._plan = operands, activations, plan
        mode = plan.path.mode
        for k, rows in plan.sizes.rows:
            self._blocks.trace(plan.path, k, rows, operands.extent(mode, k), operands.kind(mode))
        self.telemetry.update(candidates=candidates, pfor_fallbacks=fallbacks, plan_cache="reused")
        log.info("%s: set-up decisions reused (no probing): %s", source, plan.path.label)
        return True

    @property
    def decisions(self) -> dict[str, Any] | None:
        """This engine's set-up decisions as JSON-able data, for a later engine's ``decisions`` (None
        for a model without a key: see ``transforms.engine.decisions``)."""
        if self._key is None:
            return None
        return setup_decisions.encode(self._key, self.output_shape, self._activations, self.operands, self._plan, self.telemetry)

    def _probe(self, n: int) -> list[np.ndarray]:
        """Seeded standard-normal samples: used to check, compare and time paths during set-up."""
        rng = np.random.default_rng(_PROBE_SEED)
        return [rng.standard_normal((n, *shape)).astype(self.options.compute_dtype) for shape in self.input_shapes]

    def _forward(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.asarray(self._compiled_forward([tf.constant(x) for x in xs]))

    def _size(self, mode: str) -> budget.Sizes:
        operands = self.operands
        return budget.size_blocks(budget.Workload(
            batch_size=self.options.batch_size,
            budget=self.options.memory_budget,
            itemsize=np.dtype(self.options.compute_dtype).itemsize,
            outputs=operands.outputs,
            activations=self._activations,
            sizes={k: operands.sizes[k] for k in self.wrt},
            extents={k: operands.extent(mode, k) for k in self.wrt},
            forward=mode == "forward",
            names=self.input_names,
        ))

    # -- computing ----------------------------------------------------------------------------

    def _run(self, plan: Plan, xs: Sequence[np.ndarray], index: np.ndarray | None) -> tuple[Plan, dict]:
        """``L J R`` of every sample of ``xs`` (see ``executor.execute``) and the plan that computed them.

        Out of memory, the samples not yet complete are computed again with smaller sizes (``budget.
        smaller``), which later calls keep; at one sample and one row it is an error.
        """
        pieces: list = []
        tried = [plan.sizes]
        while True:
            done = pieces[-1][1] if pieces else 0
            try:
                for piece in execute(plan, self._blocks, self.operands, xs, index, start=done):
                    pieces.append(piece)  # complete sub-batches are kept through an out-of-memory retry
                return plan, join(pieces, len(xs[0]))
            except tf.errors.ResourceExhaustedError as err:
                sizes = budget.smaller(plan.sizes)
                if sizes is None:
                    tried_text = ", ".join(f"{s.batch} x {self._block_rows(s)}" for s in tried)
                    raise ModelError(
                        f"{self.model.source}: out of memory even for one sample and one row per block "
                        f"(samples x rows per block tried: {tried_text}; memory_budget "
                        f"{self.options.memory_budget:,} bytes): {str(err).strip().splitlines()[0][:200]}"
                    ) from err
                tried.append(sizes)
                self.telemetry["oom_retries"] += 1
                note = f"out of memory: retrying with batch {sizes.batch}, blocks of {self._block_rows(sizes)}"
                log.warning("%s: %s", self.model.source, note)
                plan = dataclasses.replace(plan, sizes=sizes, reasons=(*plan.reasons, note))

    def compute(
        self, x: np.ndarray | Mapping[str, np.ndarray], labels: np.ndarray | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """The datasets to store for a batch, and (where the full Jacobian was computed and
        ``aggregate`` asks for it) the Jacobians ``(n, rows, d)`` in store dtype to aggregate.

        Args:
            x: ``(n, *input_shape)``, or ``{input name: (n, *shape)}``.
            labels: ``(n,)`` each sample's target output, for ``outputs: label``.

        Returns:
            ``(datasets, full)``; arrays may be read-only (views of TensorFlow's result buffers).
        """
        if self._refused is not None:
            raise ModelError(self._refused)
        xs = [x[name] for name in self.input_names] if isinstance(x, Mapping) else [x]
        xs = [np.asarray(part, self.options.compute_dtype) for part in xs]
        # A selection by label or fixed indices needs no outputs: no forward pass before the differentiated one.
        y = self._forward(xs) if self.operands.selects_by_output else None
        index = self.operands.select(len(xs[0]), y, labels)
        self._plan, raw = self._run(self._plan, xs, index)
        if self._reference is not None:
            self._check_first_batch(xs, index, raw)
        return self.assemble(raw["output"], {k: raw[k] for k in self.wrt}, index)

    def _check_first_batch(self, xs: Sequence[np.ndarray], index: np.ndarray | None, raw: dict) -> None:
        """Once per engine, on the first real batch (``xs``, computed as ``raw``) of a probed plan whose path
        is not its reference: the reference path (its blocks traced at set-up, or the eager accumulator)
        runs on up to ``_PROBE_SAMPLES`` of the batch's samples, and each is judged against what the chosen
        path gave it, as on the probe (``planner.disagreement``). The seeded probe may miss what real
        data reaches (a saturated unit, a range of inputs the probe's normal samples do not).

        On disagreement the engine refuses: a ``ModelError`` now and from every later call, and nothing
        waiting in ``when_trusted`` runs (the decisions are not cached). Refusing is simpler to make
        correct than re-planning with the reference: the reference is not always a path a run may take
        (forward mode's eager accumulator; the plain graph under ``jit_compile: true``), and a plan
        changed after set-up would be re-sized, traced and cached anew. Samples whose reference is not
        finite everywhere are not judged: their derivatives are undefined, and paths put NaN in
        different places there. Calls from several threads wait for the one that checks."""
        with self._first_batch:
            if self._refused is not None:
                raise ModelError(self._refused)
            reference = self._reference
            if reference is None:
                return  # checked by another thread meanwhile
            n = min(len(xs[0]), _PROBE_SAMPLES)
            _, expected = self._run(reference, [x[:n] for x in xs], None if index is None else index[:n])
            judged = [i for i in range(n) if all(np.isfinite(value[i]).all() for value in expected.values())]
            chosen = {k: raw[k][judged] for k in expected}
            error = disagreement(chosen, {k: value[judged] for k, value in expected.items()}) if judged else 0.0
            tolerance = AGREEMENT[self.options.compute_dtype]
            self.telemetry["first_batch_check"] = {
                "reference": reference.path.label, "samples": len(judged), "relative_error": error,
            }
            if not error <= tolerance:
                path = self._plan.path
                self._refused = (
                    f"{self.model.source}: {path.label} disagrees with the reference path {reference.path.label} on "
                    f"the first batch's samples (per-sample relative error {error:.2g} > {tolerance:g}), though it agreed "
                    f"on the probe batch: refused ({_avoiding(path, reference.path)} avoids this path)"
                )
                raise ModelError(self._refused)
            self._reference = None
            waiting, self._when_trusted = self._when_trusted, []
        for callback in waiting:
            callback()

    def when_trusted(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once nothing is left to check of the plan: now, or once the first real batch
        agreed with the reference (``_check_first_batch``), or never where it did not. What caches the
        set-up decisions waits for this (``transforms.compute.build_engine``), so that a later run does
        not reuse a plan refused on real data."""
        with self._first_batch:
            if self._refused is not None:
                return
            if self._reference is not None:
                self._when_trusted.append(callback)
                return
        callback()

    def __call__(self, x: np.ndarray | Mapping[str, np.ndarray], labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The datasets to store for a batch (see the class docstring)."""
        return self.compute(x, labels)[0]

    # -- reporting ----------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Samples per call that keep the working set within the memory budget."""
        return self._plan.sizes.batch

    @property
    def traces(self) -> int:
        return self._blocks.traces

    def _block_rows(self, plan_or_sizes: Plan | budget.Sizes) -> dict[str, int]:
        sizes = plan_or_sizes.sizes if isinstance(plan_or_sizes, Plan) else plan_or_sizes
        return {self.input_names[k]: rows for k, rows in sizes.rows}

    @property
    def activations(self) -> int:
        """Elements per sample of every intermediate tensor of the model's forward pass."""
        return self._activations

    def describe(self) -> dict[str, Any]:
        """What runs and why: for logs, Beam metrics and the manifest."""
        plan = self._plan
        return {
            "mode": plan.path.mode,
            "double_reverse": plan.path.double_reverse,  # forward mode's blocks by double reverse
            "layer_rules": plan.path.layer_rules,  # blocks by layer rules (layer_rules.py)
            "jit_compile": plan.path.jit,
            "requested": {"mode": self.options.mode, "jit_compile": self.options.jit_compile},
            "batch_size": plan.sizes.batch,
            "block_rows": self._block_rows(plan),
            "reasons": list(plan.reasons),
            "compute_dtype": self.options.compute_dtype,
            "store_dtype": self.options.store_dtype,
            "retraces_after_setup": self.traces - self._traces_after_setup,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **self.telemetry,
        }


def _avoiding(path, reference) -> str:
    """The configuration that keeps the planner off ``path`` (refused against ``reference``)."""
    if path.jit and not reference.jit:
        return "jit_compile: false"
    if path.mode != reference.mode:
        return f"mode: {reference.mode}"
    return "mode: reverse_loop" if path.mode == "reverse" else "mode: reverse"
