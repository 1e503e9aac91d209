"""The compute step: a DoFn that turns id ranges into complete HDF5 shards of Jacobians.

Each worker process loads the model and builds the compiled Jacobian function once (``setup()``,
shared between DoFn instances of the process through ``apache_beam.utils.shared``), then streams
each range through ``tf.data`` into a shard.

Samples that the plan rejected (``input.on_bad_sample: skip``) are never read; the DoFn sends them to
its dead-letter output ``rejected``, which ``Finalize`` writes to ``rejected.jsonl``.

Beam may run a bundle again after a failure (distributed runners and the BundleBasedDirectRunner do;
the in-process FnApiRunner does not retry and fails the job instead). Processing a range is idempotent:
a complete shard is kept, a failed attempt's temporary file is removed, and only the rename makes a
shard count, so a retried bundle leaves neither a half shard nor a duplicate.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.utils import shared

from transforms import aggregates, faults
from transforms.errors import InputError, ModelError, OutputError
from transforms.readers import as_dtype, iter_slices, nonfinite_rows, shape_record, tensor_spec
from transforms.shards import ShardRecord, ShardWriter, existing_record, proven_checksum, read_attrs, shard_file, shard_path
from transforms.spec import JobSpec, ShardRange, version

REJECTED = "rejected"  # the dead-letter output's tag

log = logging.getLogger(__name__)
_NAMESPACE = "jacobeam"
AGGREGATES_TAG = "aggregates"

# Engines built in this process: lets tests (and the manifest) show that setup work happens once per
# worker process, not per bundle or element.
_engine_builds = 0
_builds_lock = threading.Lock()


def configure_tf_threads(threads: int | None) -> None:
    """Set TensorFlow's thread pools before its first op; a no-op once TF is running with them."""
    if threads is None:
        return
    import tensorflow as tf

    threading_config = tf.config.threading
    if threading_config.get_intra_op_parallelism_threads() == threads:
        return
    try:
        threading_config.set_intra_op_parallelism_threads(threads)
        threading_config.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # TF already initialised in this process (e.g. by the caller): keep its pools.
        log.warning("TensorFlow already initialised; cannot set its threads to %d", threads)


def build_engine(spec: JobSpec):
    """Load the model and build, trace and warm up the Jacobian function (once per process)."""
    global _engine_builds
    from transforms.engine import JacobianEngine

    configure_tf_threads(spec.tf_threads)
    engine = JacobianEngine(spec.model.load(), spec.sample_shape, spec.engine)
    with _builds_lock:
        _engine_builds += 1
    return engine


