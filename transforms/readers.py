"""Reading input samples from ``.npy``, ``.npz``, ``.h5``/``.hdf5`` and TFRecord files and from PNG/JPEG
images, in slices.

Every array file holds samples along its first axis; a TFRecord file holds one ``tf.train.Example``
per sample; an image file is one sample. Files are opened through Beam's ``FileSystems`` so that
remote paths work the same as local ones (TFRecord files through TensorFlow's own file systems), and
rows are read in slices: a file is never loaded whole. Sample ids are positions in the concatenation
of the input files (see ``pipeline.plan`` for how files are placed: sorted path order, new files of an
incremental run after the old ones). TensorFlow is imported only to read TFRecord files and images.

A model with several inputs reads one array per input from each file: ``input.key`` is then a mapping
``{input name: array key}``, and samples are dicts ``{input name: rows}`` (``Samples``). The arrays of
one file hold one row per sample each.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import os
import re
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, Protocol, Union

import numpy as np

from transforms.errors import CorruptInputError, InputError

FORMATS = {
    ".npy": "npy", ".npz": "npz", ".h5": "h5", ".hdf5": "h5",
    ".tfrecord": "tfrecord", ".tfrecords": "tfrecord", ".tfrecord.gz": "tfrecord", ".tfrecords.gz": "tfrecord",
    ".png": "image", ".jpg": "image", ".jpeg": "image",
}
IMAGE_SUFFIXES = tuple(suffix for suffix, fmt in FORMATS.items() if fmt == "image")
_ARRAY_FORMATS = ("npy", "npz", "h5")

# input.key: one array (None: the file's only one), or {input name: array key} for several inputs.
Key = Union[str, Mapping[str, str], None]
# One sample's shape, or {input name: shape}; rows of samples: one array, or {input name: array}.
Shape = Union[tuple[int, ...], Mapping[str, tuple[int, ...]]]
Samples = Union[np.ndarray, Mapping[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """How an image file becomes a sample (``input.image``): decoded to 8-bit values ``(H, W, C)``,
    resized (bilinear) to ``size`` if given, converted to ``channels`` if given, then ``x * scale`` and
    ``(x - mean) / std`` (numbers, or one per channel)."""

    size: tuple[int, int] | None = None
    channels: int | None = None
    scale: float = 1 / 255
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def from_config(cls, image: Mapping[str, Any] | None) -> ImageOptions:
        """From ``input.image`` as plain data (the config, or a manifest's copy of it)."""
        image = dict(image or {})

        def numbers(value: Any) -> tuple[float, ...] | None:
            return None if value is None else tuple(float(v) for v in (value if isinstance(value, list) else [value]))

        size = image.get("size")
        return cls(
            size=None if size is None else (int(size[0]), int(size[1])),
            channels=image.get("channels"),
            scale=float(image.get("scale", 1 / 255)),
            mean=numbers(image.get("mean")),
            std=numbers(image.get("std")),
        )


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One input file and the sample ids it covers: ``[first_id, first_id + num_samples)``.

    When ``key`` is a mapping (a model with several inputs), ``sample_shape`` and ``dtype`` are
    mappings by input name too.
    """

    path: str
    key: Key
    num_samples: int
    sample_shape: Shape
    dtype: str | Mapping[str, str]
    first_id: int = 0
    data_sha256: str | None = None  # sha256 of the readable rows' bytes, set by the input scan (an image's file bytes)
    unreadable: str | None = None  # why a file that cannot be opened holds no samples (on_bad_sample: skip)
    image: ImageOptions | None = None  # for an image file: how it is decoded

    @property
    def stop_id(self) -> int:
        return self.first_id + self.num_samples


class _Rows(Protocol):
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, start: int, stop: int) -> np.ndarray: ...


def file_format(path: str) -> str:
    for suffix, fmt in FORMATS.items():
        if path.lower().endswith(suffix):
            return fmt
    raise InputError(f"{path}: unsupported file type; expected one of {', '.join(FORMATS)}")


def _open_binary(path: str) -> IO[bytes]:
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    try:
        return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    except Exception as err:  # Beam wraps every file-system failure in its own error types.
        raise CorruptInputError(f"{path}: cannot open: {err}", reason=f"unreadable: {err}") from err


class _NpyRows:
    """Rows of a C-ordered ``.npy`` stream, read by seeking: no memory map, no full load."""

    def __init__(self, stream: IO[bytes], name: str):
        fmt = np.lib.format
        try:
            version = fmt.read_magic(stream)
            header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            self.shape, fortran_order, self.dtype = header(stream)
        except ValueError as err:
            raise CorruptInputError(f"{name}: not a valid .npy array: {err}", reason=f"corrupt: not a valid .npy array: {err}") from err
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:  # a damaged .npz member, a read error
            raise CorruptInputError(f"{name}: cannot be read: {err}", reason=f"corrupt: {err}") from err
        if fortran_order and len(self.shape) > 1:
            raise InputError(f"{name}: Fortran-ordered arrays cannot be read in slices; save it C-ordered")
        if self.dtype.hasobject:
            raise InputError(f"{name}: holds Python objects, expected a float array")
        self._stream, self._name = stream, name
        self._offset = stream.tell()
        self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        count = stop - start
        try:
            self._stream.seek(self._offset + start * self._row_bytes)
            data = self._stream.read(count * self._row_bytes)
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:  # e.g. a corrupt .npz member
            raise CorruptInputError(
                f"{self._name}: rows {start}..{stop} cannot be read: {err}", reason=f"corrupt: {err}"
            ) from err
        if len(data) != count * self._row_bytes:
            raise CorruptInputError(
                f"{self._name}: truncated: rows {start}..{stop} are past the end of the data",
                reason="truncated: the row is past the end of the data",
            )
        return np.frombuffer(data, dtype=self.dtype).reshape((count, *self.shape[1:]))


class _H5Rows:
    def __init__(self, dataset, name: str):
        self.shape, self.dtype = dataset.shape, dataset.dtype
        self._dataset, self._name = dataset, name

    def read(self, start: int, stop: int) -> np.ndarray:
        try:
            return self._dataset[start:stop]
        except OSError as err:  # a damaged chunk (failed filter or checksum), a short file
            raise CorruptInputError(
                f"{self._name}: rows {start}..{stop} cannot be read: {err}", reason=f"corrupt: {err}"
            ) from err



class _Inputs:
    """The arrays of a several-input file, read together: ``{input name: rows}``."""

    def __init__(self, rows: Mapping[str, _Rows]):
        self._rows = rows

    def read(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return {name: rows.read(start, stop) for name, rows in self._rows.items()}


# --- TFRecord files -----------------------------------------------------------------------------------


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


def _first_line(err: Exception) -> str:
    """The gist of an error: its first line, without TensorFlow's op decorations."""
    text = (str(getattr(err, "message", None) or err).strip().splitlines() or [type(err).__name__])[0][:300]
    return re.sub(r"\s*\[Op:\w+\]( name:.*)?$", "", re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text))


