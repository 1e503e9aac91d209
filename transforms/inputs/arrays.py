"""Arrays of samples: ``.npy``, ``.npz`` and ``.h5``/``.hdf5`` files, read in slices.

Every array holds samples along its first axis. A file is opened through Beam's ``FileSystems``
(remote paths work the same as local ones) and its rows are read in slices, never the whole array: a
``.npy`` array (a file, or a member of an ``.npz`` archive) by seeking past its header, an HDF5
dataset through h5py. A model with several inputs reads one array per input from each file:
``input.key`` is then ``{input name: array key}``, and the arrays of one file hold one row per sample
each. The format follows from the file name (``SUFFIXES``).
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Protocol

import numpy as np

from jacobeam.transforms.errors import CorruptInputError, InputError, span
from jacobeam.transforms.inputs.types import ImageOptions, Key, Shape, SourceFile
from jacobeam.transforms.output import storage

SUFFIXES = {".npy": "npy", ".npz": "npz", ".h5": "h5", ".hdf5": "h5"}


def _format(path: str, setting: str = "input.key") -> str:
    for suffix, fmt in SUFFIXES.items():
        if path.lower().endswith(suffix):
            return fmt
    raise InputError(f"{path}: {setting} names arrays of .npy, .npz and .h5 files; this is not one")


class Rows(Protocol):
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, start: int, stop: int) -> np.ndarray: ...


# numpy parses a header with ast.literal_eval, which CPython 3.11 before 3.11.8 cannot run in two
# threads at once ("SystemError: AST constructor recursion depth mismatch", gh-106905); the launcher
# describes files on a thread pool.
_HEADER_LOCK = threading.Lock()


# The header numpy writes for a plain array, read without ast: the lock above serialises jacobeam's own
# parses, but any other thread building an AST at the same moment (compiling source, autograph) trips the
# same bug, and did once in a suite run.
_PLAIN_HEADER = re.compile(
    r"""^\{'descr': '([<>|=][a-zA-Z]\d*)', 'fortran_order': (True|False), 'shape': \(((?:\d+, ?)*\d*)\), \}\s*$"""
)


def _npy_header(stream: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """A ``.npy`` stream's ``(shape, fortran_order, dtype)``, leaving the stream at its first row."""
    fmt = np.lib.format
    version = fmt.read_magic(stream)
    start = stream.tell()
    length_bytes = 2 if version == (1, 0) else 4
    raw = stream.read(length_bytes)
    if len(raw) == length_bytes:
        length = int.from_bytes(raw, "little")
        text = stream.read(length).decode("latin1")
        plain = _PLAIN_HEADER.match(text) if len(text) == length else None
        if plain is not None:
            shape = tuple(int(n) for n in plain.group(3).replace(" ", "").split(",") if n)
            return shape, plain.group(2) == "True", np.dtype(plain.group(1))
    stream.seek(start)
    header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    with _HEADER_LOCK:
        return header(stream)


class _NpyRows:
    """Rows of a C-ordered ``.npy`` stream, read by seeking: no memory map, no full load."""

    def __init__(self, stream: IO[bytes], name: str):
        try:
            self.shape, fortran_order, self.dtype = _npy_header(stream)
        except ValueError as err:
            raise CorruptInputError(
                f"{name}: not a valid .npy array: {err}", reason=f"corrupt: not a valid .npy array: {err}"
            ) from err
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
                f"{self._name}: {span(start, stop, 'row')} cannot be read: {err}", reason=f"corrupt: {err}"
            ) from err
        if len(data) != count * self._row_bytes:
            raise CorruptInputError(
                f"{self._name}: truncated: {span(start, stop, 'row')} past the end of the data",
                reason="truncated: the row is past the end of the data",
            )
        return np.frombuffer(data, dtype=self.dtype).reshape((count, *self.shape[1:]))

    def read_to_end(self) -> None:
        """Read on to the end of the stream (an ``.npz`` member: its CRC is checked there)."""
        try:
            while self._stream.read(8 << 20):
                pass
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            raise CorruptInputError(f"{self._name}: cannot be read: {err}", reason=f"corrupt: {err}") from err


