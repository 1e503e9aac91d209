"""Checks of an output folder's structure: checksums, id coverage, the view, the input files (their
samples against the digest each shard's worker computed as it read them).

Each check appends what it finds to a ``pipeline.verify.Report``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from jacobeam.transforms.errors import span
from jacobeam.transforms.finalize import missing_sources
from jacobeam.transforms.output import inputs_table, storage
from jacobeam.transforms.output.layout import MANIFEST, NONFINITE, REJECTED_FILE, SAMPLE_ID, SAMPLES_SHA256, VIEW

if TYPE_CHECKING:
    from jacobeam.pipeline.verify import Report


def with_checked_inputs(root: str, manifest: dict[str, Any], report: Report) -> dict[str, Any] | None:
    """The manifest with its input files' rows (``inputs_table.with_inputs``), after checking the table it
    points at (``input_files``: there, with the manifest's sha256 and row count; a manifest written before
    lists the files itself). None when the table cannot be read."""
    pointer = manifest.get("input_files")
    if pointer is None or "inputs" in manifest:
        return manifest
    path = inputs_table.table_path(root, pointer)
    if not storage.exists(path):
        report.problems.append(f"{pointer['file']}: missing (the manifest lists the input files there)")
        return None
    if storage.sha256(path) != pointer["sha256"]:
        report.problems.append(f"{pointer['file']}: sha256 differs from the manifest's (the file was changed)")
    try:
        rows = inputs_table.read_table(path)
    except (OSError, ValueError, KeyError) as err:
        report.problems.append(f"{pointer['file']}: cannot be read ({err})")
        return None
    if len(rows) != pointer["count"]:
        report.problems.append(f"{pointer['file']}: {len(rows)} input files, the manifest says {pointer['count']}")
    return {**manifest, "inputs": rows}


def check_structure(root: str, manifest: dict[str, Any], report: Report) -> list[tuple[str, np.ndarray]]:
    """Checksums and id coverage; returns each readable shard's file and ``sample_id`` column."""
    num_samples = int(manifest["num_samples"])
    inputs_stop = max((entry["stop_id"] for entry in manifest["inputs"]), default=0)
    if inputs_stop != num_samples:
        report.problems.append(f"{MANIFEST}: inputs cover {span(0, inputs_stop)}, num_samples is {num_samples}")
    seen = np.zeros(num_samples, np.int64)
    where: list[tuple[str, np.ndarray]] = []
    column = []
    for shard in manifest["shards"]:
        path = storage.join(root, shard["file"])
        if not storage.exists(path):
            report.problems.append(f"{shard['file']}: listed in the manifest but missing")
            continue
        # crc32c; sha256 in manifests written before CRC32C (and for a kept remote shard of such a run)
        algorithm = next((name for name in ("crc32c", "sha256") if shard.get(name)), None)
        if algorithm is None:
            report.problems.append(f"{shard['file']}: the manifest lists no checksum (crc32c or sha256)")
        elif getattr(storage, algorithm)(path) != shard[algorithm]:
            report.problems.append(f"{shard['file']}: {algorithm} differs from the manifest's (the file was changed)")
        report.shards_checked += 1
        with storage.open_h5(path) as h5:  # a shard of no rows (every sample rejected) has no datasets
            ids = h5[SAMPLE_ID][:] if SAMPLE_ID in h5 else np.zeros(0, np.int64)
            mask = h5[NONFINITE][:] if NONFINITE in h5 else np.zeros(len(ids), bool)
        column.append(ids)
        if len(ids) != shard["num_samples"]:
            report.problems.append(f"{shard['file']}: {len(ids)} rows, the manifest says {shard['num_samples']}")
        if len(ids) and (ids.min() < shard["start"] or ids.max() >= shard["stop"] or np.any(np.diff(ids) <= 0)):
            report.problems.append(f"{shard['file']}: sample ids not increasing within {span(shard['start'], shard['stop'])}")
            continue
        if int(mask.sum()) != shard.get("nonfinite", 0):
            report.problems.append(
                f"{shard['file']}: {int(mask.sum())} rows flagged nonfinite, the manifest says {shard.get('nonfinite', 0)}"
            )
        valid = ids[(ids >= 0) & (ids < num_samples)]
        np.add.at(seen, valid, 1)
        where.append((shard["file"], ids))
    rejected_ids = _rejected_ids(root, manifest, report)
    np.add.at(seen, rejected_ids[(rejected_ids >= 0) & (rejected_ids < num_samples)], 1)
    for start, stop in (manifest.get("removed") or {}).get("ids", []):  # of input files gone: neither row nor rejected
        seen[max(0, start):min(stop, num_samples)] += 1
    report.ids_checked = num_samples
    for count, what in ((0, "missing (neither stored, rejected nor removed)"), (2, "present more than once")):
        bad = np.flatnonzero(seen == 0) if count == 0 else np.flatnonzero(seen >= 2)
        if len(bad):
            report.ids_wrong += len(bad)
            report.problems.append(f"ids {what}: {len(bad)}, first {bad[:5].tolist()}")
    _check_view(root, np.concatenate(column) if column else np.zeros(0, np.int64), report)
    return where


