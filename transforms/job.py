"""A planned job's one step of work: a shard range in, its shard on disk and its ``ShardRecord`` out.

``ComputeShards`` reads a range's samples (``read.shard_batches``), computes their Jacobians (the
engine of ``ComputeJacobiansFn``, built once per worker process) and streams them into the shard's file
(``write.ShardOutput``), all within one ``process`` call: between Beam steps only shard ranges and
records travel, so however a runner hands elements from step to step (Dask's DaskRunner collects a
step's outputs for a whole partition in a list), no more than a few batches of a shard are in memory,
and every record comes out of ``process`` (never out of ``finish_bundle``, whose outputs not every
runner keeps). Reading checks each sample (``transforms.inputs.checks``): the bad ones are left out
and listed in the shard (``input.on_bad_sample: skip``), or the first one stops the job with one line
naming file and row (``error``; the shards already complete stay, and a rerun keeps them). A range
whose shard is already complete on disk is not read: its shard is kept, after checking that this run
wrote it.

A stale shard (``JobSpec.stale``: computed from an input file whose stamp changed since) stays until
its replacement is committed: its range's samples are read and hashed first (``_reads_as_before``), and
where they are the samples it was computed from (its ``samples_sha256`` and rejected samples) it is kept
as it is; else the range is computed and the commit replaces it in one rename. A run that stops before
leaves the old shard, which the manifest and ``jacobians.h5`` still name. A shard holding samples of
input files removed since is written again without them, its other rows copied (``transforms.trim``),
and replaced the same way; one that cannot be copied so is computed again from its remaining files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.typehints.decorators import no_annotations

from jacobeam.transforms.compute import ComputeJacobiansFn, EngineFactory
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs.checks import Labels, RangeFindings, checked_slices
from jacobeam.transforms.metrics import ShardMetrics
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import ENGINE_PLAN, INPUT_LABELS, INPUT_STAMPS, LABELS_SHA256, SAMPLES_SHA256, shard_name
from jacobeam.transforms.output.shards import ShardRecord, attr_text, proven_checksum, read_rejected, shard_path
from jacobeam.transforms.read import range_findings, shard_batches
from jacobeam.transforms.spec import JobSpec, ShardRange, input_labels, input_stamps
from jacobeam.transforms.trim import trimmed, without_removed
from jacobeam.transforms.write import ShardOutput, kept_record

log = logging.getLogger(__name__)


@beam.typehints.with_input_types(Any)  # a ShardRange, or a tuple of them (a work item)
@beam.typehints.with_output_types(ShardRecord)
class ComputeShardFn(ComputeJacobiansFn):
    """``ShardRange -> ShardRecord``, or a work item of consecutive ranges ``Sequence[ShardRange] ->
    ShardRecord...``: ``ComputeJacobiansFn`` (its engine, set up once per process, and its self-check)
    applied to each range's batches as they are read, each result written as it comes.

    In a work item of several ranges, a shard's commit (checksum, flush, rename, on its writer's thread)
    overlaps the computing of the next range, and its record follows as soon as the commit is done (at
    most one commit in flight); the item's last record waits for its commit before ``process`` returns.
    """

    holds_checks = True  # each shard takes held_checks before its commit

    def __init__(self, spec: JobSpec, engine_factory: EngineFactory | None = None, complete: bool = False):
        super().__init__(
            spec.model, spec.sample_shape, spec.engine, spec.tf_threads, spec.self_check, engine_factory,
            plan_cache=storage.join(spec.output_dir, ENGINE_PLAN),
        )
        self._spec, self._complete = spec, complete
        self._stale = frozenset(spec.stale)
        self._listed = dict(spec.listed_crc32c)
        self._shard_metrics = ShardMetrics()

    def _changed_since_listed(self, shard: ShardRange, checksums: dict[str, str]) -> bool:
        """Whether a complete shard's bytes differ from those the folder's manifest lists for it (its samples
        the same: ``JobSpec.listed_crc32c``): changed after its run committed it, a warning says so."""
        name = shard_name(shard.start, shard.stop)
        listed, found = self._listed.get(name), checksums.get("crc32c")
        if listed is None or found is None or listed == found:
            return False
        log.warning("%s: its bytes differ from those the manifest lists (crc32c %s, listed %s): changed after its "
                    "run committed it; computed again", shard_path(self._spec.output_dir, shard.start, shard.stop),
                    found, listed)
        return True

    def setup(self) -> None:
        if not self._complete:
            super().setup()
            return
        # Every shard was complete when the run was planned: no model to load (a rerun with nothing to
        # compute takes the imports and little else); should a shard have gone since, process builds it.
        self._engine, self._checker, self._chosen, self._waiting = None, None, {}, {}

    @no_annotations
    def process(self, work: ShardRange | Sequence[ShardRange]) -> Iterator[ShardRecord]:
        spec = self._spec
        output: ShardOutput | None = None  # the shard being written
        committing: ShardOutput | None = None  # the shard whose commit is in flight
        try:
            for shard in [work] if isinstance(work, ShardRange) else work:
                path = shard_path(spec.output_dir, shard.start, shard.stop)
                stale = shard_name(shard.start, shard.stop) in self._stale
                copied = trimmed(spec, shard, path) if stale and spec.removed else None
                if copied is not None:  # written again without the samples of removed files, not computed
                    self._shard_metrics.kept.inc()
                    yield _no_bad_samples(spec, _as_now(spec, copied))
                    continue
                checksums = proven_checksum(path) if not stale or _reads_as_before(spec, shard, path) else None
                if checksums is not None and self._changed_since_listed(shard, checksums):
                    checksums, stale = None, True  # computed again, and committed over it
                if checksums is not None:
                    self._shard_metrics.kept.inc()
                    yield _no_bad_samples(spec, _as_now(spec, kept_record(spec, shard, checksums)))
                    continue
                if self._engine is None:
                    super().setup()
                outputs = getattr(self._engine, "output_shape", None)
                findings = range_findings(spec, None if outputs is None else math.prod(outputs))
                output = ShardOutput(spec, shard, self._shard_metrics, replace=stale)
                self._waiting.pop(shard.start, None)
                for samples in shard_batches(spec, shard, findings):
                    for jacobians in super().process(samples):
                        output.add(jacobians)
                    if committing is not None and committing.committed():
                        yield committing.record()
                        committing = None
                output.take_checks(self.held_checks(shard))  # its samples the self-check held back
                if committing is not None:
                    yield committing.record()
                output.commit_later(findings)
                committing, output = output, None
            if committing is not None:
                yield committing.record()
                committing = None
        finally:  # after an error: the shard being written is discarded, a complete one's commit finishes
            if output is not None:
                output.__exit__(None, None, None)
            if committing is not None:
                committing.settle()


def _reads_as_before(spec: JobSpec, shard: ShardRange, path: str) -> bool:
    """Whether a stale shard at ``path`` holds what this run would compute for ``shard``: it was computed
    from the input files' current stamps (this run replaced it already: a retried bundle), or the range's
    samples, read and hashed now (the one read of them), are those it was computed from (its
    ``samples_sha256``, and the same samples rejected for the same reasons). Under ``outputs: label`` the
    labels decide the values too: they are compared by their digest (``labels_sha256``; a shard written
    before shards stored it is computed again)."""
    try:
        with storage.open_h5(path) as h5:
            attrs, rejected = dict(h5.attrs), read_rejected(h5)
    except (OSError, ValueError):
        return False
    # Each file's own label (jacobian.labels folders or table) can change without its stamp: the shard's
    # recorded labels must be those of now too.
    labels_as_now = not spec.labels or (
        INPUT_LABELS in attrs and json.loads(attr_text(attrs[INPUT_LABELS])) == input_labels(spec.files, shard.start, shard.stop))
    if (INPUT_STAMPS in attrs and labels_as_now
            and json.loads(attr_text(attrs[INPUT_STAMPS])) == input_stamps(spec.files, shard.start, shard.stop)):
        return True
    labels = spec.labelled
    if SAMPLES_SHA256 not in attrs or (labels and (LABELS_SHA256 not in attrs or "output_shape" not in attrs)):
        return False
    # Labels are checked against the model's outputs, as the shard's worker did (its output shape).
    checked = Labels(spec.label_key, math.prod(int(d) for d in attrs["output_shape"])) if labels else None
    findings = RangeFindings(spec.files, "skip", checked)
    for _ in checked_slices(spec.files, shard.start, shard.stop, spec.engine.batch_size, findings,
                            spec.label_key if labels else None):
        pass
    return (
        findings.samples_sha256 == attr_text(attrs[SAMPLES_SHA256])
        and (not labels or findings.labels_sha256 == attr_text(attrs[LABELS_SHA256]))
        and [(r.start, r.stop, r.reason) for r in findings.rejected] == [(r.start, r.stop, r.reason) for r in rejected]
    )


def _as_now(spec: JobSpec, record: ShardRecord) -> ShardRecord:
    """A kept shard's record with its rejected samples named by the input files as this run names them
    (a copied or moved folder: the shard lists the paths of the run that computed it), without those of
    removed files (a shard written before ``rejected.jsonl`` dropped them lists them there)."""
    record = dataclasses.replace(record, rejected=without_removed(spec, record.rejected))
    if not record.rejected:
        return record
    sources = [f for f in spec.files if f.num_samples]
    named = tuple(
        run if run.start is None else dataclasses.replace(
            run, file=next((f.path for f in sources if f.first_id <= run.start < f.stop_id), run.file))
        for run in record.rejected
    )
    return dataclasses.replace(record, rejected=named)


def _no_bad_samples(spec: JobSpec, record: ShardRecord) -> ShardRecord:
    """A kept shard's record; under ``on_bad_sample: error``, one that lists rejected samples (a ``skip``
    run wrote it) stops the job as its first bad sample would have."""
    if spec.on_bad_sample == "error" and record.rejected:
        first = record.rejected[0]
        raise InputError(
            f"{first.file}: row {first.row}: {first.reason} (input.on_bad_sample is error; set it to skip to "
            f"leave bad samples out; {record.file} lists it, written by a run under skip)"
        )
    return record


class ComputeShards(beam.PTransform):
    """``PCollection[ShardRange | Sequence[ShardRange]] -> PCollection[ShardRecord]``: each range of a
    planned job read, computed and written as its shard (or its complete shard kept). An element is one
    range, or a work item of consecutive ranges that one worker computes one after the other, each
    shard's commit overlapping the next one's computing (``ComputeShardFn``).

    Args:
        spec: the planned job (``pipeline.plan.make_job(...).spec``).
        engine_factory: builds each worker's engine (see ``ComputeJacobians``); None is TensorFlow's
            ``JacobianEngine``.
        complete: every range's shard was complete when the job was planned: the workers build no
            engine unless a shard has gone since.

    Returns:
        One ``ShardRecord`` per range that has a shard (``computed`` False for a shard kept from an
        earlier attempt); ``Finalize(spec)`` turns them into the output folder's manifest.

    Raises:
        InputError, ModelError, OutputError, SelfCheckError: (in the workers) as ``ReadSamples``,
            ``ComputeJacobians`` and ``WriteShards`` raise them; a failed range leaves no half shard.
    """

    def __init__(self, spec: JobSpec, engine_factory: EngineFactory | None = None, complete: bool = False):
        super().__init__()
        self._spec, self._engine_factory, self._complete = spec, engine_factory, complete

    def expand(self, ranges):
        fn = ComputeShardFn(self._spec, self._engine_factory, self._complete)
        return ranges | "Compute" >> beam.ParDo(fn).with_output_types(ShardRecord)
