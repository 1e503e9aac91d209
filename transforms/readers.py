"""Reading input samples from ``.npy``, ``.npz`` and ``.h5``/``.hdf5`` files, in slices.

Every file holds samples along its first axis. Files are opened through Beam's ``FileSystems``
so that remote paths work the same as local ones, and rows are read in slices: a file is never
loaded whole. Sample ids are positions in the concatenation of the input files (see ``pipeline.plan``
for how files are placed: sorted path order, new files of an incremental run after the old ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Protocol

import numpy as np

from transforms.errors import CorruptInputError, InputError

FORMATS = {".npy": "npy", ".npz": "npz", ".h5": "h5", ".hdf5": "h5"}


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One input file and the sample ids it covers: ``[first_id, first_id + num_samples)``."""

    path: str
    key: str | None
    num_samples: int
    sample_shape: tuple[int, ...]
    dtype: str
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


def _pick_member(names: Sequence[str], key: str | None, path: str, what: str) -> str:
    if key is not None:
        if key not in names:
            raise InputError(f"{path}: no {what} {key!r} (input.key); found {sorted(names)}")
        return key
    if len(names) != 1:
        raise InputError(f"{path}: holds {what}s {sorted(names)}; set input.key to choose one")
    return names[0]


@contextlib.contextmanager
def open_rows(path: str, key: str | None) -> Iterator[_Rows]:
    """Open the sample array of one file, for reading rows in slices."""
    fmt = file_format(path)
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(_open_binary(path))
        if fmt == "npy":
            yield _NpyRows(stream, path)
        elif fmt == "npz":
            try:
                archive = stack.enter_context(zipfile.ZipFile(stream))
            except zipfile.BadZipFile as err:
                raise CorruptInputError(f"{path}: not a valid .npz archive: {err}", reason=f"corrupt: not a valid .npz archive: {err}") from err
            arrays = [name[: -len(".npy")] for name in archive.namelist() if name.endswith(".npy")]
            member = _pick_member(arrays, key, path, "array")
            yield _NpyRows(stack.enter_context(archive.open(member + ".npy")), f"{path}[{member}]")
        else:
            import h5py

            try:
                h5 = stack.enter_context(h5py.File(stream, "r"))
            except OSError as err:
                raise CorruptInputError(f"{path}: not a valid HDF5 file: {err}", reason=f"corrupt: not a valid HDF5 file: {err}") from err
            if key is None:
                datasets = [name for name, item in h5.items() if isinstance(item, h5py.Dataset)]
                key = _pick_member(datasets, None, path, "dataset")
            dataset = h5.get(key)
            if not isinstance(dataset, h5py.Dataset):
                raise InputError(f"{path}: no dataset {key!r} (input.key)")
            yield _H5Rows(dataset, f"{path}[{key}]")


def describe(path: str, key: str | None) -> SourceFile:
    """Read a file's header only: how many samples, their shape and dtype."""
    with open_rows(path, key) as rows:
        shape, dtype = tuple(int(d) for d in rows.shape), np.dtype(rows.dtype)
    if len(shape) < 2:
        raise InputError(
            f"{path}: array of shape {shape}; expected samples along the first axis, "
            "i.e. shape (num_samples, *sample_shape) with at least one sample axis"
        )
    if not np.issubdtype(dtype, np.floating):
        raise InputError(f"{path}: dtype {dtype}; expected a float array (float16, float32 or float64)")
    return SourceFile(path=path, key=key, num_samples=shape[0], sample_shape=shape[1:], dtype=dtype.name)


def unreadable_file(path: str, key: str | None, reason: str) -> SourceFile:
    """A file that cannot be opened at all: it holds no samples, hence no ids (``on_bad_sample: skip``)."""
    return SourceFile(path=path, key=key, num_samples=0, sample_shape=(), dtype="", unreadable=reason)
def check_labels(source: SourceFile, label_key: str) -> None:
    """The file holds one label per sample under ``label_key``."""
    with open_rows(source.path, label_key) as labels:
        shape = tuple(int(d) for d in labels.shape)
    if shape not in ((source.num_samples,), (source.num_samples, 1)):
        raise InputError(
            f"{source.path}: labels {label_key!r} of shape {shape}; expected ({source.num_samples},), "
            "one output index per sample"
        )


def check_consistent(files: Sequence[SourceFile]) -> None:
    """All readable files must hold samples of one shape; the first of them (in sorted order) sets it."""
    readable = [f for f in files if f.unreadable is None]
    if not readable:
        return
    reference = readable[0]
    for other in readable[1:]:
        if other.sample_shape != reference.sample_shape:
            raise InputError(
                f"{other.path}: samples of shape {other.sample_shape}; expected {reference.sample_shape} "
                f"(the sample shape of {reference.path})"
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
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Yield ``(sample_ids, samples, labels)`` covering ids ``[start, stop)`` in order, in slices of
    at most ``max_rows`` rows, each from one file. ``samples`` has shape ``(rows, *sample_shape)`` and
    the file's own dtype; ``labels`` ``(rows,)`` come from the array ``label_key`` of the same file
    (None without one). Slices end at file boundaries, so batching across files is the caller's job.
    """
    for source in files:
        lo, hi = max(start, source.first_id), min(stop, source.stop_id)
        if lo >= hi:
            continue
        with contextlib.ExitStack() as stack:
            rows = stack.enter_context(open_rows(source.path, source.key))
            labels = stack.enter_context(open_rows(source.path, label_key)) if label_key else None
            for first in range(lo, hi, max_rows):
                last = min(first + max_rows, hi)
                local = slice(first - source.first_id, last - source.first_id)
                yield (
                    np.arange(first, last, dtype=np.int64),
                    rows.read(local.start, local.stop),
                    labels.read(local.start, local.stop).reshape(-1) if labels else None,
                )
