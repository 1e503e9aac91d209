"""Reading a range of sample ids checked: the bad samples found and left out, the stored ones hashed.

The launcher reads headers only (``pipeline.discover``); each sample is read once, by the worker that
reads its range (``transforms.read``), and checked there: NaN/Inf in any of its arrays, a row that
cannot be read (past the end of a truncated file, a damaged chunk, an image that cannot be decoded), a
label that is not an output index. A bad sample keeps its id (ids are positions on the id line, bad or
not), so which worker saw what cannot change a result. ``RangeFindings`` collects what one range's
reading found: its rejected samples (``spec.Rejected`` runs, stored in the range's shard) and the
sha256 of its stored samples' bytes as read, in id order (``RowDigest``; stored in the shard and
checked by ``jacobeam verify``).

Pure numpy, no Beam beyond the file system used by the readers; TensorFlow only where the readers need
it (TFRecord files, images).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterator, Sequence

import numpy as np

from jacobeam.transforms.errors import CorruptInputError, InputError
from jacobeam.transforms.inputs import arrays, images
from jacobeam.transforms.inputs.readers import open_rows, open_samples, parts
from jacobeam.transforms.inputs.registry import file_format
from jacobeam.transforms.inputs.types import Samples, SourceFile
from jacobeam.transforms.output import storage
from jacobeam.transforms.spec import Rejected, overlapping


@dataclasses.dataclass(frozen=True)
class Labels:
    """Each sample's label (``jacobian.outputs: label``): the array ``key`` of every input file, or (``key``
    None) each file's own label (``SourceFile.label``), whose values must be flat output indices
    ``0..outputs-1`` (``outputs`` None: the model's output size is not known; only integral, non-negative
    values are checked then)."""

    key: str | None
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


class RowDigest:
    """sha256 of samples' bytes as read, in id order, in native byte order (a big-endian file's rows reach a
    worker's digest as read or converted, depending on the slice). One input: of its rows' bytes. Several
    inputs: of each input's rows' bytes, one digest per input combined by name, so that the result does not
    depend on how the rows were sliced."""

    def __init__(self):
        self._inputs: dict[str | None, hashlib._Hash] = {}

    def update(self, samples: Samples) -> None:
        for name, values in parts(samples):
            values = np.asarray(values)
            native = values.astype(values.dtype.newbyteorder("="), copy=False)
            self._inputs.setdefault(name, hashlib.sha256()).update(np.ascontiguousarray(native).tobytes())

    def hexdigest(self) -> str:
        if set(self._inputs) <= {None}:
            return self._inputs.get(None, hashlib.sha256()).hexdigest()
        combined = {name: digest.hexdigest() for name, digest in sorted(self._inputs.items())}
        return hashlib.sha256(json.dumps(combined, sort_keys=True).encode()).hexdigest()


def _nonfinite_reason(values: np.ndarray, name: str | None) -> str:
    kinds = [kind for kind, test in (("NaN", np.isnan), ("Inf", np.isinf)) if test(values).any()]
    return f"non-finite input{'' if name is None else f' {name}'}: holds {' and '.join(kinds)}"


def bad_rows(samples: Samples, labels: np.ndarray | None = None, checked: Labels | None = None) -> dict[int, str]:
    """The rows of ``samples`` that are bad, and why (one reason per row, naming each input that is bad)."""
    reasons: dict[int, list[str]] = {}
    for name, values in parts(samples):
        if not np.issubdtype(values.dtype, np.floating):
            continue
        flat = values.reshape(len(values), -1)
        for index in np.flatnonzero(~np.isfinite(flat).all(axis=1)):
            reasons.setdefault(int(index), []).append(_nonfinite_reason(flat[index], name))
    for index, reason in checked.reasons(labels).items() if checked is not None and labels is not None else ():
        reasons.setdefault(index, []).append(reason)
    return {index: "; ".join(found) for index, found in sorted(reasons.items())}


def take(samples: Samples, rows: np.ndarray) -> Samples:
    if isinstance(samples, dict):
        return {name: values[rows] for name, values in samples.items()}
    return samples[rows]


class RangeFindings:
    """What reading one range found: the rejected samples (``rejected``, runs in id order) and the digest
    of the stored ones (``digest``). ``keep`` checks rows as they are read and returns the good ones;
    under ``on_bad_sample: error`` the first bad sample is kept as ``error`` (one line naming file and
    row) and the reading stops."""

    def __init__(self, files: Sequence[SourceFile], on_bad_sample: str = "skip", labels: Labels | None = None):
        self._files, self.policy, self.labels = files, on_bad_sample, labels
        self.digest = RowDigest()
        self.labels_digest = hashlib.sha256() if labels is not None else None  # of the kept samples' labels
        self._bad: dict[int, str] = {}  # sample id -> reason
        self.error: InputError | None = None

    def _source(self, sample_id: int) -> SourceFile:
        return overlapping(self._files, sample_id, sample_id + 1)[0]

    def reject(self, sample_id: int, reason: str) -> None:
        self._bad.setdefault(sample_id, reason)
        if self.policy == "error" and self.error is None:
            source = self._source(sample_id)
            self.error = InputError(
                f"{source.path}: row {source.row(sample_id)}: {reason} (input.on_bad_sample is error; set it "
                "to skip to leave bad samples out; the shards already complete are kept for the rerun)"
            )

    @property
    def samples_sha256(self) -> str:
        """The digest of the samples kept so far."""
        return self.digest.hexdigest()

    @property
    def labels_sha256(self) -> str | None:
        """The digest of the labels of the samples kept so far (their bytes as read, in id order); None
        without labels."""
        return None if self.labels_digest is None else self.labels_digest.hexdigest()

    @property
    def rejected(self) -> list[Rejected]:
        """The rejected samples as runs of consecutive ids of one file, bad for one reason, in id order."""
        runs: list[Rejected] = []
        for sample_id, reason in sorted(self._bad.items()):
            last = runs[-1] if runs else None
            same_file = last is not None and sample_id < self._source(last.start).stop_id
            if same_file and last.stop == sample_id and last.reason == reason:
                runs[-1] = dataclasses.replace(last, stop=sample_id + 1)
            else:
                source = self._source(sample_id)
                runs.append(Rejected(source.path, reason, source.row(sample_id), sample_id, sample_id + 1))
        return runs

    def keep(self, ids: np.ndarray, samples: Samples, labels: np.ndarray | None = None):
        """The good rows of a slice as read (``ids`` in order), added to the digest; the bad ones rejected."""
        bad = bad_rows(samples, labels, self.labels)
        for index, reason in bad.items():
            self.reject(int(ids[index]), reason)
        if bad:
            good = np.setdiff1d(np.arange(len(ids)), list(bad))
            ids, samples = ids[good], take(samples, good)
            labels = None if labels is None else labels[good]
        self.digest.update(samples)
        if self.labels_digest is not None and labels is not None:
            self.labels_digest.update(np.ascontiguousarray(labels).tobytes())
        return ids, samples, labels


def _whole_stream(source: SourceFile) -> bool:
    """A .npz member is one zip stream checked by one CRC at its end: once a read fails, no row of it can
    be trusted, so every row of the file is bad, and every range reading it reads it to its end (so that
    which worker reads which rows cannot change that). In .npy and HDF5 files rows are independent."""
    return file_format(source.path) == "npz"


def _read_file(source: SourceFile, lo: int, hi: int, max_rows: int, label_key: str | None, findings: RangeFindings):
    """Rows ``[lo, hi)`` (ids) of one array file in slices, checked: ``(ids, samples, labels)`` of the good
    rows."""
    whole = _whole_stream(source)
    try:
        with contextlib.ExitStack() as stack:
            rows = stack.enter_context(open_samples(source))
            labels = stack.enter_context(open_rows(source.path, label_key, "jacobian.labels.key")) if label_key else None

            def read(first: int, last: int):
                local = slice(source.row(first), source.row(last))
                values = labels.read(local.start, local.stop).reshape(-1) if labels is not None else None
                if source.label is not None:  # the file's own label, for each of its samples
                    values = np.full(last - first, source.label, np.int64)
                return rows.read(local.start, local.stop), values

            pending = []
            for first in range(lo, hi, max_rows):
                last = min(first + max_rows, hi)
                try:
                    pending.append((np.arange(first, last, dtype=np.int64), *read(first, last)))
                except CorruptInputError:
                    if whole:
                        raise
                    for one in range(first, last):  # which rows exactly cannot be read
                        try:
                            pending.append((np.arange(one, one + 1, dtype=np.int64), *read(one, one + 1)))
                        except CorruptInputError as err:
                            findings.reject(one, err.reason)
                if not whole:
                    yield from pending
                    pending = []
                    if findings.error is not None:
                        return
            if whole:
                arrays.read_to_end(rows)
                yield from pending
    except CorruptInputError as err:  # the file as a whole (an .npz member, a file gone since the plan)
        for sample_id in range(lo, hi):
            findings.reject(sample_id, err.reason)


def _read_images(batch: list[SourceFile], findings: RangeFindings) -> Iterator[tuple[np.ndarray, Samples, np.ndarray | None]]:
    """Images read together; their labels are the files' own (``SourceFile.label``) where they have one."""
    ids, samples, labels = [], [], []
    for source, sample in zip(batch, images.read_images(batch, errors=True), strict=True):
        if isinstance(sample, CorruptInputError):
            findings.reject(source.first_id, sample.reason)
        elif sample.shape != tuple(source.sample_shape):
            findings.reject(source.first_id, f"corrupt: decodes to shape {sample.shape}, its header said "
                                             f"{tuple(source.sample_shape)}")
        else:
            ids.append(source.first_id)
            samples.append(sample)
            labels.append(source.label)
    if ids:
        yield np.array(ids, np.int64), np.stack(samples), None if labels[0] is None else np.array(labels, np.int64)


