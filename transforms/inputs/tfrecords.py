"""TFRecord files of ``tf.train.Example`` records: one record per sample, each input a float feature.

``input.key`` names the feature (``{input name: feature}`` for several inputs), and
``input.sample_shape`` gives a sample's shape: a feature is a flat list of floats. Counting a file's
samples reads the record boundaries only (each record's 12-byte length header, then a seek past its
data: ``count_records``), through Beam's ``FileSystems``; a ``.gz`` file (GZIP-compressed) cannot be
seeked and is read through. Samples are read through TensorFlow's own file systems, records streamed in
batches: a slice is read by streaming past the records before it. TensorFlow is imported only when
samples are read (or a ``.gz`` file counted).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator, Mapping

import numpy as np

from jacobeam.transforms.errors import CorruptInputError, InputError, first_line, span
from jacobeam.transforms.inputs.types import ImageOptions, Key, Samples, Shape, SourceFile
from jacobeam.transforms.output import storage

SUFFIXES = {".tfrecord": "tfrecord", ".tfrecords": "tfrecord", ".tfrecord.gz": "tfrecord", ".tfrecords.gz": "tfrecord"}


def _features(key: Key, shape: Shape | None, path: str) -> dict[str | None, tuple[str, tuple[int, ...]]]:
    """``{input name (None for one input): (feature name, sample shape)}``."""
    if key is None:
        raise InputError(f"{path}: a TFRecord file needs input.key, the name of the float feature that holds each sample")
    if shape is None:
        raise InputError(
            f"{path}: a TFRecord file needs input.sample_shape, the shape of one sample (e.g. [8, 8, 1]): "
            "its feature is a flat list of floats"
        )
    if isinstance(key, Mapping):
        return {name: (feature, tuple(shape[name])) for name, feature in key.items()}
    return {None: (key, tuple(shape))}


_RECORD_BATCH = 256  # records read per step of a TFRecord stream


def _record_stream(path: str, start: int = 0) -> Iterator[bytes]:
    """The records of a TFRecord file from index ``start`` on, streamed. They are read in batches
    (a dataset's per-element cost is many times its per-record cost in batches); at a damaged
    record the batch holding it is read again one record at a time, so that every record before it
    arrives before the ``DataLossError``."""
    import tensorflow as tf

    compression = "GZIP" if path.lower().endswith(".gz") else ""
    dataset = tf.data.TFRecordDataset(path, compression_type=compression).skip(start)
    delivered = 0  # records of complete batches
    try:
        for batch in dataset.batch(_RECORD_BATCH):
            yield from batch.numpy()
            delivered += len(batch)
    except tf.errors.DataLossError:
        yield from (record.numpy() for record in dataset.skip(delivered))  # raises at the damaged record
        raise


class TFRecords:
    """The samples of a TFRecord file of ``tf.train.Example`` records, one record per sample, each
    input a float feature. A TFRecord file cannot be seeked: a slice is read by streaming past the
    records before it, and consecutive slices continue one stream (a slice before the stream's position
    starts it again)."""

    def __init__(self, path: str, key: Key, shape: Shape):
        self._path = path
        self._features = _features(key, shape, path)
        self._stream: Iterator[bytes] | None = None
        self._next = 0  # index of the record the stream yields next

    def read(self, start: int, stop: int) -> Samples:
        records = self._records(start, stop)
        parsed = {name: self._parse(records, start, feature, shape) for name, (feature, shape) in self._features.items()}
        return parsed[None] if None in parsed else parsed

    def _records(self, start: int, stop: int) -> list[bytes]:
        import tensorflow as tf

        if self._stream is None or self._next > start:
            self._stream, self._next = _record_stream(self._path, start), start
        records = []
        try:
            while self._next < stop:
                record = next(self._stream)
                if self._next >= start:
                    records.append(record)
                self._next += 1
        except StopIteration:
            self._stream = None
            raise CorruptInputError(
                f"{self._path}: truncated: {span(self._next, stop, 'record')} past the end of the file",
                reason="truncated: the record is past the end of the file",
            ) from None
        except tf.errors.OpError as err:  # a damaged record (DataLossError), a read error
            self._stream = None
            raise CorruptInputError(
                f"{self._path}: record {self._next}: {first_line(err)}", reason=f"corrupt: {first_line(err)}"
            ) from err
        return records

    def _parse(self, records: list[bytes], start: int, feature: str, shape: tuple[int, ...]) -> np.ndarray:
        """The float feature ``feature`` of ``records`` as ``(len(records), *shape)`` float32; a record
        that does not hold exactly such a feature is a ``CorruptInputError`` naming it."""
        import tensorflow as tf

        size = int(np.prod(shape, dtype=np.int64))
        try:
            values = tf.io.parse_example(
                records, {feature: tf.io.RaggedFeature(tf.float32, row_splits_dtype=tf.int64)}
            )[feature]
        except tf.errors.InvalidArgumentError as err:  # not an Example, or the feature is not a float list
            if len(records) > 1:  # which record
                for offset, record in enumerate(records):
                    self._parse([record], start + offset, feature, shape)
            raise CorruptInputError(f"{self._path}: record {start}: {first_line(err)}", reason=first_line(err)) from err
        lengths = values.row_lengths().numpy()
        for offset in np.flatnonzero(lengths != size):
            found = int(lengths[offset])
            if found == 0 and feature not in tf.train.Example.FromString(records[offset]).features.feature:
                reason = f"feature {feature!r} is missing"
            else:
                reason = f"feature {feature!r} holds {found} values; expected {size} (input.sample_shape {list(shape)})"
            raise CorruptInputError(f"{self._path}: record {start + int(offset)}: {reason}", reason=reason)
        return values.flat_values.numpy().reshape((len(records), *shape))


def open_samples(source: SourceFile) -> contextlib.AbstractContextManager[TFRecords]:
    """A file's records, for reading in slices (a stream, opened on the first read)."""
    return contextlib.nullcontext(TFRecords(source.path, source.key, source.sample_shape))


def _masked_crc(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def count_records(path: str) -> int:
    """The records of an uncompressed TFRecord file, from their boundaries: each record's length and its
    checksum are read, its data seeked past. A record whose length fails its checksum, or which the file
    ends inside, ends what can be located: it counts as the file's last record, a bad one that the worker
    that reads it rejects; a file damaged from its first record is unreadable."""
    # Beam's own buffer (16 MiB ranges of a remote file), not the small one of a header: the boundaries
    # run through the whole file, and a seek within the buffer costs no request, where 4 KiB ranges were
    # a request per few records.
    with storage.open_input(path) as stream:
        size = stream.seek(0, os.SEEK_END)
        stream.seek(0)
        count, offset = 0, 0
        while offset < size:
            header = stream.read(12)
            length, crc = struct.unpack("<QI", header) if len(header) == 12 else (None, None)
            if length is None or crc != _masked_crc(header[:8]) or offset + 16 + length > size:
                if count == 0:
                    raise CorruptInputError(f"{path}: not a valid TFRecord file: corrupted record at {offset}",
                                            reason=f"corrupt: not a valid TFRecord file: corrupted record at {offset}")
                return count + 1
            offset += 16 + length
            stream.seek(offset)
            count += 1
        return count


def _stream_count(path: str) -> int:
    """The records of a GZIP-compressed TFRecord file, streamed through (see ``count_records``)."""
    import tensorflow as tf

    count = 0
    try:
        for _ in _record_stream(path):
            count += 1
    except tf.errors.DataLossError as err:
        if count == 0:
            raise CorruptInputError(
                f"{path}: not a valid TFRecord file: {first_line(err)}",
                reason=f"corrupt: not a valid TFRecord file: {first_line(err)}",
            ) from err
        count += 1
    except tf.errors.OpError as err:  # cannot be opened: not found, permissions, an I/O error
        raise CorruptInputError(
            f"{path}: cannot open: {first_line(err)}", reason=f"unreadable: {first_line(err)}"
        ) from err
    return count


def describe(path: str, key: Key, sample_shape: Shape | None, image: ImageOptions | None = None) -> SourceFile:
    """How many samples (``count_records``), their shape(s) (from ``input.sample_shape``) and dtype(s)
    (float32)."""
    features = _features(key, sample_shape, path)
    count = _stream_count(path) if path.lower().endswith(".gz") else count_records(path)
    shapes = {name: shape for name, (_, shape) in features.items()}
    return SourceFile(
        path=path,
        key=dict(key) if isinstance(key, Mapping) else key,
        num_samples=count,
        sample_shape=shapes[None] if None in shapes else shapes,
        dtype="float32" if None in shapes else {name: "float32" for name in shapes},
    )