def _record_stream(path: str, start: int = 0) -> Iterator[bytes]:
    """The records of a TFRecord file from index ``start`` on, streamed. They are read in batches
    (iterating a dataset costs about 60 µs per element, 4 µs per record in batches); at a damaged
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


class _TFRecords:
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
                f"{self._path}: truncated: records {self._next}..{stop} are past the end of the file",
                reason="truncated: the record is past the end of the file",
            ) from None
        except tf.errors.OpError as err:  # a damaged record (DataLossError), a read error
            self._stream = None
            raise CorruptInputError(f"{self._path}: record {self._next}: {_first_line(err)}", reason=f"corrupt: {_first_line(err)}") from err
        return records

    def _parse(self, records: list[bytes], start: int, feature: str, shape: tuple[int, ...]) -> np.ndarray:
        """The float feature ``feature`` of ``records`` as ``(len(records), *shape)`` float32; a record
        that does not hold exactly such a feature is a ``CorruptInputError`` naming it."""
        import tensorflow as tf

        size = int(np.prod(shape, dtype=np.int64))
        try:
            values = tf.io.parse_example(records, {feature: tf.io.RaggedFeature(tf.float32, row_splits_dtype=tf.int64)})[feature]
        except tf.errors.InvalidArgumentError as err:  # not an Example, or the feature is not a float list
            if len(records) > 1:  # which record
                for offset, record in enumerate(records):
                    self._parse([record], start + offset, feature, shape)
            raise CorruptInputError(f"{self._path}: record {start}: {_first_line(err)}", reason=_first_line(err)) from err
        lengths = values.row_lengths().numpy()
        for offset in np.flatnonzero(lengths != size):
            found = int(lengths[offset])
            if found == 0 and feature not in tf.train.Example.FromString(records[offset]).features.feature:
                reason = f"feature {feature!r} is missing"
            else:
                reason = f"feature {feature!r} holds {found} values; expected {size} (input.sample_shape {list(shape)})"
            raise CorruptInputError(f"{self._path}: record {start + int(offset)}: {reason}", reason=reason)
        return values.flat_values.numpy().reshape((len(records), *shape))


def _describe_tfrecord(path: str, key: Key, shape: Shape | None) -> SourceFile:
    """Count the records, streaming through the file. A damaged record ends what can be read (the
    records after it cannot be located): it counts as the file's last sample, a bad one that the scan
    finds; a file damaged from its first record is unreadable."""
    import tensorflow as tf

    features = _features(key, shape, path)
    count = 0
    try:
        for _ in _record_stream(path):
            count += 1
    except tf.errors.DataLossError as err:
        if count == 0:
            raise CorruptInputError(f"{path}: not a valid TFRecord file: {_first_line(err)}",
                                    reason=f"corrupt: not a valid TFRecord file: {_first_line(err)}") from err
        count += 1
    except tf.errors.OpError as err:  # cannot be opened: not found, permissions, an I/O error
        raise CorruptInputError(f"{path}: cannot open: {_first_line(err)}", reason=f"unreadable: {_first_line(err)}") from err
    shapes = {name: shape for name, (_, shape) in features.items()}
    return SourceFile(
        path=path,
        key=dict(key) if isinstance(key, Mapping) else key,
        num_samples=count,
        sample_shape=shapes[None] if None in shapes else shapes,
        dtype="float32" if None in shapes else {name: "float32" for name in shapes},
    )


# --- image files ---------------------------------------------------------------------------------------


def _decode_image(path: str, data: bytes, options: ImageOptions) -> np.ndarray:
    """An image file's bytes as one sample ``(H, W, C)`` float32 (see ``ImageOptions``)."""
    import tensorflow as tf

    channels = options.channels or 0
    try:
        if tf.io.is_jpeg(data):  # decode_image's JPEG default is the fast, less accurate IDCT
            pixels = tf.io.decode_jpeg(data, channels=channels, dct_method="INTEGER_ACCURATE")
        else:
            pixels = tf.io.decode_image(data, channels=channels, dtype=tf.uint8, expand_animations=False)
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        raise CorruptInputError(f"{path}: cannot be decoded as an image: {_first_line(err)}",
                                reason=f"corrupt: cannot be decoded as an image: {_first_line(err)}") from err
    values = tf.cast(pixels, tf.float32)
    if options.size is not None:
        values = tf.image.resize(values, options.size, method="bilinear")
    values = values.numpy() * np.float32(options.scale)
    if options.mean is not None:
        values -= np.asarray(options.mean, np.float32)
    if options.std is not None:
        values /= np.asarray(options.std, np.float32)
    return values