class _SmallFiles:
    """Rows of consecutive small array files (fewer rows in the range than a slice), gathered into slices
    of up to ``max_rows`` rows and checked together: per file, only its opening and reading remain, so a
    range of one-row files costs about what the same rows of one file do. Rows of one dtype (per input)
    are gathered; a file of another dtype begins a new slice, so each row is hashed in its own dtype, as
    read. Where a file's rows cannot be read (``findings.reject`` as read), the rows gathered before
    them are checked first: rejections stay in id order, and under ``on_bad_sample: error`` the first
    bad sample is the one named."""

    def __init__(self, max_rows: int, findings: RangeFindings):
        self.max_rows, self._findings = max_rows, findings
        self._parts: list[tuple[np.ndarray, Samples, np.ndarray | None]] = []
        self._rows = 0
        self.ready: list[tuple[np.ndarray, Samples, np.ndarray | None]] = []  # checked slices, to hand on

    @property
    def error(self) -> InputError | None:
        return self._findings.error

    def reject(self, sample_id: int, reason: str) -> None:
        self.flush()
        self._findings.reject(sample_id, reason)

    def add(self, ids: np.ndarray, samples: Samples, labels: np.ndarray | None) -> None:
        if self._parts and (self._rows + len(ids) > self.max_rows or _kinds(self._parts[-1]) != _kinds((ids, samples, labels))):
            self.flush()
        self._parts.append((ids, samples, labels))
        self._rows += len(ids)

    def flush(self) -> None:
        if not self._parts:
            return
        gathered, self._parts, self._rows = self._parts, [], 0
        ids = np.concatenate([part[0] for part in gathered])
        if isinstance(gathered[0][1], dict):
            samples = {name: np.concatenate([part[1][name] for part in gathered]) for name in gathered[0][1]}
        else:
            samples = np.concatenate([part[1] for part in gathered])
        labels = None if gathered[0][2] is None else np.concatenate([part[2] for part in gathered])
        ids, samples, labels = self._findings.keep(ids, samples, labels)
        if len(ids):
            self.ready.append((ids, samples, labels))


