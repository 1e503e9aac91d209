"""Computing Jacobians in Beam: batches of samples in, batches of Jacobian records out.

Each worker process loads the model and builds the compiled Jacobian function once (``setup()``, shared
between DoFn instances of the process through ``apache_beam.utils.shared``). ``ComputeJacobians`` takes
``SampleBatch`` elements (as ``ReadSamples`` makes them) or single samples of a user's pipeline, which it
batches first.

The engine comes from an ``EngineFactory``: ``build_engine`` (TensorFlow's ``JacobianEngine``) unless a
test passes another (``transforms.testing.fake_engine``: a closed-form engine in numpy, as Beam's own
tests run ``RunInference`` with a ``FakeModelHandler``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.typehints.decorators import no_annotations
from apache_beam.utils import shared

from jacobeam.transforms import aggregates
from jacobeam.transforms.elements import JacobianBatch, SampleBatch, stack_samples, take
from jacobeam.transforms.engine.threads import configure_tf_threads
from jacobeam.transforms.errors import ModelError, span
from jacobeam.transforms.metrics import ComputeMetrics
from jacobeam.transforms.output import storage
from jacobeam.transforms.self_check import checker_for, chosen_ids
from jacobeam.transforms.spec import EngineOptions, ModelSource, SelfCheck, ShardRange
from jacobeam.transforms.testing import faults

log = logging.getLogger(__name__)

# Engines built in this process, per compute step of a pipeline (``ComputeJacobiansFn._run``, made when
# the pipeline is built): lets tests (and the manifest) show that setup work happens once per worker
# process and run, not per bundle or element, also in a worker process that outlives a run (Dask's).
_engine_builds: collections.Counter[str] = collections.Counter()
_builds_lock = threading.Lock()

# ``(model, input_shape, options, tf_threads) -> engine``: what ``ComputeJacobiansFn`` builds its engine
# with. Beam pickles it with the DoFn: a module-level function or an instance of a module-level class.
# The engine needs what ``ComputeJacobiansFn`` uses of ``JacobianEngine``: ``compute``, ``batch_size``,
# ``describe()``, ``fingerprint`` (and, for the self-check, what ``transforms.self_check`` uses).
EngineFactory = Callable[[ModelSource, Any, EngineOptions, "int | None"], Any]


def build_engine(
    model: ModelSource, input_shape, options: EngineOptions, tf_threads: int | None = None, plan_cache: str | None = None
):
    """Load the model and build, trace and warm up the Jacobian function (once per process).

    ``plan_cache``: a file (``layout.ENGINE_PLAN`` in the output folder) of an earlier engine's set-up
    decisions: reused where they were made for this model, options, TensorFlow and device, else (and
    when unreadable) ignored; written after a set-up that probed, once its plan is trusted (a path
    checked against the reference on the first real batch: after that batch agreed)."""
    from jacobeam.transforms.engine import JacobianEngine

    configure_tf_threads(tf_threads)
    if options.parameters is not None:  # per-sample gradients of the weights: no plan to probe or cache
        from jacobeam.transforms.engine.parameters import ParameterEngine

        return ParameterEngine(model.load(), input_shape, options)
    engine = JacobianEngine(model.load(), input_shape, options, decisions=_read_plan_cache(plan_cache))
    if plan_cache is not None and engine.telemetry.get("plan_cache") == "probed" and engine.decisions is not None:
        engine.when_trusted(lambda: _write_plan_cache(plan_cache, engine.decisions))
    return engine


def _read_plan_cache(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        if not storage.exists(path):
            return None
        decisions = json.loads(storage.read_text(path))
    except (OSError, ValueError) as err:  # only a cache: a run never fails on it
        log.debug("%s: unreadable, ignored (%s)", path, err)
        return None
    if not isinstance(decisions, dict):
        log.debug("%s: not set-up decisions, ignored", path)
        return None
    return decisions


def _write_plan_cache(path: str, decisions: dict) -> None:
    text = json.dumps(decisions, indent=1, default=str) + "\n"
    try:
        storage.write_atomically(path, lambda temp: temp.write_text(text))
    except OSError as err:  # only a cache: the next run probes again
        log.warning("%s: set-up decisions not written: %s", path, err)


# Engines being built in this process now: a token for each, with the time.monotonic() its build began.
_building: dict[int, float] = {}


def engine_setup() -> tuple[float | None, int]:
    """When the oldest engine build under way in this process began (``time.monotonic()``; None: none is),
    and how many engines this process has built: what a progress display in the same process (the
    in-process runners) shows while the engine sets up."""
    with _builds_lock:
        return min(_building.values(), default=None), sum(_engine_builds.values())


def _built(
    run: str, factory: EngineFactory, model: ModelSource, input_shape, options: EngineOptions, tf_threads: int | None,
    plan_cache: str | None = None,
):
    """``factory``'s engine, counted in ``_engine_builds[run]``; ``build_engine`` with ``plan_cache``."""
    token = object()
    with _builds_lock:
        _building[id(token)] = time.monotonic()
    try:
        if factory is build_engine:
            engine = build_engine(model, input_shape, options, tf_threads, plan_cache=plan_cache)
        else:
            engine = factory(model, input_shape, options, tf_threads)
    finally:
        with _builds_lock:
            del _building[id(token)]
    with _builds_lock:
        _engine_builds[run] += 1
    return engine


