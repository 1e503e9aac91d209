"""Writing Jacobian records: batches in, complete HDF5 shards, ``manifest.json`` and ``jacobians.h5`` out.

A planned job's batches (``ReadSamples`` -> ``ComputeJacobians``) know their shard: the writer streams
them into the shard's temporary file as they come, in the same fused step, and commits the shard
when its last row is written (checksum, flush, rename: on the writer's thread, while the next shard
computes); nothing is grouped or held in memory. Beam never splits the
outputs of one element's processing across bundles, so a shard's batches, which all come from one
range element, arrive in one bundle.

Batches of a user's pipeline carry their own integer ids and no shard: ``WriteShards`` groups them by
``id // samples_per_shard`` first (a ``GroupByKey``, which holds one shard's records at a time), then
writes the same way.

Processing is idempotent: a failed attempt's temporary file is removed (or, if the process died, never
counts and is removed by the next run), and only the rename makes a shard count, so a retried bundle
leaves neither a half shard nor a duplicate.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.pvalue import TaggedOutput
from apache_beam.typehints.decorators import no_annotations
from apache_beam.utils.windowed_value import WindowedValue

from jacobeam.transforms import aggregates, self_check
from jacobeam.transforms.aggregates import Aggregate
from jacobeam.transforms.elements import JacobianBatch
from jacobeam.transforms.errors import OutputError, SelfCheckError
from jacobeam.transforms.finalize import Finalize
from jacobeam.transforms.inputs.readers import shape_from_record, shape_record
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.metrics import ShardMetrics
from jacobeam.transforms.output.layout import PIPELINE_INPUT, SAMPLE_ID, SELF_CHECK, shard_file
from jacobeam.transforms.output.shards import ShardRecord, ShardWriter, existing_record, read_attrs, shard_path
from jacobeam.transforms.spec import EngineOptions, JobSpec, ModelSource, SelfCheck, ShardRange, shard_inputs, version

log = logging.getLogger(__name__)
AGGREGATES = "aggregates"  # the writer's output of per-shard partial sums


@dataclasses.dataclass
class _OpenShard:
    writer: ShardWriter
    files: contextlib.ExitStack
    began: float  # perf_counter when the shard's first batch began computing
    engine: dict[str, Any]  # what the engine ran, as the first batch reports it
    worker: dict[str, int]
    sums: aggregates.Partial | None = None
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the self-check's records


@dataclasses.dataclass
class _Committing:
    shard: ShardRange
    state: _OpenShard
    checksum: concurrent.futures.Future[str]
    element: WindowedValue  # the batch that completed the shard: its record goes to the same window


# Beam's type hints are declared (with_input_types/with_output_types); it cannot resolve this module's
# annotations (strings: ``from __future__ import annotations``), so ``no_annotations`` keeps them for readers.
@beam.typehints.with_input_types(JacobianBatch)
@beam.typehints.with_output_types(ShardRecord)
class WriteShardFn(beam.DoFn):
    """``JacobianBatch -> ShardRecord`` once the batch's shard has all its rows and is committed; the
    shard's partial sums ``(shard position, Partial)`` to ``aggregates``.

    A complete shard's commit (checksum, flush to disk, rename) runs on its writer's thread while the
    next shard computes; its record follows at a later batch or at the end of the bundle, in the window
    of the batch that completed the shard. At most one commit is in flight: the next waits for it.
    """

    def __init__(self, spec: JobSpec):
        self._spec = spec
        self._metrics = ShardMetrics()

    def setup(self) -> None:
        self._positions = self._spec.shard_positions()
        self._open: dict[int, _OpenShard] = {}
        self._committing: list[_Committing] = []

    def start_bundle(self) -> None:
        self._abort()  # what a failed bundle left open in this instance, before Beam retries it

    @no_annotations
    def process(self, batch: JacobianBatch, element=beam.DoFn.WindowedValueParam) -> Iterator[WindowedValue | TaggedOutput]:
        shard = batch.shard
        if shard is None:
            raise OutputError("WriteShards: a batch without its shard; ids must be grouped into shards first")
        try:
            state = self._open.get(shard.start) or self._begin(batch)
            self._take_checks(state, shard, batch.checks or [])
            state.writer.write(int(batch.ids[0]), {**batch.datasets, SAMPLE_ID: batch.ids})
            state.sums = aggregates.add(state.sums, batch.partial)
            if state.writer.rows_written == shard.rows:
                yield from self._committed(wait=True)
                if state.sums is not None:
                    state.writer.attach(aggregates.PARTIALS, state.sums)
                if state.checks:
                    state.writer.set_attrs({SELF_CHECK: json.dumps(self._check_record(state.checks, timing=False))})
                self._committing.append(_Committing(shard, state, state.writer.commit_later(), element))
                del self._open[shard.start]
            else:
                yield from self._committed(wait=False)
        except BaseException:
            self._abort()  # a failed bundle leaves no writer open (Beam may never tear this instance down)
            raise

    def finish_bundle(self) -> list[WindowedValue | TaggedOutput]:
        if self._open:
            names = sorted(state.writer.name for state in self._open.values())
            self._abort()
            raise OutputError(f"{', '.join(names)}: the bundle ended before every row of the shard arrived")
        return list(self._committed(wait=True))

    def teardown(self) -> None:
        self._abort()

    def _begin(self, batch: JacobianBatch) -> _OpenShard:
        spec, shard, engine = self._spec, batch.shard, batch.engine or {}
        fingerprint = engine.get("model_fingerprint")
        if spec.model_fingerprint and fingerprint != spec.model_fingerprint:
            raise OutputError(
                f"model weights changed since the run was planned (fingerprint {spec.model_fingerprint[:16]}… "
                f"then, {str(fingerprint)[:16]}… in worker {os.getpid()})"
            )
        input_shape = shape_record(spec.sample_shape)
        attrs = {
            # HDF5 attributes hold arrays, not mappings: several inputs' shapes are stored as JSON.
            "input_shape": json.dumps(input_shape) if isinstance(input_shape, dict) else input_shape,
            "output_shape": batch.datasets["output"].shape[1:],
            "dtype": spec.engine.store_dtype,
            "model_fingerprint": fingerprint or "",
            "run_key": spec.run_key,
            "jacobeam_version": version(),
            "run_identity": json.dumps(spec.identity, sort_keys=True),
            "inputs": json.dumps(shard_inputs(spec.files, shard.start, shard.stop)),
        }
        files = contextlib.ExitStack()
        writer = files.enter_context(
            ShardWriter(spec.output_dir, shard.start, shard.stop, attrs, spec.compression, rows=shard.rows)
        )
        began = time.perf_counter() - batch.seconds
        state = self._open[shard.start] = _OpenShard(writer, files, began, engine, batch.worker or {})
        return state

    def _take_checks(self, state: _OpenShard, shard: ShardRange, checks: list[dict[str, Any]]) -> None:
        """Keep the self-check's records of a batch for its shard; a mismatch stops the run (``on_mismatch:
        fail``: this shard is never committed) or is logged (``warn``)."""
        for check in checks:
            where = self._input_row(check["id"])
            if where is not None:  # the sample's input file and row, next to its id
                check = {"id": check["id"], "input": where, **check}
            state.checks.append(check)
            if check["verdict"] == self_check.MISMATCH:
                message = self._mismatch(shard, check)
                if self._spec.self_check.on_mismatch == "fail":
                    raise SelfCheckError(f"{message}; jacobian.self_check.on_mismatch: warn would record it and go on")
                log.warning("%s (recorded: jacobian.self_check.on_mismatch is warn)", message)
            elif check["verdict"] == self_check.KINK:
                log.info("self-check: %s sample %d: %s (%s relative error %s; not a mismatch)", state.writer.name,
                         check["id"], self_check.KINK_NOTE, check["dataset"], check["max_rel_error"])

    def _input_row(self, sample_id: int) -> dict[str, Any] | None:
        source = next((f for f in self._spec.files if f.num_samples and f.first_id <= sample_id < f.stop_id), None)
        return None if source is None or self._spec.open_ended else {"file": source.path, "row": sample_id - source.first_id}

    def _mismatch(self, shard: ShardRange, check: dict[str, Any]) -> str:
        where = check.get("input")
        row = f" (input {where['file']} row {where['row']})" if where else ""
        return (
            f"self-check failed: {shard_file(shard.start, shard.stop)} (ids {shard.start}..{shard.stop - 1}), sample "
            f"{check['id']}{row}: {check['dataset']} differs from the reference ({check['reference']}) by "
            f"max relative error {check['max_rel_error']}, tolerance {check['tolerance']:g}"
        )

    def _check_record(self, checks: list[dict[str, Any]], timing: bool) -> dict[str, Any]:
        """A shard's self-check as stored: in its attribute (without ``timing``, which differs from run to
        run: a resumed run must write the same bytes) and in its ``ShardRecord``."""
        options = self._spec.self_check
        kept = [check if timing else {k: v for k, v in check.items() if k != "timing"} for check in checks]
        return {"samples": options.samples, "on_mismatch": options.on_mismatch, "checked": kept}

    def _committed(self, wait: bool) -> Iterator[WindowedValue | TaggedOutput]:
        """The records of the commits that are done (with ``wait``: of all of them, waiting), in order;
        a failed commit raises here."""
        while self._committing and (wait or self._committing[0].checksum.done()):
            done = self._committing.pop(0)
            with done.state.files:  # closes the writer; after a failed commit, deletes its temporary file
                checksum = done.checksum.result()
            yield from self._records(done, checksum)

    def _records(self, done: _Committing, checksum: str) -> Iterator[WindowedValue | TaggedOutput]:
        shard, state = done.shard, done.state
        self._metrics.written.inc()
        seconds = time.perf_counter() - state.began
        log.info("shard %s: %d samples in %.2fs", state.writer.name, shard.rows, seconds)
        record = ShardRecord(
            file=shard_file(shard.start, shard.stop),
            start=shard.start,
            stop=shard.stop,
            sha256=checksum,
            model_fingerprint=str(state.engine.get("model_fingerprint", "")),
            computed=True,
            seconds=seconds,
            worker_pid=state.worker.get("pid", os.getpid()),
            engine_builds=state.worker.get("engine_builds", 0),
            engine=state.engine or None,
            rows=shard.rows,
            nonfinite=state.writer.nonfinite,
            self_check=self._check_record(state.checks, timing=True) if state.checks else None,
        )
        yield done.element.with_value(record)
        if state.sums is not None:
            yield TaggedOutput(AGGREGATES, done.element.with_value((self._positions[shard.start], state.sums)))

    def _abort(self) -> None:
        """Close what is open or committing (a temporary file is deleted; a commit in flight finishes,
        leaving a complete shard that no record names yet: a retry writes it again, a rerun keeps it)."""
        for done in self._committing:
            with contextlib.suppress(Exception), done.state.files:
                done.checksum.exception()
        for state in self._open.values():
            state.files.close()  # closes and deletes the temporary file
        self._open, self._committing = {}, []


@beam.typehints.with_input_types(tuple[ShardRange, str])
@beam.typehints.with_output_types(ShardRecord)
class KeepShardFn(beam.DoFn):
    """``(ShardRange, sha256)`` of a shard already complete on disk -> its ``ShardRecord`` (and its stored
    partial sums to ``aggregates``), after checking that this run wrote it."""

    def __init__(self, spec: JobSpec):
        self._spec = spec
        self._metrics = ShardMetrics()

    def setup(self) -> None:
        self._positions = self._spec.shard_positions()

    @no_annotations
    def process(self, element: tuple[ShardRange, str]) -> Iterator[ShardRecord | TaggedOutput]:
        shard, checksum = element
        spec = self._spec
        path = shard_path(spec.output_dir, shard.start, shard.stop)
        attrs = read_attrs(path)
        expected = {"run_key": spec.run_key}
        if spec.model_fingerprint:
            expected["model_fingerprint"] = spec.model_fingerprint
        for name, value in expected.items():
            if attrs.get(name) != value:
                raise OutputError(
                    f"{path}: complete shard from a different run ({name} {attrs.get(name)!r}, this run "
                    f"{value!r}); use a new output.path or remove that folder"
                )
        self._metrics.kept.inc()
        yield existing_record(spec.output_dir, shard.start, shard.stop, str(attrs["model_fingerprint"]), checksum)
        if spec.engine.aggregate:
            yield TaggedOutput(AGGREGATES, (self._positions[shard.start], aggregates.read_partial(path)))


@no_annotations
@beam.typehints.with_input_types(JacobianBatch, int)
@beam.typehints.with_output_types(Iterator[tuple[int, JacobianBatch]])  # FlatMap: an iterable of them
def _split_by_shard(batch: JacobianBatch, samples_per_shard: int) -> Iterator[tuple[int, JacobianBatch]]:
    """A user's batch as ``(shard index, the part of the batch in that shard)``."""
    try:
        ids = np.asarray(batch.ids, np.int64)
    except (TypeError, ValueError):
        ids = None
    if ids is None or ids.shape != (len(batch),) or (len(ids) and ids.min() < 0):
        raise OutputError(
            f"WriteShards needs each sample keyed by its id, an integer >= 0 (found keys such as "
            f"{list(batch.ids[:3])}); key the samples (id, sample) before ComputeJacobians"
        )
    index = ids // samples_per_shard
    for shard in np.unique(index):
        rows = np.flatnonzero(index == shard)
        yield int(shard), dataclasses.replace(
            batch,
            ids=ids[rows],
            datasets={name: values[rows] for name, values in batch.datasets.items()},
            partial=None,  # per batch, not per shard: user pipelines take no aggregates
        )


