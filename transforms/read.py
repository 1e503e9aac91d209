"""Reading a planned job's samples: a shard range in, batches of samples out.

Each range is one unit of work: ``shard_batches`` streams a range's samples through ``tf.data`` (file
slices, rebatched across file boundaries, prefetched so that reading overlaps the computing
downstream). Local ``.npy`` files are read by TensorFlow's own ``FixedLengthRecordDataset``, one record
per batch, whose bytes numpy takes as they are: no Python per batch beyond that, and no ``tf.data``
function to trace per range (faster end to end: benchmarks/README.md); other files are read in slices
in Python (``readers.iter_slices``) and handed over through ``Dataset.from_generator``. Samples that
the plan rejected (``input.on_bad_sample: skip``) are never read.

``jacobeam run`` reads inside ``ComputeShards`` (``transforms.job``: read, compute and write one range
per element); ``ReadSamples`` is the same reading as a transform of its own, for a pipeline of your own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import apache_beam as beam
import numpy as np
from apache_beam.typehints.decorators import no_annotations

from jacobeam.transforms.elements import SampleBatch
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs import arrays
from jacobeam.transforms.inputs.readers import as_dtype, iter_slices, nonfinite_rows, row_bytes, tensor_spec
from jacobeam.transforms.inputs.registry import file_format
from jacobeam.transforms.inputs.types import Samples, SourceFile
from jacobeam.transforms.output import storage
from jacobeam.transforms.spec import JobSpec, ShardRange


def shard_batches(spec: JobSpec, shard: ShardRange) -> Iterator[SampleBatch]:
    """The range's kept samples as ``SampleBatch``es of at most ``spec.engine.batch_size`` (only the last
    one shorter), in id order, read by ``tf.data``."""
    segments = _npy_segments(spec, shard)
    batches = _native(spec, segments) if segments is not None else _tensors(_dataset(spec, shard))
    for ids, inputs, labels in batches:
        _check_finite(spec, ids, inputs)
        yield SampleBatch(ids=ids, inputs=inputs, labels=labels, shard=shard)


def _tensors(dataset) -> Iterator[tuple[np.ndarray, Samples, np.ndarray]]:
    for ids, inputs, labels in dataset:
        # np.asarray: read-only views of the tensors' buffers, where .numpy() would copy them.
        inputs = {k: np.asarray(v) for k, v in inputs.items()} if isinstance(inputs, dict) else np.asarray(inputs)
        yield np.asarray(ids), inputs, np.asarray(labels)


def _dataset(spec: JobSpec, shard: ShardRange):
    """tf.data over the range's kept samples (any format); only the range's last batch can be short."""
    return _light(_from_generator(spec, shard).rebatch(spec.engine.batch_size))


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
    """``ShardRange -> SampleBatch...``: the range's kept samples (``shard_batches``)."""

    def __init__(self, spec: JobSpec):
        self._spec = spec

    @no_annotations
    def process(self, shard: ShardRange) -> Iterator[SampleBatch]:
        yield from shard_batches(self._spec, shard)


def _from_generator(spec: JobSpec, shard: ShardRange):
    """Any input format: slices read in Python (``iter_slices``), handed to ``tf.data``."""
    import tensorflow as tf

    dtype, batch_size = spec.engine.compute_dtype, spec.engine.batch_size
    label_key = spec.label_key if spec.engine.outputs.rule == "label" else None

    def slices():
        for lo, hi in shard.kept():
            for ids, samples, labels in iter_slices(spec.files, lo, hi, batch_size, label_key):
                labels = np.zeros(len(ids)) if labels is None else labels.astype(np.float64)
                yield ids, as_dtype(samples, dtype), labels

    # Samples are one tensor, or a dict of tensors by input name (a model with several inputs).
    signature = (
        tf.TensorSpec((None,), tf.int64),
        tensor_spec(spec.sample_shape, dtype),
        tf.TensorSpec((None,), tf.float64),
    )
    return tf.data.Dataset.from_generator(slices, output_signature=signature)


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Ids ``[start, stop)`` of one local ``.npy`` file whose rows begin at byte ``offset``."""

    source: SourceFile
    offset: int
    start: int
    stop: int


def _npy_segments(spec: JobSpec, shard: ShardRange) -> list[_Segment] | None:
    """The range's kept samples as segments of local ``.npy`` files whose rows can be read as raw records,
    or None where some are not (other formats, remote files, labels, dtypes other than plain numbers)."""
    if spec.engine.outputs.rule == "label":
        return None
    segments: list[_Segment] = []
    for lo, hi in shard.kept():
        for source in spec.files:
            start, stop = max(lo, source.first_id), min(hi, source.stop_id)
            if start >= stop:
                continue
            if source.key is not None or file_format(source.path) != "npy" or not storage.is_local(source.path):
                return None
            offset = arrays.npy_data_offset(source.path)
            if offset is None:
                return None
            segments.append(_Segment(source, offset, start, stop))
    return segments


def _native(spec: JobSpec, segments: list[_Segment]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The segments' rows read by TensorFlow's own reader: each segment a ``FixedLengthRecordDataset``
    whose records end where the range's batches do, so that a record is a batch (or, where a batch spans
    files, a part of one, joined here). A record's bytes are its rows (``np.frombuffer``, no copy); a
    ``map`` decoding them in the dataset was a function traced for every range (~20 ms each)."""
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
        values = np.frombuffer(record.numpy(), file_dtype).reshape((rows, *shape)).astype(dtype, copy=False)
        parts.append((np.arange(first, first + rows, dtype=np.int64), values))
        held += rows
        if held == batch_size or k == last:
            ids, values = parts[0] if len(parts) == 1 else (np.concatenate(part) for part in zip(*parts))
            yield ids, values, np.zeros(len(ids))
            parts, held = [], 0


def _records(segment: _Segment, batch_size: int, head: int):
    """The segment's rows as raw records: ``head`` rows first (the rest of a batch begun in an earlier
    segment), then ``batch_size`` rows each, the last one shorter; and the rows of each record."""
    import tensorflow as tf

    source = segment.source
    row = row_bytes(source)
    first, last = segment.start - source.first_id, segment.stop - source.first_id
    size = os.path.getsize(source.path)
    if size < segment.offset + last * row:
        raise InputError(
            f"{source.path}: truncated: rows {first}..{last} are past the end of the data, which they were "
            "not when the run was planned; the input file changed during the run"
        )
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


def _check_finite(spec: JobSpec, ids: np.ndarray, samples: Samples) -> None:
    """The plan scanned every input; a non-finite sample it did not reject means the file changed since."""
    bad = nonfinite_rows(samples)
    if bad.any():
        sample_id = int(ids[int(np.argmax(bad))])
        source = next(f for f in spec.files if f.first_id <= sample_id < f.stop_id)
        raise InputError(
            f"{source.path}: row {sample_id - source.first_id} (sample id {sample_id}) holds NaN or Inf but "
            "did not when the run was planned; the input file changed during the run"
        )


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
        dtype (``{input name: array}`` for several inputs), ``labels`` ``(n,)``. Samples the plan
        rejected are left out (``spec.rejected()`` lists them).

    Raises:
        InputError, CorruptInputError: (in the workers) an input file that changed since the plan, or
            a bad sample under ``input.on_bad_sample: error``.
    """

    def __init__(self, spec: JobSpec):
        super().__init__()
        self._spec = spec

    def expand(self, pbegin):
        return (
            pbegin
            | "ShardRanges" >> beam.Create(self._spec.stored_ranges())
            | "Spread" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(ReadShardFn(self._spec)).with_output_types(SampleBatch)
        )