@beam.typehints.with_input_types(SampleBatch)
@beam.typehints.with_output_types(JacobianBatch)
class ComputeJacobiansFn(beam.DoFn):
    """``SampleBatch -> JacobianBatch...``: one output batch per engine call (the engine may take fewer
    samples at a time than a batch holds, to keep within its memory budget).

    With ``self_check``, the samples of a batch's shard that ``self_check.chosen_ids`` picks are
    recomputed one at a time when their batch is computed (``transforms.self_check``), or, in a subclass
    that writes the shard itself (``holds_checks``) while the worker's references are still being built,
    with a later batch of the shard or from ``held_checks`` before it is committed (always from
    ``held_checks``, together, where the checker ``checks_together``); the records go
    with the batch (``JacobianBatch.checks``) to the shard writer, which stores them and acts on a
    mismatch. Batches without a shard (a user's pipeline) are not checked.

    ``engine_factory`` builds the engine (default ``build_engine``; see ``EngineFactory``). Whatever it
    builds is shared by the DoFn instances of a process with the same model, shapes, options and factory.
    ``plan_cache`` is ``build_engine``'s (a planned job's ``ENGINE_PLAN`` file; other factories ignore it).
    """

    holds_checks = False  # whether the caller takes held_checks before it commits a shard

    def __init__(
        self, model: ModelSource, input_shape, options: EngineOptions, tf_threads: int | None = None,
        self_check: SelfCheck | None = None, engine_factory: EngineFactory | None = None, plan_cache: str | None = None,
    ):
        self._model, self._input_shape, self._options, self._tf_threads = model, input_shape, options, tf_threads
        self._plan_cache = plan_cache
        self._self_check = self_check if self_check is not None and self_check.samples > 0 else None
        self._engine_factory = build_engine if engine_factory is None else engine_factory
        # Beam's Shared keeps the last engine acquired in a process alive between bundles (a runner that
        # sets up a DoFn per bundle, as Dask's does per partition, then still builds it once).
        self._shared = shared.Shared()
        self._shared_checker = shared.Shared()
        self._run = uuid.uuid4().hex  # this compute step of this pipeline, in every worker's copy
        self._metrics = ComputeMetrics()

    def setup(self) -> None:
        faults.reached("setup")
        key = repr((self._model, self._input_shape, self._options))
        if self._engine_factory is not build_engine:  # never shared with the real engine of the same model
            key = f"{key} {self._engine_factory!r}"
        factory = self._engine_factory
        self._engine = self._shared.acquire(
            lambda: _built(
                self._run, factory, self._model, self._input_shape, self._options, self._tf_threads, self._plan_cache
            ),
            tag=key,
        )
        self._checker, self._chosen, self._waiting = None, {}, {}
        if self._self_check is not None:  # its references are built beside the first batches
            self._checker = self._shared_checker.acquire(
                lambda: checker_for(self._engine, self._self_check), tag=f"{key} {self._self_check!r}"
            )
            self._checker.prepare()

    @no_annotations
    def process(self, batch: SampleBatch) -> Iterator[JacobianBatch]:
        engine, kinds = self._engine, self._options.aggregate
        for lo in range(0, len(batch), engine.batch_size):
            part = take(batch, lo, min(lo + engine.batch_size, len(batch)))
            tick = time.perf_counter()
            try:
                datasets, full = engine.compute(part.inputs, part.labels)
            except ModelError as err:
                raise ModelError(f"{_samples(part.ids)}: {err}") from err
            seconds = time.perf_counter() - tick
            described = engine.describe()
            self._metrics.batch_done(len(part), seconds, described)
            yield JacobianBatch(
                ids=part.ids,
                datasets=datasets,
                shard=part.shard,
                partial=None if full is None else aggregates.partial(full, kinds),
                seconds=seconds,
                engine={**described, "model_fingerprint": engine.fingerprint,
                        "model_identity": getattr(engine, "model_identity", None)},
                worker={"pid": os.getpid(), "engine_builds": _engine_builds[self._run]},
                checks=self._check(part, datasets),
                read=part.read,
            )

    def _check(self, part: SampleBatch, datasets: dict) -> list[dict] | None:
        """The self-check of the samples of ``part`` that its shard checks (see ``transforms.self_check``)."""
        if self._checker is None or part.shard is None:
            return None
        shard = part.shard
        if shard.start not in self._chosen:
            if len(self._chosen) > 64:
                self._chosen.clear()
            self._chosen[shard.start] = chosen_ids(shard, self._self_check.samples)
        rows = np.flatnonzero(np.isin(np.asarray(part.ids), self._chosen[shard.start]))
        waiting = self._waiting.pop(shard.start, []) + [self._sample(part, datasets, row) for row in rows]
        if not waiting:
            return None
        # A caller that takes what is held back before it commits the shard (holds_checks) has a checker that
        # checks samples together (checks_together: the input side's, sharing its references' calls; the
        # parameter side's projection) hold them all for held_checks, and another hold them while its
        # references are being built (prepare) for a later batch of their shard or held_checks: the engine
        # computes meanwhile instead of waiting for the thread.
        if self.holds_checks and (self._checker.checks_together or not self._checker.ready()):
            self._waiting[shard.start] = waiting
            return None
        return self._checker.check_all(waiting)

    def held_checks(self, shard: ShardRange) -> list[dict]:
        """The checks of ``shard``'s samples still held back, made now (waiting for the references if they
        are still being built); a subclass with ``holds_checks`` takes them after the shard's last batch,
        before it commits the shard (``transforms.job.ComputeShardFn``)."""
        waiting = self._waiting.pop(shard.start, [])
        if waiting:  # the preparing thread's work done first, not beside the shard's commit
            self._checker.wait_prepared()
        return self._checker.check_all(waiting) if waiting else []

    def _sample(self, part: SampleBatch, datasets: dict, row: int) -> tuple:
        """What checking sample ``row`` of ``part`` takes (``SelfChecker.check``'s arguments), copied: the
        engine may reuse its result buffers before the check runs."""
        inputs, names = part.inputs, self._engine.input_names
        xs = [np.array(inputs[name][row : row + 1]) for name in names] if isinstance(inputs, dict) else [
            np.array(inputs[row : row + 1])]
        stored = {name: np.array(values[row : row + 1]) for name, values in datasets.items()}
        label = int(part.labels[row]) if self._options.needs_labels else None
        return xs, stored, int(part.ids[row]), label