def _image_bytes(path: str) -> bytes:
    with _open_binary(path) as stream:
        try:
            return stream.read()
        except OSError as err:
            raise CorruptInputError(f"{path}: cannot be read: {err}", reason=f"unreadable: {err}") from err


class _Image:
    """An image file: one sample (row 0)."""

    def __init__(self, path: str, options: ImageOptions):
        self._path, self._options = path, options

    def read(self, start: int, stop: int) -> np.ndarray:
        return _decode_image(self._path, _image_bytes(self._path), self._options)[None][start:stop]


def _describe_image(path: str, key: Key, options: ImageOptions) -> SourceFile:
    if key is not None:
        raise InputError(f"{path}: an image is one sample; input.key ({key}) is for .npz, .h5 and TFRecord files")
    data = _image_bytes(path)
    sample = _decode_image(path, data, options)
    return SourceFile(
        path=path, key=None, num_samples=1, sample_shape=sample.shape, dtype="float32",
        data_sha256=hashlib.sha256(data).hexdigest(), image=options,
    )


def _read_images(sources: Sequence[SourceFile]) -> np.ndarray:
    """Many image files at once, decoded in threads (decoding releases the GIL): ``(len(sources), H, W, C)``."""
    def one(source: SourceFile) -> np.ndarray:
        return _decode_image(source.path, _image_bytes(source.path), source.image or ImageOptions())

    with concurrent.futures.ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1, 8)) as pool:
        return np.stack(list(pool.map(one, sources)))


# --- arrays: .npy, .npz, .h5 ---------------------------------------------------------------------------


