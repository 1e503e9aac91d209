"""Writing one shard: batches in, a complete HDF5 shard and its ``ShardRecord`` out.

``ShardOutput`` writes one shard: batches of its rows are streamed into the shard's temporary file as
they come (``ShardWriter``: on the writer's thread, while the caller computes the next batch), then
the shard is committed (checksum, flush, rename) and its ``ShardRecord`` returned. A planned job uses it
inside ``ComputeShards`` (``transforms.job``), which reads, computes and writes one shard range per
element, so that no more than a few batches of a shard are in memory at a time; ``kept_record`` is the
record of a shard a resumed run finds complete. ``transforms.write_shards`` uses it for a pipeline of
your own (``WriteShards``).

Processing is idempotent: a failed attempt's temporary file is removed (or, if the process died, never
counts and is removed by the next run), and only the rename makes a shard count, so a retried bundle
leaves neither a half shard nor a duplicate.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import time
from typing import Any

from jacobeam.transforms import aggregates, model_identity, self_check
from jacobeam.transforms.elements import JacobianBatch
from jacobeam.transforms.errors import OutputError, SelfCheckError, span
from jacobeam.transforms.inputs.readers import shape_record
from jacobeam.transforms.metrics import ShardMetrics, shard_rows
from jacobeam.transforms.output import fence
from jacobeam.transforms.output.layout import (
    INPUT_LABELS,
    INPUT_STAMPS,
    LABELS_SHA256,
    REJECTED_GROUP,
    SAMPLE_ID,
    SAMPLES_SHA256,
    SELF_CHECK,
    shard_file,
)
from jacobeam.transforms.output.shard_writer import ShardWriter
from jacobeam.transforms.output.shards import ShardRecord, existing_record, read_attrs, rejected_record, shard_path
from jacobeam.transforms.spec import JobSpec, Rejected, ShardRange, input_labels, input_stamps, overlapping, shard_inputs, version

log = logging.getLogger(__name__)


class ShardOutput:
    """One shard being written: ``add`` its batches (``JacobianBatch`` of the shard, in id order), then
    ``commit`` returns its ``ShardRecord`` (or ``commit_later`` queues the commit on the writer's thread,
    so that the caller can compute on, and ``record`` waits for it). A context manager: leaving the
    block without a commit (an error, a self-check mismatch under ``on_mismatch: fail``) deletes the
    temporary file.

    The shard's file is opened at the first batch (its attributes come from the spec and from what the
    engine reports; at the commit, for a range whose samples were all rejected). Each batch's partial
    sums (``jacobian.aggregate``) are added up and stored in the shard; each self-check record is kept
    and stored in its ``self_check`` attribute. What the reading found (``checks.RangeFindings``, given
    to the commit) is stored too: the rejected samples and the digest of the stored ones.
    """

    def __init__(self, spec: JobSpec, shard: ShardRange, metrics: ShardMetrics, replace: bool = False):
        self._spec, self._shard, self._metrics = spec, shard, metrics
        self._replace = replace  # the commit replaces a stale shard of the range (``ShardWriter``'s ``replace``)
        self._samples_sha256: str | None = None
        self._writer: ShardWriter | None = None
        self._closed = False
        self._began = 0.0  # perf_counter when the shard's first batch began computing
        self._engine: dict[str, Any] = {}  # what the engine ran, as the first batch reports it
        self._worker: dict[str, int] = {}
        self._sums: aggregates.Partial | None = None
        self._checks: list[dict[str, Any]] = []  # the self-check's records
        self._committing: concurrent.futures.Future[str] | None = None  # the commit's CRC32C
        self._rejected: tuple[Rejected, ...] = ()

    def __enter__(self) -> ShardOutput:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._writer is not None:
            shard_rows(self._writer.name, None)
        if self._writer is not None and not self._closed:
            # Closes the writer: a commit in flight finishes (a complete shard, which a retry or rerun
            # keeps), one not begun is dropped; without a commit the temporary file is deleted.
            self._writer.__exit__(*exc_info)
            self._closed = True

    def add(self, batch: JacobianBatch) -> None:
        if self._writer is None:
            self._begin(batch)
        self.take_checks(batch.checks or [])
        self._writer.write(int(batch.ids[0]), {**batch.datasets, SAMPLE_ID: batch.ids})
        shard_rows(self._writer.name, self._writer.rows_written)
        self._sums = aggregates.add(self._sums, batch.partial)

    def commit_later(self, findings=None) -> None:
        """Store the sums, the self-check and what the reading found (``findings``, a
        ``checks.RangeFindings`` or an ``elements.RangeRead``: the rejected samples, the sha256 of the
        others) and queue the commit
        (the checksum, the flush and the rename, behind the queued writes, on the writer's thread);
        returns at once. Raises ``OutputError`` when rows are missing."""
        shard = self._shard
        self._rejected = tuple(findings.rejected) if findings is not None else ()
        # Ids of removed input files (``JobSpec.removed``) are neither read nor rows.
        rows = shard.rows - sum(r.num_samples for r in self._rejected) - self._spec.removed_in(shard.start, shard.stop)
        if self._writer is None:
            if rows:
                raise OutputError(f"{shard_file(shard.start, shard.stop)}: no rows arrived, {rows} planned")
            self._open(self._attrs(None), 0)  # every sample rejected: a shard of no rows marks the range done
        writer = self._writer
        if self._sums is not None:
            writer.attach(aggregates.PARTIALS, self._sums)
        if self._rejected:
            writer.attach(REJECTED_GROUP, {"runs": rejected_record(self._rejected)})
        if findings is not None:
            self._samples_sha256 = findings.samples_sha256
            writer.set_attrs({SAMPLES_SHA256: self._samples_sha256})
            if getattr(findings, "labels_sha256", None):  # outputs: label (a RangeRead has none)
                writer.set_attrs({LABELS_SHA256: findings.labels_sha256})
        if self._checks:
            writer.set_attrs({SELF_CHECK: json.dumps(self._check_record(timing=False))})
        self._committing = writer.commit_later(rows)

    def settle(self) -> None:
        """After an error elsewhere (a later range's): let this complete shard's queued commit finish, so
        that a rerun keeps it rather than computing it again, then close the writer. The commit's own
        failure (most often the same lost lease that stops the run) is not raised over the error being
        handled: the shard is left to the rerun, as any uncommitted one."""
        if self._committing is not None:
            try:
                self._committing.result()
            except Exception as err:  # noqa: BLE001 - the error being handled is the run's
                log.debug("%s: not committed: %s", shard_file(self._shard.start, self._shard.stop), err)
        self.__exit__(None, None, None)

    def committed(self) -> bool:
        """Whether the queued commit is done (``record`` then returns at once)."""
        return self._committing is not None and self._committing.done()

    def record(self) -> ShardRecord:
        """Wait for the commit (raising its error) and close the writer; the shard's record."""
        shard, writer = self._shard, self._writer
        checksum = self._committing.result()
        self.__exit__(None, None, None)
        self._metrics.written.inc()
        seconds = time.perf_counter() - self._began
        rows = shard.rows - sum(r.num_samples for r in self._rejected) - self._spec.removed_in(shard.start, shard.stop)
        log.info("shard %s: %d samples in %.2fs", writer.name, rows, seconds)
        return ShardRecord(
            file=shard_file(shard.start, shard.stop),
            start=shard.start,
            stop=shard.stop,
            sha256=None,
            crc32c=checksum,
            model_fingerprint=str(self._engine.get("model_fingerprint", "")),
            computed=True,
            seconds=seconds,
            worker_pid=self._worker.get("pid", os.getpid()),
            engine_builds=self._worker.get("engine_builds", 0),
            engine=self._engine or None,
            rows=rows,
            nonfinite=writer.nonfinite,
            self_check=self._check_record(timing=True) if self._checks else None,
            rejected=self._rejected,
            samples_sha256=self._samples_sha256,
        )

    def commit(self, findings=None) -> ShardRecord:
        """``commit_later``, then wait for the ``record``."""
        self.commit_later(findings)
        return self.record()

    def _begin(self, batch: JacobianBatch) -> None:
        spec, shard, engine = self._spec, self._shard, batch.engine or {}
        fingerprint = engine.get("model_fingerprint")
        if spec.model_fingerprint and fingerprint != spec.model_fingerprint:
            raise OutputError(
                f"model weights changed since the run was planned (fingerprint {spec.model_fingerprint[:16]}… "
                f"then, {str(fingerprint)[:16]}… in worker {os.getpid()})"
            )
        planned = model_identity.digest(spec.model_identity) if spec.model_identity else None
        loaded = engine.get("model_identity")
        if planned and loaded and loaded != planned:  # a fake engine (tests) names no model
            raise OutputError(
                f"the model changed since the run was planned (identity {planned[:16]}… then, {loaded[:16]}… "
                f"in worker {os.getpid()}): run again to compare it with the output folder"
            )
        self._open(self._attrs(batch), shard.rows)
        self._began = time.perf_counter() - batch.seconds
        self._engine, self._worker = engine, batch.worker or {}

    def _attrs(self, batch: JacobianBatch | None) -> dict[str, Any]:
        """The shard's attributes, from the spec and what the engine reported with its first ``batch``
        (None: a shard of no rows, whose output shape no batch told)."""
        spec, shard = self._spec, self._shard
        engine = (batch.engine if batch is not None else None) or {}
        input_shape = shape_record(spec.sample_shape)
        return {
            # HDF5 attributes hold arrays, not mappings: several inputs' shapes are stored as JSON.
            "input_shape": json.dumps(input_shape) if isinstance(input_shape, dict) else input_shape,
            **({"output_shape": batch.datasets["output"].shape[1:]} if batch is not None else {}),
            "dtype": spec.engine.store_dtype,
            "model_fingerprint": engine.get("model_fingerprint") or (spec.model_fingerprint if batch is None else "") or "",
            "run_key": spec.run_key,
            "jacobeam_version": version(),
            "run_identity": json.dumps(spec.identity, sort_keys=True),
            "inputs": json.dumps(shard_inputs(spec.files, shard.start, shard.stop)),
            INPUT_STAMPS: json.dumps(input_stamps(spec.files, shard.start, shard.stop)),
            **({INPUT_LABELS: json.dumps(input_labels(spec.files, shard.start, shard.stop))} if spec.labels else {}),
            **model_identity.shard_attrs(spec.model_identity, spec.tf_threads),
        }

    def _open(self, attrs: dict[str, Any], rows: int) -> None:
        spec, shard = self._spec, self._shard
        writer = ShardWriter(spec.output_dir, shard.start, shard.stop, attrs, spec.compression, rows=rows,
                             run_id=spec.run_id, fence=fence.of(spec), replace=self._replace)
        self._writer = writer.__enter__()
        if not self._began:
            self._began = time.perf_counter()

    def take_checks(self, checks: list[dict[str, Any]]) -> None:
        """Keep self-check records for the shard (a batch's, or those its worker held back until the end:
        ``ComputeJacobiansFn.held_checks``); a mismatch stops the run (``on_mismatch: fail``: this shard is
        never committed) or is logged (``warn``)."""
        for check in checks:
            where = self._input_row(check["id"])
            if where is not None:  # the sample's input file and row, next to its id
                check = {"id": check["id"], "input": where, **check}
            self._checks.append(check)
            if check["verdict"] == self_check.MISMATCH:
                message = self._mismatch(check)
                if self._spec.self_check.on_mismatch == "fail":
                    raise SelfCheckError(f"{message}; jacobian.self_check.on_mismatch: warn would record it and go on")
                log.warning("%s (recorded: jacobian.self_check.on_mismatch is warn)", message)
            elif check["verdict"] == self_check.KINK:
                log.info("self-check: %s sample %d: %s (%s relative error %s; not a mismatch)", self._writer.name,
                         check["id"], self_check.KINK_NOTE, check["dataset"], check["max_rel_error"])

    def _input_row(self, sample_id: int) -> dict[str, Any] | None:
        source = next(iter(overlapping(self._spec.files, sample_id, sample_id + 1)), None)
        return None if source is None or self._spec.open_ended else {"file": source.path, "row": source.row(sample_id)}

    def _mismatch(self, check: dict[str, Any]) -> str:
        shard, where = self._shard, check.get("input")
        row = f" (input {where['file']} row {where['row']})" if where else ""
        return (
            f"self-check failed: {shard_file(shard.start, shard.stop)} ({span(shard.start, shard.stop)}), sample "
            f"{check['id']}{row}: {self_check.mismatch_text(check)}"
        )

    def _check_record(self, timing: bool) -> dict[str, Any]:
        """The shard's self-check as stored: in its attribute (without ``timing``, which differs from run to
        run: a resumed run must write the same bytes) and in its ``ShardRecord``."""
        options = self._spec.self_check
        kept = [check if timing else {k: v for k, v in check.items() if k != "timing"} for check in self._checks]
        return {"samples": options.samples, "on_mismatch": options.on_mismatch, "checked": kept}


def kept_record(spec: JobSpec, shard: ShardRange, checksums: dict[str, str]) -> ShardRecord:
    """The record of ``shard``, already complete on disk (``checksums``: ``proven_checksum``'s), after
    checking that this run wrote it; ``OutputError`` for a shard of another run."""
    path = shard_path(spec.output_dir, shard.start, shard.stop)
    attrs = read_attrs(path)
    expected = {"run_key": spec.run_key}
    if spec.model_fingerprint:
        expected["model_fingerprint"] = spec.model_fingerprint
    if spec.model_identity and model_identity.IDENTITY_ATTR in attrs:  # a shard written before it has none
        expected[model_identity.IDENTITY_ATTR] = model_identity.attr_value(spec.model_identity)
    for name, value in expected.items():
        if attrs.get(name) != value:
            raise OutputError(
                f"{path}: complete shard from a different run ({name} {attrs.get(name)!r}, this run "
                f"{value!r}); use a new output.path or remove that folder"
            )
    return existing_record(spec.output_dir, shard.start, shard.stop, str(attrs["model_fingerprint"]), checksums)