@no_annotations
@beam.typehints.with_input_types(tuple[int, Iterable[JacobianBatch]], int)
@beam.typehints.with_output_types(JacobianBatch)
def _join_shard(element: tuple[int, Sequence[JacobianBatch]], samples_per_shard: int) -> JacobianBatch:
    """One shard's parts, in id order, as one batch with its ``ShardRange``: ids ``[first, last + 1)``
    without a gap or a repeat."""
    _, parts = element
    parts = sorted(parts, key=lambda part: int(part.ids[0]))
    ids = np.concatenate([part.ids for part in parts])
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    start, stop = int(ids[0]), int(ids[-1]) + 1
    if len(ids) != stop - start or (len(ids) > 1 and (np.diff(ids) != 1).any()):
        repeated = ids[1:][np.diff(ids) == 0]
        problem = f"id {int(repeated[0])} twice" if len(repeated) else "a gap in the ids"
        raise OutputError(f"WriteShards: shard of ids {start}..{stop - 1} holds {problem}; ids must be 0..n-1, each once")
    datasets = {name: np.concatenate([part.datasets[name] for part in parts])[order] for name in parts[0].datasets}
    return dataclasses.replace(
        parts[0], ids=ids, datasets=datasets, shard=ShardRange(start, stop), seconds=sum(p.seconds for p in parts)
    )