def _pick_member(names: Sequence[str], key: str | None, path: str, what: str, setting: str) -> str:
    if key is not None:
        if key not in names:
            raise InputError(f"{path}: no {what} {key!r} ({setting}); found {sorted(names)}")
        return key
    if len(names) != 1:
        raise InputError(f"{path}: holds {what}s {sorted(names)}; set {setting} to choose one")
    return names[0]


@contextlib.contextmanager
def _open_arrays(path: str, keys: Mapping[str, str | None]) -> Iterator[dict[str, _Rows]]:
    """Open arrays of one file for reading rows in slices. ``keys`` maps the config setting that names
    an array (``input.key``, ``input.key.<input>``: for messages) to its key; so does the result."""
    fmt = file_format(path)
    if fmt not in _ARRAY_FORMATS:
        raise InputError(f"{path}: {', '.join(keys)} names arrays of .npy, .npz and .h5 files; this is a {fmt} file")
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(_open_binary(path))
        if fmt == "npy":
            if len(keys) > 1:
                raise InputError(
                    f"{path}: a .npy file holds one array, but {', '.join(keys)} name one array per input; "
                    "keep several inputs in .npz or .h5 files"
                )
            yield {setting: _NpyRows(stream, path) for setting in keys}
        elif fmt == "npz":
            try:
                archive = stack.enter_context(zipfile.ZipFile(stream))
            except zipfile.BadZipFile as err:
                raise CorruptInputError(f"{path}: not a valid .npz archive: {err}", reason=f"corrupt: not a valid .npz archive: {err}") from err
            arrays = [name[: -len(".npy")] for name in archive.namelist() if name.endswith(".npy")]
            opened = {}
            for setting, key in keys.items():
                member = _pick_member(arrays, key, path, "array", setting)
                opened[setting] = _NpyRows(stack.enter_context(archive.open(member + ".npy")), f"{path}[{member}]")
            yield opened
        else:
            import h5py

            try:
                h5 = stack.enter_context(h5py.File(stream, "r"))
            except OSError as err:
                raise CorruptInputError(f"{path}: not a valid HDF5 file: {err}", reason=f"corrupt: not a valid HDF5 file: {err}") from err
            opened = {}
            for setting, key in keys.items():
                if key is None:
                    datasets = [name for name, item in h5.items() if isinstance(item, h5py.Dataset)]
                    key = _pick_member(datasets, None, path, "dataset", setting)
                dataset = h5.get(key)
                if not isinstance(dataset, h5py.Dataset):
                    raise InputError(f"{path}: no dataset {key!r} ({setting})")
                opened[setting] = _H5Rows(dataset, f"{path}[{key}]")
            yield opened


def _settings(key: Mapping[str, str]) -> dict[str, str]:
    """``{input name: array key}`` -> ``{"input.key.<input name>": array key}``."""
    return {f"input.key.{name}": array for name, array in key.items()}


@contextlib.contextmanager
def open_rows(path: str, key: str | None, setting: str = "input.key") -> Iterator[_Rows]:
    """Open one array of a file (``key``, named by the config's ``setting``), for reading rows in slices."""
    with _open_arrays(path, {setting: key}) as opened:
        yield opened[setting]


@contextlib.contextmanager
def open_samples(source: SourceFile) -> Iterator[Any]:
    """Open a file's samples for reading in slices: ``read(start, stop)`` returns ``(rows, *shape)``,
    or ``{input name: (rows, *shape)}`` when ``source.key`` maps inputs to arrays."""
    fmt = file_format(source.path)
    if fmt == "tfrecord":
        yield _TFRecords(source.path, source.key, source.sample_shape)
        return
    if fmt == "image":
        yield _Image(source.path, source.image or ImageOptions())
        return
    if not isinstance(source.key, Mapping):
        with open_rows(source.path, source.key) as rows:
            yield rows
        return
    with _open_arrays(source.path, _settings(source.key)) as opened:
        yield _Inputs({name: opened[f"input.key.{name}"] for name in source.key})


def _header(where: str, rows: _Rows) -> tuple[tuple[int, ...], str]:
    """An array's shape and dtype, checked: samples along the first axis, floats."""
    shape, dtype = tuple(int(d) for d in rows.shape), np.dtype(rows.dtype)
    if len(shape) < 2:
        raise InputError(
            f"{where}: array of shape {shape}; expected samples along the first axis, "
            "i.e. shape (num_samples, *sample_shape) with at least one sample axis"
        )
    if not np.issubdtype(dtype, np.floating):
        raise InputError(f"{where}: dtype {dtype}; expected a float array (float16, float32 or float64)")
    return shape, dtype.name