def npy_header_end(head: bytes) -> int:
    """Where the data of an ``.npy`` file starting with ``head`` begins, by its header's length field (2
    bytes in format version 1, else 4); ``head`` may be too short to hold the whole header."""
    size = 2 if head[6:7] == b"\x01" else 4
    return 8 + size + int.from_bytes(head[8 : 8 + size], "little")


class SmallNpyFiles:
    """Rows of small local ``.npy`` files, each file read in one call and its header parsed once per
    distinct header (the one-sample files of a folder share theirs): about 16 us a one-row file, read and
    checked, where ``open_samples`` took 31 us (its context layers, the header parsed per file;
    benchmarks/README.md). Anything but a plain file with the rows asked for is left to ``open_samples``,
    whose checks and messages are the reference: ``rows`` returns None."""

    def __init__(self):
        self._headers: dict[bytes, tuple[np.dtype, tuple[int, ...], int, int]] = {}

    def rows(self, path: str, start: int, stop: int) -> np.ndarray | None:
        """Rows ``[start, stop)`` of the ``.npy`` file at ``path`` as ``_NpyRows.read`` gives them, or None."""
        try:
            with storage.open_input(path) as stream:
                data = stream.read()
            offset = npy_header_end(data)
            known = self._headers.get(data[:offset])
            if known is None:
                rows = _NpyRows(io.BytesIO(data), path)
                if rows._offset != offset:
                    return None
                known = rows.dtype, tuple(rows.shape[1:]), rows._row_bytes, rows.shape[0]
                self._headers[data[:offset]] = known
        except (CorruptInputError, InputError, ValueError, OSError):
            return None
        dtype, row_shape, row_bytes, count = known
        if not 0 <= start <= stop <= count or len(data) < offset + stop * row_bytes:
            return None
        return np.frombuffer(data, dtype, count=(stop - start) * row_bytes // dtype.itemsize,
                             offset=offset + start * row_bytes).reshape((stop - start, *row_shape))


class _H5Rows:
    def __init__(self, dataset, name: str):
        self.shape, self.dtype = dataset.shape, dataset.dtype
        self._dataset, self._name = dataset, name

    def read(self, start: int, stop: int) -> np.ndarray:
        try:
            return self._dataset[start:stop]
        except OSError as err:  # a damaged chunk (failed filter or checksum), a short file
            raise CorruptInputError(
                f"{self._name}: {span(start, stop, 'row')} cannot be read: {err}", reason=f"corrupt: {err}"
            ) from err


