"""``WriteShards``: Jacobian batches of a pipeline of your own in, HDF5 shards, ``manifest.json`` and
``jacobians.h5`` out.

Its batches carry their own integer ids (or, from ``ReadSamples``, their planned shard); they are grouped
by shard first (a ``GroupByKey``, which holds one shard's records at a time), and each shard is written
by one call of ``WriteShardFn.process`` with a ``transforms.write.ShardOutput``, which yields its record:
every output of the step comes out of ``process``. ``pipeline_spec`` describes such a pipeline's job.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.typehints.decorators import no_annotations

from jacobeam.transforms import aggregates
from jacobeam.transforms.elements import JacobianBatch
from jacobeam.transforms.errors import OutputError, span
from jacobeam.transforms.finalize import Finalize
from jacobeam.transforms.inputs.readers import shape_from_record, shape_record
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.metrics import ShardMetrics
from jacobeam.transforms.output import fence, lease
from jacobeam.transforms.output.claim import BUSY_HINT, claim, owned_files, release
from jacobeam.transforms.output.layout import PIPELINE_INPUT, shard_name
from jacobeam.transforms.output.shards import ShardRecord
from jacobeam.transforms.replace import move_in, staging
from jacobeam.transforms.spec import (
    EngineOptions,
    JobSpec,
    ModelSource,
    SelfCheck,
    ShardRange,
    run_key,
)
from jacobeam.transforms.write import ShardOutput


@beam.typehints.with_input_types(JacobianBatch, str)
@beam.typehints.with_output_types(ShardRecord)
class WriteShardFn(beam.DoFn):
    """``JacobianBatch`` holding every row of its shard (``batch.shard``) -> the shard's ``ShardRecord``,
    once it is committed."""

    def __init__(self, spec: JobSpec):
        self._spec = spec
        self._metrics = ShardMetrics()

    @no_annotations
    def process(self, batch: JacobianBatch, claimed: str | None = None) -> Iterator[ShardRecord]:
        """``claimed``: the run id ``WriteShards``' claim yields, a side input, so that no shard is written
        before the folder is claimed."""
        if batch.shard is None:
            raise OutputError("WriteShards: a batch without its shard; ids must be grouped into shards first")
        stale = shard_name(batch.shard.start, batch.shard.stop) in self._spec.stale  # replaced by the commit
        with ShardOutput(self._spec, batch.shard, self._metrics, replace=stale) as output:
            output.add(batch)
            yield output.commit(batch.read)


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


def _concatenate(parts: Iterable[JacobianBatch]) -> JacobianBatch:
    """Batches of one shard as one batch, in the order of their first ids: their ids, datasets, partial
    sums, compute seconds and self-check records together."""
    parts = sorted(parts, key=lambda part: int(part.ids[0]))
    checks = [check for part in parts for check in part.checks or []]
    return dataclasses.replace(
        parts[0],
        ids=np.concatenate([part.ids for part in parts]),
        datasets={name: np.concatenate([part.datasets[name] for part in parts]) for name in parts[0].datasets},
        partial=functools.reduce(aggregates.add, (part.partial for part in parts), None),
        seconds=sum(part.seconds for part in parts),
        checks=checks or None,
        read=next((part.read for part in parts if part.read is not None), None),
    )


@no_annotations
@beam.typehints.with_input_types(tuple[int, Iterable[JacobianBatch]])
@beam.typehints.with_output_types(JacobianBatch)
def _join_shard(element: tuple[int, Sequence[JacobianBatch]]) -> JacobianBatch:
    """One shard's parts, in id order, as one batch with its ``ShardRange``: ids ``[first, last + 1)``
    without a gap or a repeat."""
    joined = _concatenate(element[1])
    order = np.argsort(joined.ids, kind="stable")  # a user's batches may interleave their ids
    ids = joined.ids[order]
    start, stop = int(ids[0]), int(ids[-1]) + 1
    if len(ids) != stop - start or (len(ids) > 1 and (np.diff(ids) != 1).any()):
        repeated = ids[1:][np.diff(ids) == 0]
        after = ids[:-1][np.diff(ids) > 1]
        problem = f"id {int(repeated[0])} twice" if len(repeated) else f"a gap in the ids (id {int(after[0]) + 1} missing)"
        raise OutputError(f"WriteShards: the shard of {span(start, stop)} holds {problem}; ids must be 0 to n-1, each once")
    datasets = {name: values[order] for name, values in joined.datasets.items()}
    return dataclasses.replace(joined, ids=ids, datasets=datasets, shard=ShardRange(start, stop))


@no_annotations
@beam.typehints.with_input_types(JacobianBatch)
@beam.typehints.with_output_types(tuple[int, JacobianBatch])
def _planned_shard(batch: JacobianBatch) -> tuple[int, JacobianBatch]:
    """A planned job's batch keyed by its shard's first id."""
    if batch.shard is None:
        raise OutputError("WriteShards: a batch of a planned job without its shard (read it with ReadSamples)")
    return batch.shard.start, batch


@no_annotations
@beam.typehints.with_input_types(tuple[int, Iterable[JacobianBatch]])
@beam.typehints.with_output_types(JacobianBatch)
def _join_planned(element: tuple[int, Sequence[JacobianBatch]]) -> JacobianBatch:
    """A planned shard's batches, in id order, as one batch (its self-check records with it)."""
    return _concatenate(element[1])


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
        run_key=run_key(identity),
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

    Groups the batches by shard (``GroupByKey``: one shard's records are held at a time), writes each
    shard (``shards/shard-<start>-<stop>.h5``, under a temporary name and renamed when complete), then
    ``aggregates.h5`` (if asked for), ``rejected.jsonl``, ``jacobians.h5`` and, last, ``manifest.json``
    in ``spec.output_dir`` (``transforms.output.layout`` names every file).

    Args:
        spec: ``pipeline_spec(...)`` for a user's pipeline (whose batches' ids are then the samples' ids
            ``0..n-1``, each once, in any order and batching), or a planned job's spec, whose batches
            carry their shard (``ReadSamples`` -> ``ComputeJacobians``): then every stored range of the
            plan must arrive (``jacobeam run`` instead computes each range with ``ComputeShards``, which
            keeps shards already complete and holds no whole shard in memory).
        replace: replace another run's result found in the output folder (only files jacobeam wrote)
            instead of refusing to write there: the new result is written in a folder of its own inside
            it (``.jacobeam-overwrite``) and moved in once complete (``transforms.replace``), so a
            pipeline that fails leaves the old result whole.

    Returns:
        A single-element ``PCollection`` holding the manifest (a dict, as written to
        ``manifest.json``).

    Building the step reads and writes nothing. Its first step, when the pipeline runs, takes the
    output folder's lease (``transforms.output.claim``; a local, S3 or GCS folder) and checks what the
    folder holds (with ``replace``, also the staging folder's lease, clearing what a failed replacement
    left there); every commit then proves the lease is still this run's (``transforms.output.fence``),
    and the last step frees it, after the manifest (with ``replace``, once the new result is moved in).

    Raises (when the pipeline runs):
        LeaseBusy: another run is writing the output folder.
        LostLeaseError: this run was paused past the lease's stale time and another run took the folder
            over: it commits nothing more.
        OutputError: the output folder holds another run's result (unless ``replace``); a shard cannot
            be written; the ids of a user's pipeline have gaps or repeats, or
            keys that are not integers; a self-check mismatch under ``on_mismatch: fail``.
    """

    def __init__(self, spec: JobSpec, replace: bool = False):
        super().__init__()
        if lease.supported(spec.output_dir):  # its commits prove the lease its first step takes
            spec = dataclasses.replace(spec, run_id=spec.run_id or uuid.uuid4().hex[:12], fenced=True)
        self._spec = spec
        # Where the shards and manifest are written: with replace, the folder's staging folder.
        self._written = dataclasses.replace(spec, output_dir=staging(spec.output_dir)) if replace else spec
        self._applied: set[int] = set()  # the pipelines (ids) it is applied in

    def expand(self, batches):
        spec, written = self._spec, self._written
        # One instance is one run id: applied twice in a pipeline, its second claim took the first's lease
        # for its own (a retried claim), and two results were written into one folder.
        if id(batches.pipeline) in self._applied:
            raise ValueError(f"WriteShards to {spec.output_dir} is applied twice in one pipeline: a WriteShards writes "
                             "one folder once; make one WriteShards per output folder")
        self._applied.add(id(batches.pipeline))
        claimed = (
            batches.pipeline
            | "Folder" >> beam.Create([None])
            | "Claim" >> beam.ParDo(_ClaimFn(spec, written))
        )
        if spec.open_ended:
            keyed = batches | "ByShard" >> beam.FlatMap(_split_by_shard, spec.samples_per_shard)
            join = _join_shard
        else:
            keyed = batches | "ByShard" >> beam.Map(_planned_shard)
            join = _join_planned
        return (
            keyed
            | "GroupShards" >> beam.GroupByKey()
            | "JoinShards" >> beam.Map(join)
            | "Write" >> beam.ParDo(WriteShardFn(written), beam.pvalue.AsSingleton(claimed))
            | "Finalize" >> Finalize(written)
            | "Release" >> beam.Map(_release, spec, written)
        )


class _ClaimFn(beam.DoFn):
    """The folder claimed when the pipeline runs (``transforms.output.claim``), not when it is built: the
    lease taken and another run's result checked. Where the result is written elsewhere first (``written``,
    ``WriteShards(replace=True)``), the output folder's lease is taken and that folder claimed, what a
    replacement that failed left there removed. The leases' heartbeats run in this DoFn's process;
    ``_release`` frees them after the manifest, and ``teardown`` (the pipeline's end, also a failed one's)
    stops the heartbeats and frees leases still held."""

    def __init__(self, spec: JobSpec, written: JobSpec):
        self._spec, self._written = spec, written
        self._leases: list[lease.Lease] = []

    @no_annotations
    def process(self, _: None) -> Iterator[str]:
        spec, written = self._spec, self._written
        staged = written.output_dir != spec.output_dir
        if staged and spec.fenced:
            self._leases.append(lease.Lease(spec.output_dir, run_id=spec.run_id, busy_hint=BUSY_HINT).acquire())
        held = claim(written, replace=staged)
        self._leases += [held] if held is not None else []
        yield spec.run_id

    def teardown(self) -> None:
        while self._leases:
            self._leases.pop().release()


@no_annotations
def _release(manifest: dict, spec: JobSpec, written: JobSpec) -> dict:
    """The manifest, once the run's lease is freed: the run is over. A result written in the staging folder
    (``WriteShards(replace=True)``) is moved in first, replacing the folder's (``transforms.replace``)."""
    if written.output_dir != spec.output_dir:
        release(written)
        manifest = move_in(spec.output_dir, spec.output_dir, fence.of(spec), owned_files)
    release(spec)
    return manifest
