"""The folder's table of input files, ``inputs.h5``: one row per placed file (a file that grew has one row
per piece, ``SourceFile.first_row``), the fields the manifest listed per file before (``path``, ``key``,
``first_id``, ``stop_id``, ``num_samples``, ``dtype``, ``data_sha256``, ``stamp``, ...), one column each.

A million files would make ``manifest.json`` about 250 MB of JSON; as columns, compressed, they are a few
MB, written once per run (atomically, under the run's fence, before the manifest that points at it:
``manifest.json["input_files"]``, ``{"file", "count", "sha256"}``). A manifest written before lists the
files itself (``"inputs"``); ``with_inputs`` gives either as the manifest's ``"inputs"``, a sequence of
one dict per row, built as it is read, so that a million rows need not be a million dicts at once.

The columns are generic over the rows' keys: a column per key, its ``kind`` an attribute (``int``,
``bool``, ``str``, or ``json`` for anything else, each value as JSON text). Strings are fixed-width UTF-8,
gzip-compressed: a million paths read faster than as variable-length strings (0.2-0.75 s against
0.5-0.9 s) and take 0.3 MB, not 59 MB (``benchmarks/README.md``). Where a row has no value for a key
(absent, or None), the column's ``missing`` dataset says which (0 a value, 1 None, 2 absent), so every
row reads back as it was written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import INPUTS_PREVIOUS, INPUTS_TABLE, MANIFEST

COLUMNS = "columns"
MISSING = "missing"
_VALUE, _NONE, _ABSENT = 0, 1, 2
_ABSENT_MARK = object()
_CHUNK = 1 << 16  # rows built at a time while iterating


def _kind(values: list[Any]) -> str:
    given = [v for v in values if v is not None and v is not _ABSENT_MARK]
    if given and all(isinstance(v, bool) for v in given):
        return "bool"
    if given and all(isinstance(v, int) and not isinstance(v, bool) for v in given):
        return "int"
    if all(isinstance(v, str) for v in given):
        return "str"
    return "json"


def _write_column(group, name: str, values: list[Any]) -> None:
    import h5py
    from h5py import h5s

    kind = _kind(values)
    states = np.array([_ABSENT if v is _ABSENT_MARK else _NONE if v is None else _VALUE for v in values], np.int8)
    given = states == _VALUE
    if kind in ("bool", "int"):
        dtype = bool if kind == "bool" else np.int64
        data = np.array([v if ok else 0 for v, ok in zip(values, given)], dtype)
        column = group.create_dataset(name, data=data, compression="gzip", shuffle=True, chunks=True if len(data) else None)
    else:
        encoded = [(v if kind == "str" else json.dumps(v)).encode() if ok else b"" for v, ok in zip(values, given)]
        width = max((len(b) for b in encoded), default=0) or 1
        column = group.create_dataset(name, shape=(len(encoded),), dtype=h5py.string_dtype("utf-8", width),
                                      compression="gzip", shuffle=True, chunks=True if encoded else None)
        if encoded:  # the bytes as they are: h5py converts numpy's bytes to ASCII strings only, not UTF-8
            column.id.write(h5s.ALL, h5s.ALL, np.array(encoded, f"S{width}"), mtype=column.id.get_type())
    column.attrs["kind"] = kind
    if not given.all():
        group.create_dataset(f"{MISSING}/{name}", data=states, compression="gzip", chunks=True)


def write_table(output_dir: str, rows: Iterable[Mapping[str, Any]], guard=None) -> dict[str, Any]:
    """Write ``inputs.h5`` from ``rows`` (one dict per file piece, in id order), atomically; returns the
    manifest's pointer to it, ``{"file", "count", "sha256"}``. ``guard``: the run's fence for the commit."""
    import h5py

    columns: dict[str, list[Any]] = {}
    count = 0
    for row in rows:
        for key, value in row.items():
            if key not in columns:  # a key no row before had
                columns[key] = [_ABSENT_MARK] * count
            columns[key].append(value)
        count += 1
        for values in columns.values():
            if len(values) < count:
                values.append(_ABSENT_MARK)
    digest: dict[str, str] = {}

    def write(temp: Path) -> None:
        with h5py.File(temp, "w") as h5:
            h5.attrs["count"] = count
            h5.attrs["keys"] = json.dumps(list(columns))  # the rows' key order
            group = h5.create_group(COLUMNS)
            for key, values in columns.items():
                _write_column(group, key, values)
        digest["sha256"] = storage.sha256(temp)

    storage.write_atomically(storage.join(output_dir, INPUTS_TABLE), write, "inputs", guard)
    return {"file": INPUTS_TABLE, "count": count, "sha256": digest["sha256"]}


class InputsTable(Sequence):
    """The rows of ``inputs.h5`` as dicts, each built when read (iteration builds a block of rows at a time).
    Values of a ``json`` column are decoded once per distinct text and shared among the rows that hold it."""

    def __init__(self, keys: list[str], columns: dict[str, np.ndarray], kinds: dict[str, str],
                 missing: dict[str, np.ndarray], count: int):
        self._keys, self._columns, self._kinds, self._missing, self._count = keys, columns, kinds, missing, count
        self._decoded: dict[str, dict[bytes, Any]] = {key: {} for key in keys}

    def __len__(self) -> int:
        return self._count

    def column(self, key: str, default: Any) -> np.ndarray:
        """The column ``key`` as stored (strings as UTF-8 bytes), ``default`` in rows without a value: for
        comparisons over every row at once, where a dict per row would cost seconds (a million rows)."""
        if key not in self._columns:
            return np.full(self._count, default)
        values = self._columns[key].copy()
        states = self._missing.get(key)
        if states is not None:
            values[states != _VALUE] = default
        return values

    def _values(self, key: str, lo: int, hi: int) -> list[Any]:
        """The column's values of rows ``lo..hi``; ``_ABSENT_MARK`` where a row has none, None where None."""
        values = self._columns[key][lo:hi].tolist()
        if self._kinds[key] not in ("int", "bool"):
            cache = self._decoded[key]
            decode = json.loads if self._kinds[key] == "json" else (lambda text: text)
            for i, item in enumerate(values):
                if item not in cache:
                    cache[item] = decode(item.decode()) if item else ""
                values[i] = cache[item]
        states = self._missing.get(key)
        if states is not None:
            for i, state in enumerate(states[lo:hi].tolist()):
                if state != _VALUE:
                    values[i] = None if state == _NONE else _ABSENT_MARK
        return values

    def _rows(self, lo: int, hi: int) -> list[dict[str, Any]]:
        columns = [self._values(key, lo, hi) for key in self._keys]
        rows = [dict(zip(self._keys, values)) for values in zip(*columns)]
        for key, values in zip(self._keys, columns):
            if key in self._missing:
                for row, value in zip(rows, values):
                    if value is _ABSENT_MARK:
                        del row[key]
        return rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"{INPUTS_TABLE}: row {index} of {self._count}")
        return self._rows(index, index + 1)[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for lo in range(0, self._count, _CHUNK):
            yield from self._rows(lo, min(lo + _CHUNK, self._count))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{INPUTS_TABLE}: {self._count} rows of {', '.join(self._keys)}>"


def read_table(path: str) -> InputsTable:
    """The table at ``path`` (an ``inputs.h5``), its columns read whole."""
    with storage.open_h5(path) as h5:
        keys = json.loads(h5.attrs["keys"])
        group = h5[COLUMNS]
        columns = {key: group[key][()] for key in keys}
        kinds = {key: str(group[key].attrs["kind"]) for key in keys}
        missing = {key: group[MISSING][key][()] for key in keys if MISSING in group and key in group[MISSING]}
        count = int(h5.attrs["count"])
    return InputsTable(keys, columns, kinds, missing, count)


def table_path(root: str, pointer: Mapping[str, Any]) -> str:
    """The table a manifest's ``input_files`` points at: its file, or where a run was stopped after writing
    its own table but before its manifest, the copy of the one this manifest was written with
    (``keep_previous``)."""
    path = storage.join(root, pointer["file"])
    previous = storage.join(root, INPUTS_PREVIOUS)
    if storage.exists(previous) and storage.sha256(previous) == pointer["sha256"] and (
            not storage.exists(path) or storage.sha256(path) != pointer["sha256"]):
        return previous
    return path


def keep_previous(output_dir: str, guard=None) -> None:
    """Before a run replaces ``inputs.h5``: a copy of the table the folder's manifest points at
    (``inputs.previous.h5``), so that a run stopped between its table and its manifest leaves a manifest
    that still finds its own table; the next run plans from them as they were. ``drop_previous`` deletes the
    copy once the new manifest is in place."""
    manifest = storage.join(output_dir, MANIFEST)
    if not storage.exists(manifest):
        return
    pointer = json.loads(storage.read_text(manifest)).get("input_files")
    if pointer is None:  # a manifest written before lists its files itself: nothing is replaced under it
        return
    current = table_path(output_dir, pointer)
    if current == storage.join(output_dir, INPUTS_PREVIOUS) or not storage.exists(current):
        return  # kept already (a stopped run's), or nothing to keep
    if storage.sha256(current) != pointer["sha256"]:
        return  # not the manifest's table (changed by hand): verify says so; nothing worth keeping
    with storage.open_read(current) as stream:
        data = stream.read()
    storage.write_atomically(storage.join(output_dir, INPUTS_PREVIOUS), lambda temp: temp.write_bytes(data), "inputs",
                             guard)


def drop_previous(output_dir: str) -> None:
    """Delete the copy ``keep_previous`` made (the caller holds the run's fence)."""
    previous = storage.join(output_dir, INPUTS_PREVIOUS)
    if storage.exists(previous):
        storage.delete(previous)


def with_inputs(root: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` (of the folder at ``root``) with its ``"inputs"``: the list a manifest written before
    ``inputs.h5`` holds, or the rows of the ``inputs.h5`` its ``input_files`` names. A copy: the manifest
    as written stays as it is."""
    if "inputs" in manifest or "input_files" not in manifest:
        return manifest
    return {**manifest, "inputs": read_table(table_path(root, manifest["input_files"]))}


def load_manifest(root: str) -> dict[str, Any]:
    """The manifest of the output folder at ``root``, with its ``"inputs"`` (``with_inputs``)."""
    return with_inputs(root, json.loads(storage.read_text(storage.join(root, MANIFEST))))


def folder_inputs(root: str | os.PathLike) -> Sequence[dict[str, Any]]:
    """The input files of the output folder at ``root``, one dict per file (a piece of one), in id order."""
    return load_manifest(str(root))["inputs"]