class _Inputs:
    """The arrays of a several-input file, read together: ``{input name: rows}``."""

    def __init__(self, rows: Mapping[str, Rows]):
        self._rows = rows

    def read_to_end(self) -> None:
        for rows in self._rows.values():
            read_to_end(rows)

    def read(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return {name: rows.read(start, stop) for name, rows in self._rows.items()}


def read_to_end(rows) -> None:
    """Read an opened array's stream on to its end, where an ``.npz`` member's CRC is checked
    (``CorruptInputError`` if it fails); nothing for arrays of other files."""
    if hasattr(rows, "read_to_end"):
        rows.read_to_end()


def _pick_member(names: Sequence[str], key: str | None, path: str, what: str, setting: str) -> str:
    if key is not None:
        if key not in names:
            raise InputError(f"{path}: no {what} {key!r} ({setting}); found {sorted(names)}")
        return key
    if len(names) != 1:
        raise InputError(f"{path}: holds {what}s {sorted(names)}; set {setting} to choose one")
    return names[0]


def _h5_datasets(h5, limit: int = 20) -> str:
    """The datasets of an HDF5 file by path (``group/name``), sorted, as the message of a missing key
    shows them (the first ``limit``)."""
    import h5py

    names: list[str] = []
    h5.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
    names.sort()
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


@contextlib.contextmanager
def _open_arrays(
    path: str, fmt: str, keys: Mapping[str, str | None], headers: bool = False
) -> Iterator[dict[str, Rows]]:
    """Open arrays of one file (of format ``fmt``) for reading rows in slices. ``keys`` maps the config
    setting that names an array (``input.key``, ``input.key.<input>``: for messages) to its key; so
    does the result. ``headers``: only headers will be read (a remote file is read in small ranges)."""
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(storage.open_input(path, headers=headers))
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
                raise CorruptInputError(
                    f"{path}: not a valid .npz archive: {err}", reason=f"corrupt: not a valid .npz archive: {err}"
                ) from err
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
                raise CorruptInputError(
                    f"{path}: not a valid HDF5 file: {err}", reason=f"corrupt: not a valid HDF5 file: {err}"
                ) from err
            opened = {}
            for setting, key in keys.items():
                if key is None:
                    datasets = [name for name, item in h5.items() if isinstance(item, h5py.Dataset)]
                    key = _pick_member(datasets, None, path, "dataset", setting)
                dataset = h5.get(key)
                if not isinstance(dataset, h5py.Dataset):
                    raise InputError(f"{path}: no dataset {key!r} ({setting}); found {_h5_datasets(h5)}")
                opened[setting] = _H5Rows(dataset, f"{path}[{key}]")
            yield opened


def _settings(key: Mapping[str, str]) -> dict[str, str]:
    """``{input name: array key}`` -> ``{"input.key.<input name>": array key}``."""
    return {f"input.key.{name}": array for name, array in key.items()}


@contextlib.contextmanager
def open_rows(path: str, key: str | None, setting: str = "input.key", headers: bool = False) -> Iterator[Rows]:
    """Open one array of a file (``key``, named by the config's ``setting``), for reading rows in slices
    (``headers``: its header only, see ``_open_arrays``)."""
    with _open_arrays(path, _format(path, setting), {setting: key}, headers) as opened:
        yield opened[setting]


@contextlib.contextmanager
def open_samples(source: SourceFile) -> Iterator[Rows | _Inputs]:
    """Open a file's samples for reading in slices: one array, or ``{input name: rows}`` together when
    ``source.key`` maps inputs to arrays."""
    path, key = source.path, source.key
    if not isinstance(key, Mapping):
        with open_rows(path, key) as rows:
            yield rows
        return
    with _open_arrays(path, _format(path), _settings(key)) as opened:
        yield _Inputs({name: opened[f"input.key.{name}"] for name in key})


def _header(where: str, rows: Rows) -> tuple[tuple[int, ...], str]:
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
    """Read a file's header(s) only: how many samples, their shape(s) and dtype(s). ``sample_shape`` and
    ``image`` are not used: an array's header gives the shape (``readers.check_consistent`` compares it
    with ``input.sample_shape``)."""
    if not isinstance(key, Mapping):
        with open_rows(path, key, headers=True) as rows:
            shape, dtype = _header(path, rows)
        return SourceFile(path=path, key=key, num_samples=shape[0], sample_shape=shape[1:], dtype=dtype)
    with _open_arrays(path, _format(path), _settings(key), headers=True) as opened:
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


def npy_data_offset(path: str, dtype: str, sample_shape: tuple[int, ...]) -> int | None:
    """Where a local ``.npy`` file's rows begin, when their bytes can be read as they lie (C order, a plain
    numeric dtype in this machine's byte order) as rows of ``sample_shape`` in ``dtype`` (the plan's: a file
    rewritten since, float64 where it was float32, say, would be read as other bytes); else None."""
    try:
        with open(path, "rb") as stream:
            shape, fortran_order, found = _npy_header(stream)
            offset = stream.tell()
    except (OSError, ValueError, EOFError):
        return None  # the slice reader reports what is wrong with it
    plain = found.kind in "fiu" and found.isnative and not (fortran_order and len(shape) > 1)
    planned = found == np.dtype(dtype) and tuple(shape[1:]) == tuple(sample_shape)
    return offset if plain and planned else None
