"""Reading a planned job's samples: a shard range in, batches of samples out.

Each range is one unit of work: ``shard_batches`` streams a range's samples in batches, read ahead of
the computing downstream on a thread of their own. Local ``.npy`` files are read by ``tf.data``:
TensorFlow's own ``FixedLengthRecordDataset``, one record per batch, whose bytes numpy takes as they
are (no Python per batch beyond that, and no ``tf.data`` function to trace per range: faster end to
end, benchmarks/README.md). A range of many files (more than ``_MOST_SEGMENTS``: one sample per file,
say) and other formats are read in Python (``checks.checked_slices``, which gathers small files' rows
into batches), rebatched across file boundaries and handed over from a plain thread (``_ahead``),
which costs nothing to start per range where ``tf.data``'s ``from_generator`` traced functions. Every sample
is checked as it is read (``transforms.inputs.checks``): a bad one (NaN/Inf, unreadable, a label that is
not an output index) is left out and recorded in the range's ``RangeFindings``, which also hashes the
samples kept; under ``input.on_bad_sample: error`` the first one stops the range with one line naming
file and row.

``jacobeam run`` reads inside ``ComputeShards`` (``transforms.job``: read, compute and write one range
per element); ``ReadSamples`` is the same reading as a transform of its own, for a pipeline of your own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

import apache_beam as beam
import numpy as np
from apache_beam.typehints.decorators import no_annotations

from jacobeam.transforms.elements import RangeRead, SampleBatch
from jacobeam.transforms.inputs import arrays
from jacobeam.transforms.inputs.checks import Labels, RangeFindings, checked_slices
from jacobeam.transforms.inputs.readers import as_dtype, row_bytes
from jacobeam.transforms.inputs.registry import file_format
from jacobeam.transforms.inputs.types import Samples, SourceFile
from jacobeam.transforms.output import storage
from jacobeam.transforms.spec import JobSpec, ShardRange, overlapping

T = TypeVar("T")


def range_findings(spec: JobSpec, outputs: int | None = None) -> RangeFindings:
    """A range's ``RangeFindings`` under the job's ``on_bad_sample``; labels (``outputs: label``) are checked
    against ``outputs``, the model's output size (None: integral and non-negative only)."""
    labels = Labels(spec.label_key, outputs) if spec.labelled else None
    return RangeFindings(spec.files, spec.on_bad_sample, labels)


def shard_batches(spec: JobSpec, shard: ShardRange, findings: RangeFindings | None = None) -> Iterator[SampleBatch]:
    """The range's good samples as ``SampleBatch``es of at most ``spec.engine.batch_size``, in id order,
    read by ``tf.data``; the bad ones and the digest of the good ones go to ``findings`` (a new one if
    None). Raises the ``InputError`` of the first bad sample under ``on_bad_sample: error``."""
    findings = range_findings(spec) if findings is None else findings
    if not overlapping(spec.files, shard.start, shard.stop):  # every id of the range is a removed file's
        return
    segments = _npy_segments(spec, shard)
    batches = _native(spec, segments, findings) if segments is not None else _ahead(_python(spec, shard, findings))
    with contextlib.closing(batches):  # a reading thread stops here, not when the generator is collected
        for ids, inputs, labels in batches:
            if findings.error is not None:
                break
            yield SampleBatch(ids=ids, inputs=inputs, labels=labels, shard=shard)
    if findings.error is not None:
        raise findings.error


def _light(dataset):
    """``dataset`` prefetched two batches ahead on a thread of its own, without tf.data's tuning."""
    import tensorflow as tf

    # A fixed two-batch prefetch needs neither autotuning nor graph rewrites, which cost each range's
    # dataset its start-up time; tf.data's own thread pool competed with the engine's threads for
    # the cores, so reading gets one private thread (benchmarks/README.md).
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    return dataset.prefetch(2).with_options(options)


@beam.typehints.with_input_types(ShardRange)
@beam.typehints.with_output_types(SampleBatch)
class ReadShardFn(beam.DoFn):
    """``ShardRange -> SampleBatch...``: the range's good samples (``shard_batches``)."""

    def __init__(self, spec: JobSpec):
        self._spec = spec

    @no_annotations
    def process(self, shard: ShardRange) -> Iterator[SampleBatch]:
        findings, last = range_findings(self._spec), None
        for batch in shard_batches(self._spec, shard, findings):
            if last is not None:
                yield last
            last = batch
        if last is not None:  # the range's last batch carries what reading it found
            yield dataclasses.replace(last, read=RangeRead(tuple(findings.rejected), findings.samples_sha256))


