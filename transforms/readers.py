"""Reading input samples from ``.npy``, ``.npz`` and ``.h5``/``.hdf5`` files, in slices.

Every file holds samples along its first axis. Files are opened through Beam's ``FileSystems``
so that remote paths work the same as local ones, and rows are read in slices: a file is never
loaded whole. Sample ids are positions in the concatenation of the input files (see ``pipeline.plan``
for how files are placed: sorted path order, new files of an incremental run after the old ones).

A model with several inputs reads one array per input from each file: ``input.key`` is then a mapping
``{input name: array key}``, and samples are dicts ``{input name: rows}`` (``Samples``). The arrays of
one file hold one row per sample each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, Protocol, Union

import numpy as np

from transforms.errors import CorruptInputError, InputError

FORMATS = {".npy": "npy", ".npz": "npz", ".h5": "h5", ".hdf5": "h5"}

# input.key: one array (None: the file's only one), or {input name: array key} for several inputs.
Key = Union[str, Mapping[str, str], None]
# One sample's shape, or {input name: shape}; rows of samples: one array, or {input name: array}.
Shape = Union[tuple[int, ...], Mapping[str, tuple[int, ...]]]
Samples = Union[np.ndarray, Mapping[str, np.ndarray]]


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
    data_sha256: str | None = None  # sha256 of the readable rows' bytes, set by the input scan
    unreadable: str | None = None  # why a file that cannot be opened holds no samples (on_bad_sample: skip)

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


def describe(path: str, key: Key) -> SourceFile:
    """Read a file's header(s) only: how many samples, their shape(s) and dtype(s)."""
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


def check_consistent(files: Sequence[SourceFile]) -> None:
    """All readable files must hold samples of one shape (per input); the first of them (in sorted
    order) sets it."""
    readable = [f for f in files if f.unreadable is None]
    if not readable:
        return
    reference = readable[0]
    for other in readable[1:]:
        if not isinstance(reference.sample_shape, Mapping):
            if other.sample_shape != reference.sample_shape:
                raise InputError(
                    f"{other.path}: samples of shape {other.sample_shape}; expected {reference.sample_shape} "
                    f"(the sample shape of {reference.path})"
                )
            continue
        for name, expected in reference.sample_shape.items():
            if other.sample_shape[name] != expected:
                raise InputError(
                    f"{other.path}: input {name} (array {other.key[name]!r}) has samples of shape "
                    f"{other.sample_shape[name]}; expected {expected} (input {name} in {reference.path})"
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
    file boundaries, so batching across files is the caller's job.
    """
    for source in files:
        lo, hi = max(start, source.first_id), min(stop, source.stop_id)
        if lo >= hi:
            continue
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
        )
        for entry in manifest["inputs"]
    ]