def pipeline_spec(
    output_dir: str,
    model: ModelSource,
    input_shape: Sequence[int] | Mapping[str, Sequence[int]],
    options: EngineOptions = EngineOptions(),
    samples_per_shard: int = 4096,
    compression: str = "none",
) -> JobSpec:
    """The job description for writing a user's pipeline's Jacobians with ``WriteShards``.

    Args:
        output_dir: the output folder, local or remote (``gs://``, ``s3://``, ...).
        model: the model the records were computed with (recorded in the manifest).
        input_shape: one sample's shape, or ``{input name: shape}`` for a model with several inputs.
        options: the engine options the records were computed with; ``aggregate`` must be empty.
        samples_per_shard: ids per shard file: shard ``k`` holds ids ``[k * samples_per_shard, ...)``.
        compression: the shards' HDF5 compression: ``none``, ``gzip`` or ``lzf``.

    Returns:
        A ``JobSpec`` without input files: the number of samples, ``n``, is known once every shard is
        written (the records' ids must be ``0..n-1``, each once).

    Raises:
        ValueError: ``options.aggregate`` is set (aggregates are for planned jobs; combine the records
            with a ``CombineFn`` instead).
    """
    if options.aggregate:
        raise ValueError(
            "jacobian.aggregate is for planned jobs (jacobeam run); in a pipeline of your own, combine "
            "the records with a CombineFn"
        )
    shape = shape_record(input_shape)  # a list, or {input name: list} for several inputs
    identity = {"model": dataclasses.asdict(model), "input_shape": shape, "engine": repr(options)}
    return JobSpec(
        model=model,
        files=(
            SourceFile(
                path=PIPELINE_INPUT,
                key=None,
                num_samples=0,
                sample_shape=shape_from_record(shape),
                dtype=options.compute_dtype,
            ),
        ),
        output_dir=output_dir,
        run_key=hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16],
        engine=options,
        samples_per_shard=samples_per_shard,
        compression=compression,
        config={"model": dataclasses.asdict(model), "pipeline": True},
        started_at=time.time(),
        identity=identity,
        open_ended=True,
        self_check=SelfCheck(samples=0),  # its batches have no planned shard to check samples of
    )