class ComputeShardFn(beam.DoFn):
    """``ShardRange -> ShardRecord``: computes and writes one shard, or keeps it if already complete."""

    def __init__(self, spec: JobSpec):
        self._spec = spec
        self._shared = shared.Shared()
        self._samples = Metrics.counter(_NAMESPACE, "samples")
        self._batches = Metrics.counter(_NAMESPACE, "batches")
        self._written = Metrics.counter(_NAMESPACE, "shards_written")
        self._skipped = Metrics.counter(_NAMESPACE, "shards_skipped")
        self._latency = Metrics.distribution(_NAMESPACE, "batch_latency_ms")
        self._retraces = Metrics.gauge(_NAMESPACE, "retraces_after_setup")
        self._fallbacks = Metrics.gauge(_NAMESPACE, "pfor_fallbacks")
        self._oom_retries = Metrics.gauge(_NAMESPACE, "oom_retries")
        self._peak_rss = Metrics.gauge(_NAMESPACE, "peak_rss_mb")

    def setup(self) -> None:
        faults.reached("setup")
        self._engine = self._shared.acquire(lambda: build_engine(self._spec), tag=self._spec.run_key)
        self._positions = {shard.start: i for i, shard in enumerate(self._spec.stored_ranges())}

    def process(self, shard: ShardRange) -> Iterator[ShardRecord | beam.pvalue.TaggedOutput]:
        for rejected in shard.rejected:
            yield beam.pvalue.TaggedOutput(REJECTED, rejected)
        final = shard_path(self._spec.output_dir, shard.start, shard.stop)
        checksum = None if shard.rows == 0 else proven_checksum(final)
        if shard.rows == 0:  # every sample of the range was rejected: no shard, no partial sums
            record = sums = None
        elif checksum is not None:
            record = self._keep(final, shard, checksum)
            sums = aggregates.read_partial(final) if self._spec.engine.aggregate else None
        else:
            record, sums = self._compute(shard)
        if record is not None:
            yield record
        if sums is not None:
            yield beam.pvalue.TaggedOutput(AGGREGATES_TAG, (self._positions[shard.start], sums))

    def _keep(self, path: str, shard: ShardRange, checksum: str) -> ShardRecord:
        attrs = read_attrs(path)
        for name, expected in (("run_key", self._spec.run_key), ("model_fingerprint", self._engine.fingerprint)):
            if attrs.get(name) != expected:
                raise OutputError(
                    f"{path}: complete shard from a different run ({name} {attrs.get(name)!r}, this run "
                    f"{expected!r}); use a new output.path or remove that folder"
                )
        self._skipped.inc()
        return existing_record(
            self._spec.output_dir, shard.start, shard.stop, self._engine.fingerprint, self._engine.describe(), checksum
        )

    def _batches_of(self, shard: ShardRange):
        """tf.data over the shard's samples: file slices, rebatched across file boundaries, prefetched
        so that reading overlaps computing. Only the shard's last batch can be short."""
        import tensorflow as tf

        spec, dtype = self._spec, self._spec.engine.compute_dtype
        label_key = spec.label_key if spec.engine.outputs.rule == "label" else None

        def slices():
            batch = self._engine.batch_size
            for lo, hi in shard.kept():  # rejected samples are never read
                for ids, samples, labels in iter_slices(spec.files, lo, hi, batch, label_key):
                    _check_finite(spec, ids, samples)
                    labels = np.zeros(len(ids)) if labels is None else labels.astype(np.float64)
                    yield ids, as_dtype(samples, dtype), labels

        # Samples are one tensor, or a dict of tensors by input name (a model with several inputs).
        signature = (
            tf.TensorSpec((None,), tf.int64),
            tensor_spec(spec.sample_shape, dtype),
            tf.TensorSpec((None,), tf.float64),
        )
        dataset = tf.data.Dataset.from_generator(slices, output_signature=signature)
        return dataset.rebatch(self._engine.batch_size).prefetch(2)

    def _compute(self, shard: ShardRange) -> tuple[ShardRecord, aggregates.Partial | None]:
        engine, spec = self._engine, self._spec
        sums = None
        began = time.perf_counter()
        input_shape = shape_record(spec.sample_shape)
        attrs = {
            # HDF5 attributes hold arrays, not mappings: several inputs' shapes are stored as JSON.
            "input_shape": json.dumps(input_shape) if isinstance(input_shape, dict) else input_shape,
            "output_shape": engine.output_shape,
            "dtype": spec.engine.store_dtype,
            "model_fingerprint": engine.fingerprint,
            "run_key": spec.run_key,
            "jacobeam_version": version(),
        }
        attrs.update(shard_attrs(spec, shard))
        with ShardWriter(spec.output_dir, shard.start, shard.stop, attrs, spec.compression, rows=shard.rows) as writer:
            for ids, samples, labels in self._batches_of(shard):
                tick = time.perf_counter()
                ids = ids.numpy()
                samples = {k: v.numpy() for k, v in samples.items()} if isinstance(samples, dict) else samples.numpy()
                try:
                    result, full = engine.compute(samples, labels.numpy())
                except ModelError as err:
                    raise ModelError(f"samples {ids[0]}..{ids[-1]}: {err}") from err
                self._latency.update(int(1000 * (time.perf_counter() - tick)))
                writer.write(int(ids[0]), {**result, "sample_id": ids})
                if full is not None:
                    sums = aggregates.add(sums, aggregates.partial(full, spec.engine.aggregate))
                self._batches.inc()
                self._samples.inc(len(ids))
            if sums is not None:
                writer.attach(aggregates.PARTIALS, sums)
            checksum = writer.commit()
        self._written.inc()
        self._report(engine.describe())
        seconds = time.perf_counter() - began
        log.info("shard %s: %d samples in %.2fs", writer.name, shard.stop - shard.start, seconds)
        record = ShardRecord(
            file=shard_file(shard.start, shard.stop),
            start=shard.start,
            stop=shard.stop,
            sha256=checksum,
            model_fingerprint=engine.fingerprint,
            computed=True,
            seconds=seconds,
            worker_pid=os.getpid(),
            engine_builds=_engine_builds,
            engine=engine.describe(),
            rows=shard.rows,
            nonfinite=writer.nonfinite,
        )
        return record, sums

    def _report(self, engine: dict) -> None:
        self._retraces.set(engine["retraces_after_setup"])
        self._fallbacks.set(len(engine["pfor_fallbacks"]))
        self._oom_retries.set(engine["oom_retries"])
        self._peak_rss.set(engine["peak_rss_bytes"] // 2**20)


def shard_attrs(spec: JobSpec, shard: ShardRange) -> dict[str, str]:
    """What a shard records about the run that wrote it, so that a later run can tell whether the shard
    is its own: the run's identity (``run_key`` hashes it) and the input files that its ids come from."""
    from transforms.spec import shard_inputs

    return {
        "run_identity": json.dumps(spec.identity, sort_keys=True),
        "inputs": json.dumps(shard_inputs(spec.files, shard.start, shard.stop)),
    }


def _check_finite(spec: JobSpec, ids, samples) -> None:
    """The plan scanned every input; a non-finite sample it did not reject means the file changed since."""
    bad = nonfinite_rows(samples)
    if bad.any():
        sample_id = int(ids[int(np.argmax(bad))])
        source = next(f for f in spec.files if f.first_id <= sample_id < f.stop_id)
        raise InputError(
            f"{source.path}: row {sample_id - source.first_id} (sample id {sample_id}) holds NaN or Inf but "
            "did not when the run was planned; the input file changed during the run"
        )


class ComputeShards(beam.PTransform):
    """``PBegin -> (records, aggregates, rejected)``: every shard of the job, spread over the workers.

    ``records`` is a ``PCollection[ShardRecord]``; ``aggregates`` holds each shard's partial sums
    ``(shard position, Partial)`` when the job asks for aggregates; ``rejected`` is the dead-letter
    output: the ``Rejected`` runs of samples left out of each range (``input.on_bad_sample: skip``).
    """

    def __init__(self, spec: JobSpec):
        super().__init__()
        self._spec = spec

    def expand(self, pbegin):
        return (
            pbegin
            | "ShardRanges" >> beam.Create(self._spec.ranges())
            | "Spread" >> beam.Reshuffle()
            | "ComputeShard"
            >> beam.ParDo(ComputeShardFn(self._spec)).with_outputs(AGGREGATES_TAG, REJECTED, main="records")
        )
