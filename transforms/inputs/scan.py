"""The input scan: every sample of every input file is read once, in slices, before the run starts.

Finding a NaN/Inf sample or an unreadable row only when a worker reaches it would be too late for
``input.on_bad_sample: error`` ("stop before any output is touched"), and would make the shards of a
``skip`` run depend on which worker saw what. So the launcher scans the inputs first: reading is cheap
next to computing Jacobians (the scan reads each byte once; the engine does a forward and a backward
pass per output element). The scan also hashes each file's samples, so that a later run can tell
whether a file still holds the same data (resume and incremental runs).

Pure numpy, no Beam beyond the file system used by the readers; TensorFlow only where the readers need
it (TFRecord files).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

from jacobeam.transforms.errors import CorruptInputError
from jacobeam.transforms.inputs.readers import open_rows, open_samples, parts, row_bytes
from jacobeam.transforms.inputs.registry import file_format
from jacobeam.transforms.inputs.types import Samples, SourceFile

SLICE_BYTES = 8 << 20  # rows read per slice: about this many bytes


@dataclasses.dataclass(frozen=True)
class BadRows:
    """Rows ``[row, stop_row)`` of a file, bad for one reason."""

    row: int
    stop_row: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Labels:
    """Each sample's label (``jacobian.outputs: label``): the array ``key`` of every input file, whose
    values must be flat output indices ``0..outputs-1`` (``outputs`` None: the model's output size is not
    known while planning; only integral, non-negative values are checked then)."""

    key: str
    outputs: int | None = None

    def reasons(self, values: np.ndarray) -> dict[int, str]:
        """The rows of ``values`` that are not an output index, and why."""
        values = np.asarray(values, np.float64).reshape(len(values))
        top = f"0..{self.outputs - 1}" if self.outputs is not None else "0 or more"
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(values) | (values < 0) | (values != np.round(values))
            if self.outputs is not None:
                bad |= values >= self.outputs
        return {int(i): f"label {values[i]:g} is not an output index {top}" for i in np.flatnonzero(bad)}


@dataclasses.dataclass(frozen=True)
class FileScan:
    path: str
    bad: tuple[BadRows, ...]
    data_sha256: str

    @property
    def num_bad(self) -> int:
        return sum(b.stop_row - b.row for b in self.bad)


def _nonfinite_reason(values: np.ndarray, name: str | None) -> str:
    kinds = [kind for kind, test in (("NaN", np.isnan), ("Inf", np.isinf)) if test(values).any()]
    return f"non-finite input{'' if name is None else f' {name}'}: holds {' and '.join(kinds)}"


def merge_rows(rows: list[tuple[int, str]]) -> tuple[BadRows, ...]:
    """Bad rows ``(row, reason)`` as runs of consecutive rows bad for one reason."""
    merged: list[BadRows] = []
    for row, reason in sorted(rows):
        if merged and merged[-1].stop_row == row and merged[-1].reason == reason:
            merged[-1] = dataclasses.replace(merged[-1], stop_row=row + 1)
        else:
            merged.append(BadRows(row, row + 1, reason))
    return tuple(merged)


class _Digest:
    """sha256 of a file's readable samples. One input: of its rows' bytes in order. Several inputs:
    of each input's rows' bytes, one digest per input combined by name, so that the result does not
    depend on how the rows were sliced."""

    def __init__(self):
        self._inputs: dict[str | None, hashlib._Hash] = {}

    def update(self, samples: Samples) -> None:
        for name, values in parts(samples):
            self._inputs.setdefault(name, hashlib.sha256()).update(np.ascontiguousarray(values).tobytes())

    def hexdigest(self) -> str:
        if set(self._inputs) <= {None}:
            return self._inputs.get(None, hashlib.sha256()).hexdigest()
        combined = {name: digest.hexdigest() for name, digest in sorted(self._inputs.items())}
        return hashlib.sha256(json.dumps(combined, sort_keys=True).encode()).hexdigest()


def scan_file(source: SourceFile, slice_bytes: int = SLICE_BYTES, labels: Labels | None = None) -> FileScan:
    """Read every row of ``source``: which rows are bad (NaN/Inf in any of a sample's arrays,
    unreadable, past the end, a label that is not an output index), and the sha256 of the readable
    rows' bytes."""
    if source.image is not None:
        # Describing an image decoded its only sample (an image cannot hold NaN/Inf) and hashed its bytes.
        return FileScan(source.path, (), source.data_sha256)
    n = source.num_samples
    step = max(1, slice_bytes // max(1, row_bytes(source)))
    digest = _Digest()
    bad: list[tuple[int, str]] = []
    # A .npz member is one zip stream checked by one CRC at its end: once a read fails, no row of it can
    # be trusted, so the whole file is bad. In .npy and HDF5 files, rows are independent.
    whole_file = file_format(source.path) == "npz"

    def take(first_row: int, samples: Samples, label_values: np.ndarray | None) -> None:
        digest.update(samples)
        reasons: dict[int, list[str]] = {}  # one reason per bad sample, naming each input that is bad
        for name, values in parts(samples):
            flat = values.reshape(len(values), -1)
            for index in np.flatnonzero(~np.isfinite(flat).all(axis=1)):
                reasons.setdefault(int(index), []).append(_nonfinite_reason(flat[index], name))
        for index, reason in labels.reasons(label_values).items() if labels is not None else ():
            reasons.setdefault(index, []).append(reason)
        bad.extend((first_row + index, "; ".join(found)) for index, found in sorted(reasons.items()))

    try:
        with contextlib.ExitStack() as stack:
            rows = stack.enter_context(open_samples(source))
            label_rows = stack.enter_context(open_rows(source.path, labels.key, "jacobian.labels.key")) if labels else None

            def read(lo: int, hi: int) -> None:
                take(lo, rows.read(lo, hi), label_rows.read(lo, hi) if label_rows is not None else None)

            for lo in range(0, n, step):
                hi = min(lo + step, n)
                try:
                    read(lo, hi)
                except CorruptInputError:
                    if whole_file:
                        raise
                    for row in range(lo, hi):  # which rows exactly cannot be read
                        try:
                            read(row, row + 1)
                        except CorruptInputError as err:
                            bad.append((row, err.reason))
    except CorruptInputError as err:
        bad = [(row, err.reason) for row in range(n)]
        digest = hashlib.sha256(f"unreadable: {err.reason}".encode())
    return FileScan(source.path, merge_rows(bad), digest.hexdigest())


def scan_files(files: Sequence[SourceFile], threads: int | None = None, labels: Labels | None = None) -> dict[str, FileScan]:
    """Scan the readable files, a few at a time (reading and hashing release the GIL)."""
    readable = [f for f in files if f.unreadable is None]
    workers = max(1, min(len(readable), threads or min(8, os.cpu_count() or 1)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jacobeam-scan") as pool:
        scans = pool.map(functools.partial(scan_file, labels=labels), readable)
        return {scan.path: scan for scan in scans}