class WriteShards(beam.PTransform):
    """``PCollection[JacobianBatch] -> PCollection[manifest dict]``: an output folder.

    Writes the shards (``shards/shard-<start>-<stop>.h5``, each under a temporary name and renamed when
    complete), then ``aggregates.h5`` (if asked for), ``rejected.jsonl``, ``jacobians.h5`` and, last,
    ``manifest.json`` in ``spec.output_dir`` (``transforms.output.layout`` names every file).

    Args:
        spec: a planned job's spec, or ``pipeline_spec(...)`` for a user's pipeline (whose batches' ids
            are then the samples' ids ``0..n-1``, each once, in any order and batching).
        complete: ``PCollection[(ShardRange, sha256)]`` of shards already on disk, kept as they are
            (``ReadSamples``' ``complete`` output); None for none.
        rejected: ``PCollection[Rejected]`` of samples left out (``ReadSamples``' ``rejected``); None
            for none.

    Returns:
        A single-element ``PCollection`` holding the manifest (a dict, as written to
        ``manifest.json``).

    Raises:
        OutputError: a shard cannot be written; the ids of a user's pipeline have gaps or repeats, or
            keys that are not integers; a self-check mismatch under ``on_mismatch: fail``.
    """

    def __init__(self, spec: JobSpec, complete=None, rejected=None):
        super().__init__()
        self._spec, self._complete, self._rejected = spec, complete, rejected

    def expand(self, batches):
        spec = self._spec
        if spec.open_ended:
            batches = (
                batches
                | "ByShard" >> beam.FlatMap(_split_by_shard, spec.samples_per_shard)
                | "GroupShards" >> beam.GroupByKey()
                | "JoinShards" >> beam.Map(_join_shard, spec.samples_per_shard)
            )
        written = batches | "Write" >> beam.ParDo(WriteShardFn(spec)).with_outputs(AGGREGATES, main="records")
        records, partials = [written.records], [written[AGGREGATES]]
        if self._complete is not None:
            kept = self._complete | "Keep" >> beam.ParDo(KeepShardFn(spec)).with_outputs(AGGREGATES, main="records")
            records.append(kept.records)
            partials.append(kept[AGGREGATES])
        summary = None
        if spec.engine.aggregate:
            summary = tuple(partials) | "AllPartials" >> beam.Flatten() | "Aggregate" >> Aggregate(spec)
        return tuple(records) | "AllRecords" >> beam.Flatten() | "Finalize" >> Finalize(spec, summary, self._rejected)