def _samples(ids) -> str:
    """A batch's sample ids (or a pipeline's own keys) in words: ``samples 8 to 15`` (``errors.span``), or
    listed where they are not consecutive integers."""
    ids = list(ids)
    if all(isinstance(i, (int, np.integer)) for i in ids) and ids == list(range(ids[0], ids[-1] + 1) if ids else []):
        return span(int(ids[0]), int(ids[-1]) + 1, "sample") if ids else "no samples"
    return "samples " + ", ".join(map(str, ids[:5])) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


@beam.typehints.with_input_types(list[Any])
@beam.typehints.with_output_types(SampleBatch)
def _stack(examples):
    """``stack_samples`` with Beam's type hints (its own annotations are strings to Beam)."""
    return stack_samples(examples)


class ComputeJacobians(beam.PTransform):
    """``PCollection[SampleBatch | sample | (key, sample)] -> PCollection[JacobianBatch]``.

    Samples are arrays ``(*input_shape)``, or dicts ``{input name: array}`` for a model with several
    inputs (``input_shape`` is then a dict of shapes), optionally keyed ``(key, sample)``: single
    samples are batched first (``beam.BatchElements``, at most ``options.batch_size``). A PCollection of
    ``SampleBatch`` elements (``batched=True``, the default where its element type says so, as
    ``ReadSamples``' does) is used as it comes, fused with its producer and consumer. Each
    ``JacobianBatch`` holds the datasets the engine makes (see ``transforms.engine.JacobianEngine``) and
    the samples' keys as ``ids``; ``| beam.FlatMap(JacobianBatch.records)`` gives one ``(key, {dataset:
    array})`` per sample. ``self_check`` (``jacobian.self_check``) recomputes chosen samples of each
    planned shard (see ``ComputeJacobiansFn``).

    Args:
        model: where the model comes from; each worker process loads it once (``engine_factory``).
        input_shape: one sample's shape ``(*input_shape)``, or ``{input name: shape}`` for a model with
            several inputs.
        options: how to compute and what to keep (``EngineOptions``); ``options.batch_size`` also caps
            the batches made of single samples.
        tf_threads: TensorFlow's intra- and inter-op threads per worker process; None keeps its default.
        batched: whether the elements are ``SampleBatch`` (``ids`` ``(n,)``, ``inputs`` ``(n,
            *input_shape)``); None decides by the input PCollection's element type.
        self_check: recompute chosen samples of each planned shard (``self_check.samples`` per 4,096 ids,
            at least one: ``transforms.self_check.checked_count``) one at a time
            and attach the records to their batch (``JacobianBatch.checks``); None or 0 samples: off.
            Needs TensorFlow and the real engine.
        engine_factory: ``(model, input_shape, options, tf_threads) -> engine``, picklable (see
            ``EngineFactory``); None is ``build_engine`` (TensorFlow's ``JacobianEngine``, shared by
            the process through ``apache_beam.utils.shared``). A test seam: ``transforms.testing.
            fake_engine.FakeEngineFactory`` computes a closed form without TensorFlow.

    Returns:
        (from ``expand``) ``PCollection[JacobianBatch]``, one element per engine call: ``ids`` ``(n,)``
        the samples' keys (``SampleBatch.ids``, or ``None`` for unkeyed samples), ``datasets`` with
        ``"output"`` ``(n, *output_shape)`` and ``"jacobian"`` ``(n, *output_shape, *input_shape)`` (or
        ``"jacobian/<input name>"`` per differentiated input; ``"output_index"`` ``(n, k)`` and a
        reduction's datasets as ``options`` ask), in ``options.store_dtype``; ``partial`` the batch's
        float64 sums for ``options.aggregate``; ``shard`` the batch's ``ShardRange``, if it had one.

    Raises:
        ModelError: in the worker, when the engine is built (the model does not take samples of
            ``input_shape``, its samples interact inside a batch, the options do not fit it) or a batch
            fails (the message names the batch's ids ``first..last``); the runner re-raises it wrapped
            in its own exception when the pipeline runs.
    """

    def __init__(
        self,
        model: ModelSource,
        input_shape: Sequence[int] | Mapping[str, Sequence[int]],
        options: EngineOptions = EngineOptions(),
        tf_threads: int | None = None,
        batched: bool | None = None,
        self_check: SelfCheck | None = None,
        engine_factory: EngineFactory | None = None,
    ):
        super().__init__()
        self._model, self._options, self._tf_threads, self._batched = model, options, tf_threads, batched
        self._self_check, self._engine_factory = self_check, engine_factory
        self._input_shape = (
            {name: tuple(shape) for name, shape in input_shape.items()}
            if isinstance(input_shape, Mapping)
            else tuple(input_shape)
        )

    def expand(self, samples):
        batched = self._batched
        if batched is None:
            batched = isinstance(samples.element_type, type) and issubclass(samples.element_type, SampleBatch)
        if not batched:
            samples = (
                samples
                | "Batch" >> beam.BatchElements(max_batch_size=self._options.batch_size)
                | "Stack" >> beam.Map(_stack)
            )
        fn = ComputeJacobiansFn(
            self._model, self._input_shape, self._options, self._tf_threads, self._self_check, self._engine_factory
        )
        return samples | "Compute" >> beam.ParDo(fn).with_output_types(JacobianBatch)