def _rejected_ids(root: str, manifest: dict[str, Any], report: Report) -> np.ndarray:
    info = manifest.get("rejected")
    path = storage.join(root, REJECTED_FILE)
    if info is None:
        return np.zeros(0, np.int64)
    if not storage.exists(path):
        report.problems.append(f"{REJECTED_FILE}: missing")
        return np.zeros(0, np.int64)
    if info.get("sha256") and storage.sha256(path) != info["sha256"]:
        report.problems.append(f"{REJECTED_FILE}: sha256 differs from the manifest's (the file was changed)")
    ids = [record["id"] for record in map(json.loads, storage.read_text(path).splitlines()) if record["id"] is not None]
    if len(ids) != info.get("count", len(ids)):
        report.problems.append(f"{REJECTED_FILE}: {len(ids)} rejected ids, the manifest says {info['count']}")
    return np.asarray(ids, np.int64)


def _check_view(root: str, column: np.ndarray, report: Report) -> None:
    path = storage.join(root, VIEW)
    if not storage.exists(path):
        report.problems.append(f"{VIEW}: missing")
        return
    with storage.open_h5(path) as view:
        report.problems.extend(missing_sources(root, view))
        if not storage.is_local(root):
            # HDF5 resolves a virtual dataset's sources only on a local file system: read remotely, the
            # view would show fill values. Its sources were checked above; the shards themselves were read.
            report.notes.append(f"{VIEW}: remote folder, so its values were not read (its sources exist)")
            return
        if SAMPLE_ID in view and not report.problems and not np.array_equal(view[SAMPLE_ID][:], column):
            report.problems.append(f"{VIEW}: its sample_id column differs from the shards'")


def check_inputs(manifest: dict[str, Any], report: Report, ids: np.ndarray | None = None) -> bool:
    """The input files still hold the samples the manifest lists: every file, or (``ids``) those holding
    these sample ids, the files verify reads."""
    from jacobeam.transforms.errors import InputError
    from jacobeam.transforms.inputs.readers import describe, manifest_sources

    fine = True
    rows: dict[str, int] = {}  # each file's rows, over its pieces (a file that grew: ``SourceFile.first_row``)
    sources = {}
    listed = manifest_sources(manifest)
    wanted = None if ids is None else {source.path for source in _Pieces(listed).holding(ids)}
    for source in listed:
        if not source.unreadable:
            rows[source.path] = max(rows.get(source.path, 0), source.first_row + source.num_samples)
            if wanted is None or source.path in wanted:
                sources.setdefault(source.path, source)
    for path, source in sources.items():
        try:
            found = describe(source.path, source.key, source.sample_shape, source.image).num_samples
        except (InputError, OSError) as err:
            report.problems.append(f"input {source.path}: cannot be read any more ({err}); cannot recompute")
            fine = False
            continue
        if found != rows[path]:
            report.problems.append(f"input {source.path}: holds {found} samples, the manifest says {rows[path]}")
            fine = False
    return fine


class _Pieces:
    """The manifest's input pieces in id order, found by id without a pass over all of them per id (a
    million one-sample files)."""

    def __init__(self, sources: list):
        self.sources = sorted(sources, key=lambda source: (source.first_id, source.stop_id))
        self._stops = np.array([source.stop_id for source in self.sources], np.int64)

    def overlapping(self, start: int, stop: int) -> list:
        """The pieces holding ids in ``[start, stop)``."""
        index = int(np.searchsorted(self._stops, start, side="right"))
        found = []
        while index < len(self.sources) and self.sources[index].first_id < stop:
            found.append(self.sources[index])
            index += 1
        return found

    def holding(self, ids: np.ndarray) -> list:
        """The pieces holding any of ``ids``."""
        indices = np.unique(np.searchsorted(self._stops, np.asarray(ids, np.int64), side="right"))
        return [self.sources[i] for i in indices[indices < len(self.sources)]]


def _intervals(ids: np.ndarray) -> list[tuple[int, int]]:
    """Increasing ids as ``[start, stop)`` runs of consecutive ones."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(ids, breaks) if len(run)]


def check_digests(root: str, manifest: dict[str, Any], where: list[tuple[str, np.ndarray]], report: Report) -> list[str]:
    """The samples of the shards ``where`` lists read again from the input files and hashed
    (``checks.RowDigest``, as each shard's worker did while reading them): the digest its
    ``samples_sha256`` attribute holds, or a problem (the inputs changed since, or the shard holds other
    samples). Shards written before they stored a digest are not checked; input files that cannot be
    read any more leave a note. Returns the shards whose digests were compared."""
    from jacobeam.transforms.errors import JacobeamError
    from jacobeam.transforms.inputs.checks import RowDigest
    from jacobeam.transforms.inputs.readers import iter_slices, manifest_sources

    pieces = _Pieces(manifest_sources(manifest)) if where else None
    compared = []
    for file, ids in where:
        with storage.open_h5(storage.join(root, file)) as h5:
            stored = h5.attrs.get(SAMPLES_SHA256)
        if stored is None:
            continue
        digest = RowDigest()
        try:
            for lo, hi in _intervals(ids):
                for _, samples, _ in iter_slices(pieces.overlapping(lo, hi), lo, hi, 4096):
                    digest.update(samples)
        except (JacobeamError, OSError) as err:
            report.notes.append(f"input samples not compared with the shards' digests: {err}")
            return compared
        compared.append(file)
        if digest.hexdigest() != (stored.decode() if isinstance(stored, bytes) else str(stored)):
            report.problems.append(f"{file}: its samples, read again from the input files, differ from those its worker "
                                   f"read ({SAMPLES_SHA256}): the inputs changed since")
    return compared