def _python(spec: JobSpec, shard: ShardRange, findings: RangeFindings) -> Iterator[tuple[np.ndarray, Samples, np.ndarray]]:
    """Any input format: slices read and checked in Python (``checked_slices``), in the compute dtype,
    rebatched across file boundaries so that only the range's last batch is short. An error of the
    reading is kept in ``findings`` (``error``) and ends the batches."""
    dtype, batch_size = spec.engine.compute_dtype, spec.engine.batch_size
    label_key = spec.label_key if spec.engine.needs_labels else None
    held: list[tuple[np.ndarray, Samples, np.ndarray]] = []
    rows = 0
    try:
        for ids, samples, labels in checked_slices(spec.files, shard.start, shard.stop, batch_size, findings, label_key):
            labels = np.zeros(len(ids)) if labels is None else labels.astype(np.float64)
            held.append((ids, as_dtype(samples, dtype), labels))
            rows += len(ids)
            if rows >= batch_size:
                batch = held[0] if len(held) == 1 else _joined(held)
                for start in range(0, rows - batch_size + 1, batch_size):
                    yield _rows(batch, start, start + batch_size)
                held = [_rows(batch, rows - rows % batch_size, rows)] if rows % batch_size else []
                rows %= batch_size
    except Exception as err:  # noqa: BLE001 - raised again by shard_batches, after the batches before it
        findings.error = err
        return
    if rows:
        yield held[0] if len(held) == 1 else _joined(held)


def _joined(parts: list[tuple[np.ndarray, Samples, np.ndarray]]) -> tuple[np.ndarray, Samples, np.ndarray]:
    ids, samples, labels = zip(*parts)
    if isinstance(samples[0], dict):
        joined = {name: np.concatenate([part[name] for part in samples]) for name in samples[0]}
    else:
        joined = np.concatenate(samples)
    return np.concatenate(ids), joined, np.concatenate(labels)


def _rows(batch: tuple[np.ndarray, Samples, np.ndarray], start: int, stop: int) -> tuple[np.ndarray, Samples, np.ndarray]:
    ids, samples, labels = batch
    if start == 0 and stop == len(ids):
        return batch
    samples = {name: values[start:stop] for name, values in samples.items()} if isinstance(samples, dict) else samples[start:stop]
    return ids[start:stop], samples, labels[start:stop]


_AHEAD = 2  # batches read ahead of the one computed


def _ahead(items: Iterator[T]) -> Iterator[T]:
    """``items`` produced on a thread of their own, up to ``_AHEAD`` ahead of the consumer, so that
    reading overlaps the computing downstream. A plain thread where this was ``tf.data``'s
    ``from_generator``, which traced functions for 20 to 35 ms per range: reading 20,000 PNGs took
    43 to 55 us of CPU a file through it, 30 us through the thread (benchmarks/README.md). The consumer
    stopping early stops the thread after the item it is producing (and closes ``items``)."""
    handoff: queue.Queue = queue.Queue(_AHEAD)
    stop, end = threading.Event(), object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(end)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            put(_Failed(err))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="jacobeam-read", daemon=True)
    thread.start()
    try:
        while (item := handoff.get()) is not end:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


@dataclasses.dataclass(frozen=True)
class _Failed:
    error: BaseException