def _kinds(part: tuple[np.ndarray, Samples, np.ndarray | None]) -> tuple:
    """What rows must share to be concatenated: their dtypes (per input) and their labels' dtype."""
    _, samples, labels = part
    return tuple((name, values.dtype) for name, values in parts(samples)), None if labels is None else labels.dtype


def checked_slices(
    files: Sequence[SourceFile], start: int, stop: int, max_rows: int, findings: RangeFindings, label_key: str | None = None
) -> Iterator[tuple[np.ndarray, Samples, np.ndarray | None]]:
    """``(sample_ids, samples, labels)`` of the good samples of ids ``[start, stop)`` in id order, as read
    (the file's dtype), in slices of at most ``max_rows`` rows; a slice of a file with ``max_rows`` rows
    or more in the range is of that file alone, consecutive small files (one-row ``.npy`` files, images)
    are read together (``_SmallFiles``). The bad samples go to ``findings`` (see ``RangeFindings``), which
    also hashes the good ones, in id order whatever the slicing. Stops after the first bad sample under
    ``on_bad_sample: error``."""
    pending: list[SourceFile] = []  # consecutive images not yet read
    small = _SmallFiles(max_rows, findings)
    npy = arrays.SmallNpyFiles()

    def images():
        if pending:
            batch = pending.copy()
            pending.clear()
            yield from checked(_read_images(batch, findings))

    def gathered(flush: bool = False):
        if flush:
            small.flush()
        while small.ready:
            yield small.ready.pop(0)

    def checked(slices):
        for ids, samples, labels in slices:
            ids, samples, labels = findings.keep(ids, samples, labels)
            if len(ids):
                yield ids, samples, labels
            if findings.error is not None:
                return

    for source in overlapping(files, start, stop):  # not a pass over a million files per range
        lo, hi = max(start, source.first_id), min(stop, source.stop_id)
        if findings.error is not None:
            continue
        if source.image is not None:
            yield from gathered(flush=True)
            pending.append(source)
            if len(pending) == max_rows:
                yield from images()
            continue
        yield from images()
        if findings.error is not None:
            continue
        if hi - lo < max_rows:
            whole = (npy.rows(source.path, source.row(lo), source.row(hi))
                     if label_key is None and source.num_samples < max_rows and source.path.endswith(".npy")
                     and storage.is_local(source.path) else None)
            if whole is not None:
                labels = None if source.label is None else np.full(hi - lo, source.label, np.int64)
                small.add(np.arange(lo, hi, dtype=np.int64), whole, labels)
            else:
                for ids, samples, labels in _read_file(source, lo, hi, max_rows, label_key, small):
                    small.add(ids, samples, labels)
            yield from gathered()
        else:
            yield from gathered(flush=True)
            if findings.error is None:
                yield from checked(_read_file(source, lo, hi, max_rows, label_key, findings))
    if findings.error is None:
        yield from images()
        yield from gathered(flush=True)