def describe(path: str, key: Key, sample_shape: Shape | None = None, image: ImageOptions | None = None) -> SourceFile:
    """Read a file's header(s) only: how many samples, their shape(s) and dtype(s). A TFRecord file is
    read through to count its records (it has no header); its ``sample_shape`` comes from the config.
    An image is decoded (it is its only sample): its shape, and the sha256 of its bytes."""
    fmt = file_format(path)
    if fmt == "tfrecord":
        return _describe_tfrecord(path, key, sample_shape)
    if fmt == "image":
        return _describe_image(path, key, image or ImageOptions())
    if not isinstance(key, Mapping):
        with open_rows(path, key) as rows:
            shape, dtype = _header(path, rows)
        return SourceFile(path=path, key=key, num_samples=shape[0], sample_shape=shape[1:], dtype=dtype)
    with _open_arrays(path, _settings(key)) as opened:
        found = {
            name: _header(f"{path}: array {array!r} (input.key.{name})", opened[f"input.key.{name}"])
            for name, array in key.items()
        }
    (first, (first_shape, _)), *others = found.items()
    for name, (shape, _) in others:
        if shape[0] != first_shape[0]:
            raise InputError(
                f"{path}: array {key[name]!r} (input {name}) has {shape[0]} rows, array {key[first]!r} "
                f"(input {first}) has {first_shape[0]}; every input needs one row per sample"
            )
    return SourceFile(
        path=path,
        key=dict(key),
        num_samples=first_shape[0],
        sample_shape={name: shape[1:] for name, (shape, _) in found.items()},
        dtype={name: dtype for name, (_, dtype) in found.items()},
    )


def unreadable_file(path: str, key: Key, reason: str) -> SourceFile:
    """A file that cannot be opened at all: it holds no samples, hence no ids (``on_bad_sample: skip``)."""
    return SourceFile(path=path, key=key, num_samples=0, sample_shape=(), dtype="", unreadable=reason)


def check_labels(source: SourceFile, label_key: str) -> None:
    """The file holds one label per sample under ``label_key``."""
    with open_rows(source.path, label_key, "jacobian.labels.key") as labels:
        shape = tuple(int(d) for d in labels.shape)
    if shape not in ((source.num_samples,), (source.num_samples, 1)):
        raise InputError(
            f"{source.path}: labels {label_key!r} of shape {shape}; expected ({source.num_samples},), "
            "one output index per sample"
        )


def check_consistent(files: Sequence[SourceFile], expected: Shape | None = None) -> None:
    """All readable files must hold samples of one shape (per input): ``expected`` (``input.sample_shape``)
    if given, else the shape of the first of them (in sorted order)."""
    readable = [f for f in files if f.unreadable is None]
    if not readable:
        return
    where = "input.sample_shape"
    if expected is None:
        expected, where = readable[0].sample_shape, None
    for other in readable:
        if not isinstance(expected, Mapping):
            if other.sample_shape != expected:
                raise InputError(
                    f"{other.path}: samples of shape {other.sample_shape}; expected {expected} "
                    f"({where or f'the sample shape of {readable[0].path}'})"
                )
            continue
        for name, shape in expected.items():
            if other.sample_shape[name] != shape:
                raise InputError(
                    f"{other.path}: input {name} ({other.key[name]!r}) has samples of shape "
                    f"{other.sample_shape[name]}; expected {shape} ({where or f'input {name} in {readable[0].path}'})"
                )


def assign_ids(files: Sequence[SourceFile]) -> list[SourceFile]:
    """Give each file its id range in the concatenation, in sorted path order."""
    placed, next_id = [], 0
    for source in sorted(files, key=lambda f: f.path):
        placed.append(dataclasses.replace(source, first_id=next_id))
        next_id += source.num_samples
    return placed