# A range of more files than this is read in Python (``checked_slices`` gathers small files' rows into
# batches): tf.data's chain of one dataset per file costs more per file the longer it is (4,096 one-row
# files read at ~100 samples/s; benchmarks/README.md).
_MOST_SEGMENTS = 16


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Ids ``[start, stop)`` of one local ``.npy`` file whose rows begin at byte ``offset``."""

    source: SourceFile
    offset: int
    start: int
    stop: int


def _npy_segments(spec: JobSpec, shard: ShardRange) -> list[_Segment] | None:
    """The range's samples as segments of local ``.npy`` files whose rows can be read as raw records,
    or None where some are not (other formats, remote files, labels, dtypes other than plain numbers, a
    file that ends before the range's rows: the Python reader finds which rows are missing; a file whose
    header differs from the plan's, rewritten since: the Python reader says how) or where the
    range spans more than ``_MOST_SEGMENTS`` files."""
    if spec.engine.needs_labels:
        return None
    segments: list[_Segment] = []
    for source in overlapping(spec.files, shard.start, shard.stop):
        start, stop = max(shard.start, source.first_id), min(shard.stop, source.stop_id)
        if len(segments) == _MOST_SEGMENTS:
            return None
        if source.key is not None or file_format(source.path) != "npy" or not storage.is_local(source.path):
            return None
        offset = arrays.npy_data_offset(source.path, source.dtype, source.sample_shape)
        if offset is None or os.path.getsize(source.path) < offset + source.row(stop) * row_bytes(source):
            return None
        segments.append(_Segment(source, offset, start, stop))
    return segments


def _native(
    spec: JobSpec, segments: list[_Segment], findings: RangeFindings
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The segments' rows read by TensorFlow's own reader: each segment a ``FixedLengthRecordDataset``
    whose records end where the range's batches do, so that a record is a batch (or, where a batch spans
    files, a part of one, joined here). A record's bytes are its rows (``np.frombuffer``, no copy); a
    ``map`` decoding them in the dataset was a function traced for every range (~20 ms each). Each
    batch's rows are checked and hashed as read (``findings.keep``): a batch may come out shorter."""
    dtype, batch_size, shape = np.dtype(spec.engine.compute_dtype), spec.engine.batch_size, tuple(spec.sample_shape)
    pieces: list[tuple[int, int, np.dtype]] = []  # each record's first id, rows and file dtype, in order
    datasets, filled = [], 0  # filled: rows of the batch under way when a segment begins
    for segment in segments:
        file_dtype = np.dtype(segment.source.dtype)
        records, sizes = _records(segment, batch_size, head=(batch_size - filled) % batch_size)
        datasets.append(records)
        first = segment.start
        for rows in sizes:
            pieces.append((first, rows, file_dtype))
            first += rows
        filled = (filled + segment.stop - segment.start) % batch_size
    dataset = datasets[0]
    for records in datasets[1:]:
        dataset = dataset.concatenate(records)
    parts: list[tuple[np.ndarray, np.ndarray]] = []  # the batch under way, when it spans records
    held, last = 0, len(pieces) - 1
    for k, (record, (first, rows, file_dtype)) in enumerate(zip(_light(dataset), pieces, strict=True)):
        values = np.frombuffer(record.numpy(), file_dtype).reshape((rows, *shape))
        ids, values, _ = findings.keep(np.arange(first, first + rows, dtype=np.int64), values)
        parts.append((ids, values.astype(dtype, copy=False)))
        held += rows
        if findings.error is not None:
            return
        if held == batch_size or k == last:
            ids, values = parts[0] if len(parts) == 1 else (np.concatenate(part) for part in zip(*parts))
            if len(ids):
                yield ids, values, np.zeros(len(ids))
            parts, held = [], 0


def _records(segment: _Segment, batch_size: int, head: int):
    """The segment's rows as raw records: ``head`` rows first (the rest of a batch begun in an earlier
    segment), then ``batch_size`` rows each, the last one shorter; and the rows of each record."""
    import tensorflow as tf

    source = segment.source
    row = row_bytes(source)
    first, last = source.row(segment.start), source.row(segment.stop)
    size = os.path.getsize(source.path)
    head = min(head, last - first)
    full, tail = divmod(last - first - head, batch_size)
    records, sizes, begin = None, [], first
    for rows, count in ((head, 1 if head else 0), (batch_size, full), (tail, 1 if tail else 0)):
        if count:
            part = tf.data.FixedLengthRecordDataset(
                source.path,
                record_bytes=rows * row,
                header_bytes=segment.offset + begin * row,
                footer_bytes=size - segment.offset - (begin + count * rows) * row,
            )
            records = part if records is None else records.concatenate(part)
            sizes += [rows] * count
            begin += count * rows
    return records, sizes


class ReadSamples(beam.PTransform):
    """``PBegin -> PCollection[SampleBatch]``: the samples of a planned job, read from its files.

    Every stored range of the plan is read (a shard already complete on disk too: ``jacobeam run``'s
    ``ComputeShards`` is what keeps those); the ranges are spread over the workers first.

    Args:
        spec: the planned job (``pipeline.plan.make_job(...).spec``): input files, shard ranges, engine
            options (``batch_size``).

    Returns:
        ``SampleBatch`` elements of at most ``spec.engine.batch_size`` samples, each within one shard
        (``SampleBatch.shard``): ``ids`` ``(n,)`` int64, ``inputs`` ``(n, *sample_shape)`` in the compute
        dtype (``{input name: array}`` for several inputs), ``labels`` ``(n,)``. Bad samples
        (``transforms.inputs.checks``) are left out under ``input.on_bad_sample: skip``: a range's last
        batch carries them and the digest of the samples kept (``SampleBatch.read``), which
        ``ComputeJacobians`` hands on and ``WriteShards`` stores in the range's shard.

    Raises:
        InputError: (in the workers) a bad sample under ``input.on_bad_sample: error``.
    """

    def __init__(self, spec: JobSpec):
        super().__init__()
        self._spec = spec

    def expand(self, pbegin):
        return (
            pbegin
            | "ShardRanges" >> beam.Create(self._spec.ranges())
            | "Spread" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(ReadShardFn(self._spec)).with_output_types(SampleBatch)
        )
