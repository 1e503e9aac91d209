"""Reading a planned job's samples: a shard range in, batches of samples out.

Each range is one unit of work: ``shard_batches`` streams a range's samples through ``tf.data`` (file
slices, rebatched across file boundaries, prefetched so that reading overlaps the computing
downstream). Local ``.npy`` files are read by TensorFlow's own ``FixedLengthRecordDataset``, with no
Python per batch (faster end to end: benchmarks/README.md); other files are read in slices in Python
(``readers.iter_slices``) and handed over through ``Dataset.from_generator``. Samples that the plan
rejected (``input.on_bad_sample: skip``) are never read.

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
    for ids, inputs, labels in _dataset(spec, shard):
        # np.asarray: read-only views of the tensors' buffers, where .numpy() would copy them.
        inputs = {k: np.asarray(v) for k, v in inputs.items()} if isinstance(inputs, dict) else np.asarray(inputs)
        ids = np.asarray(ids)
        _check_finite(spec, ids, inputs)
        yield SampleBatch(ids=ids, inputs=inputs, labels=np.asarray(labels), shard=shard)


def _dataset(spec: JobSpec, shard: ShardRange):
    """tf.data over the range's kept samples; only the range's last batch can be short."""
    import tensorflow as tf

    segments = _npy_segments(spec, shard)
    dataset = _native(spec, segments) if segments is not None else _from_generator(spec, shard)
    # A fixed two-batch prefetch needs neither autotuning nor graph rewrites, which cost each range's
    # dataset its start-up time; tf.data's own thread pool competed with the engine's threads for
    # the cores, so reading gets one private thread (benchmarks/README.md).
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    return dataset.rebatch(spec.engine.batch_size).prefetch(2).with_options(options)


# Beam's type hints are declared (with_input_types/with_output_types); it cannot resolve this module's
# annotations (strings: ``from __future__ import annotations``), so ``no_annotations`` keeps them for readers.
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
    """The range's kept samples as segments of local ``.npy`` files that TensorFlow can read natively,
    or None where some are not (other formats, remote files, labels, dtypes ``decode_raw`` lacks)."""
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


def _native(spec: JobSpec, segments: list[_Segment]):
    """The segments' rows read by TensorFlow's own reader, with no Python per batch: each segment a
    ``FixedLengthRecordDataset`` of one record per batch, seeking past the rows before it."""
    import tensorflow as tf

    dtype, batch_size, shape = spec.engine.compute_dtype, spec.engine.batch_size, tuple(spec.sample_shape)
    dataset = None
    for segment in segments:
        file_dtype = tf.as_dtype(np.dtype(segment.source.dtype))

        def decode(ids, record, file_dtype=file_dtype):
            values = tf.cast(tf.reshape(tf.io.decode_raw(record, file_dtype), (-1, *shape)), dtype)
            return ids, values, tf.zeros(tf.shape(ids), tf.float64)

        ids = tf.data.Dataset.range(segment.start, segment.stop).batch(batch_size)
        part = tf.data.Dataset.zip((ids, _records(segment, batch_size))).map(decode)
        dataset = part if dataset is None else dataset.concatenate(part)
    return dataset


def _records(segment: _Segment, batch_size: int):
    """The segment's rows as raw records of ``batch_size`` rows, the last one shorter."""
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
    full, tail = divmod(last - first, batch_size)
    records = None
    for rows, begin, count in ((batch_size, first, full), (tail, first + full * batch_size, 1 if tail else 0)):
        if count:
            part = tf.data.FixedLengthRecordDataset(
                source.path,
                record_bytes=rows * row,
                header_bytes=segment.offset + begin * row,
                footer_bytes=size - segment.offset - (begin + count * rows) * row,
            )
            records = part if records is None else records.concatenate(part)
    return records


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