def iter_slices(
    files: Sequence[SourceFile], start: int, stop: int, max_rows: int, label_key: str | None = None
) -> Iterator[tuple[np.ndarray, Samples, np.ndarray | None]]:
    """Yield ``(sample_ids, samples, labels)`` covering ids ``[start, stop)`` in order, in slices of
    at most ``max_rows`` rows, each from one file. ``samples`` has shape ``(rows, *sample_shape)`` and
    the file's own dtype (a dict of such arrays by input name for several inputs); ``labels``
    ``(rows,)`` come from the array ``label_key`` of the same file (None without one). Slices end at
    file boundaries, so batching across files is the caller's job, except that consecutive image
    files (one sample each) are read together, up to ``max_rows`` per slice.
    """
    images: list[SourceFile] = []  # consecutive images not yet read

    def read_images() -> Iterator[tuple[np.ndarray, np.ndarray, None]]:
        if images:
            batch = images.copy()
            images.clear()
            yield np.array([image.first_id for image in batch], np.int64), _read_images(batch), None

    for source in files:
        lo, hi = max(start, source.first_id), min(stop, source.stop_id)
        if lo >= hi:
            continue
        if source.image is not None:
            images.append(source)
            if len(images) == max_rows:
                yield from read_images()
            continue
        yield from read_images()
        with contextlib.ExitStack() as stack:
            rows = stack.enter_context(open_samples(source))
            labels = stack.enter_context(open_rows(source.path, label_key, "jacobian.labels.key")) if label_key else None
            for first in range(lo, hi, max_rows):
                last = min(first + max_rows, hi)
                local = slice(first - source.first_id, last - source.first_id)
                yield (
                    np.arange(first, last, dtype=np.int64),
                    rows.read(local.start, local.stop),
                    labels.read(local.start, local.stop).reshape(-1) if labels else None,
                )
    yield from read_images()


# --- samples of one or several inputs, as one shape -------------------------------------------------------


def parts(samples: Samples) -> list[tuple[str | None, np.ndarray]]:
    """The arrays of ``samples`` by input name, sorted; ``[(None, samples)]`` for one input."""
    return sorted(samples.items()) if isinstance(samples, Mapping) else [(None, samples)]


def nonfinite_rows(samples: Samples) -> np.ndarray:
    """``(rows,)`` bool: True where a sample holds NaN or Inf in any of its arrays."""
    bad = [~np.isfinite(values.reshape(len(values), -1)).all(axis=1) for _, values in parts(samples)]
    return np.logical_or.reduce(bad)


def as_dtype(samples: Samples, dtype: str) -> Samples:
    if isinstance(samples, Mapping):
        return {name: values.astype(dtype, copy=False) for name, values in samples.items()}
    return samples.astype(dtype, copy=False)


def row_bytes(source: SourceFile) -> int:
    """Bytes of one sample, all its arrays together."""
    shapes = source.sample_shape if isinstance(source.sample_shape, Mapping) else {None: source.sample_shape}
    dtypes = source.dtype if isinstance(source.dtype, Mapping) else {None: source.dtype}
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtypes[name]).itemsize for name, shape in shapes.items())


def shape_record(shape: Shape) -> list[int] | dict[str, list[int]]:
    """A sample shape as plain JSON data: a list, or ``{input name: list}``."""
    if isinstance(shape, Mapping):
        return {name: [int(d) for d in dims] for name, dims in shape.items()}
    return [int(d) for d in shape]


def shape_from_record(record: list[int] | dict[str, list[int]]) -> Shape:
    if isinstance(record, Mapping):
        return {name: tuple(dims) for name, dims in record.items()}
    return tuple(record)


def tensor_spec(shape: Shape, dtype: str):
    """The ``tf.TensorSpec`` of batches of such samples (a dict of specs for several inputs)."""
    import tensorflow as tf

    if isinstance(shape, Mapping):
        return {name: tf.TensorSpec((None, *dims), dtype) for name, dims in shape.items()}
    return tf.TensorSpec((None, *shape), dtype)


def manifest_sources(manifest: Mapping[str, Any]) -> list[SourceFile]:
    """The input files a manifest lists, as ``SourceFile``s to read samples from again."""
    shape = shape_from_record(manifest["input_shape"])
    image = ImageOptions.from_config(manifest["config"]["input"].get("image"))
    return [
        SourceFile(
            path=entry["path"],
            key=entry.get("key"),
            num_samples=entry["num_samples"],
            sample_shape=shape,
            dtype=entry["dtype"],
            first_id=entry["first_id"],
            data_sha256=entry.get("data_sha256"),
            unreadable=entry.get("unreadable"),
            image=image if file_format(entry["path"]) == "image" else None,
        )
        for entry in manifest["inputs"]
    ]
