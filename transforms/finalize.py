"""The last step of a job: check that the shards and the rejected samples (which each shard lists for
its range) cover every id exactly once, then write ``jacobians.h5``, ``rejected.jsonl``, ``inputs.h5`` and
``manifest.json``.

Each file is written under a temporary name and renamed into place, so a reader (or the next run) sees
the old file or the new one, never half of one (in a remote folder: written locally, copied to the
temporary remote name, then renamed; see ``transforms.output.storage``). The manifest is written last:
an output folder is complete exactly when it has a manifest, and what it holds is what the manifest
lists. Leftover temporary files of a killed run are removed by the next run (at its start and here)
and never read.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.typehints.decorators import no_annotations

from jacobeam.transforms import model_identity, self_check
from jacobeam.transforms.aggregates import PARTIALS, combine_shards, write_aggregates
from jacobeam.transforms.errors import InputError, OutputError, span
from jacobeam.transforms.inputs.readers import shape_record
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.output import fence, inputs_table, storage
from jacobeam.transforms.output.layout import (
    CHECKSUM_SUFFIXES,
    CRC32C_SUFFIX,
    MANIFEST,
    NONFINITE,
    REJECTED_FILE,
    REJECTED_GROUP,
    SAMPLE_ID,
    SHARDS_DIR,
    SOURCE_FILE,
    SOURCE_FILES,
    SOURCE_ROOT,
    SOURCE_ROW,
    VIEW,
    is_folder_temp,
    is_shard_temp,
    temp_run,
)
from jacobeam.transforms.output.shards import ShardRecord, read_attrs
from jacobeam.transforms.spec import JobSpec, Rejected, version
from jacobeam.transforms.testing import faults

log = logging.getLogger(__name__)


def check_coverage(
    records: Sequence[ShardRecord], num_samples: int, rejected: Sequence[Rejected] = ()
) -> list[ShardRecord]:
    """Records sorted by id, after checking that shards and rejected samples cover ``[0, num_samples)``
    exactly once: ranges without gap or overlap, and in each shard's range every id either stored in the
    shard or rejected."""
    ordered = sorted(records, key=lambda record: record.start)
    runs = sorted((r for r in rejected if r.start is not None), key=lambda r: r.start)
    for before, after in zip(runs, runs[1:]):
        if after.start < before.stop:
            raise OutputError(f"rejected samples overlap at {span(after.start, before.stop)}")
    starts = [record.start for record in ordered]
    inside = [0] * len(ordered)  # rejected ids within each shard's range
    spans = [(record.start, record.stop) for record in ordered]
    for run in runs:
        index = bisect.bisect_right(starts, run.start) - 1
        if index >= 0 and run.stop <= ordered[index].stop:
            inside[index] += run.num_samples
        else:
            spans.append((run.start, run.stop))  # a range whose samples were all rejected: no shard
    expected = 0
    for start, stop in sorted(spans):
        if start != expected:
            where = f"leave {span(expected, start)} uncovered" if start > expected else f"overlap at {span(start, expected)}"
            raise OutputError(f"shards and rejected samples {where}")
        expected = stop
    if expected != num_samples:
        raise OutputError(f"shards and rejected samples cover {span(0, expected)}, expected {span(0, num_samples)}")
    for record, rejected_inside in zip(ordered, inside):
        if record.num_samples + rejected_inside != record.stop - record.start:
            raise OutputError(
                f"{record.file}: {record.num_samples} samples stored and {rejected_inside} rejected, "
                f"expected {record.stop - record.start} ids in all"
            )
    return ordered


@dataclasses.dataclass(frozen=True)
class RowSources:
    """Where each row of ``jacobians.h5`` came from: row ``i`` is row ``row[i]`` of input file
    ``files[file[i]]``, a path relative to the folder ``root``."""

    file: np.ndarray  # (n,) int64: index into ``files``
    row: np.ndarray  # (n,) int64: the row (record, sample) within the file (``SourceFile.row``)
    files: list[str]  # the files the rows come from, in id order of their first row
    root: str


def input_root(patterns: Sequence[str], paths: Sequence[str]) -> str:
    """The folder the input paths are relative to in ``source_files``: the deepest one that holds every
    input file and what each ``input.paths`` pattern fixes (its part before the first wildcard; a folder
    named, itself; a file named, its folder). Taken from the patterns, not the files alone, so that it
    stays put when files come and go: ``data/*/*.png`` has the root ``data`` whichever day folders it
    matches, and ``data/train`` (an image folder) has ``data/train``, so the class folder leads each path."""
    absolute = [storage.absolute(pattern) for pattern in patterns]
    # A pattern without wildcards names a file (one of the paths) or a folder (it holds them).
    files = {p for p in absolute if not any(c in p for c in "*?[")}.intersection(paths)
    folders = []
    for pattern in absolute:
        parts = pattern.rstrip("/").split("/")
        wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
        if wild is not None:
            folders.append("/".join(parts[:wild]) + "/")
        else:
            folders.append("/".join(parts[:-1] if pattern in files else parts) + "/")
    # The common prefix of many strings is that of the first and the last in sorted order: no pass per file.
    candidates = [*folders, *([min(paths), max(paths)] if paths else [])]
    prefix = os.path.commonprefix([min(candidates), max(candidates)]) if candidates else ""
    cut = prefix.rfind("/")
    return prefix[:cut] if cut > 0 else "/" if prefix.startswith("/") else ""


def row_sources(files: Sequence[SourceFile], ids: np.ndarray, root: str) -> RowSources:
    """The source of each of the stored ids ``ids`` (increasing): the input file piece whose ids hold it,
    found by bisection over the pieces' first ids (vectorised: a million rows in a fraction of a second).
    The pieces of a file appended to (``SourceFile.first_row``) are one file. Raises ``OutputError`` for
    an id that no file's ids hold."""
    # Per file only a few flat passes, no search: a million files of one sample each cost about a second.
    pieces = [f for f in files if f.num_samples]
    first = np.fromiter((f.first_id for f in pieces), np.int64, len(pieces))
    if np.any(np.diff(first) < 0):
        order = np.argsort(first, kind="stable")
        pieces, first = [pieces[i] for i in order], first[order]
    stop = first + np.fromiter((f.num_samples for f in pieces), np.int64, len(pieces))
    first_row = np.fromiter((f.first_row for f in pieces), np.int64, len(pieces))
    paths = [f.path for f in pieces]
    unique = list(dict.fromkeys(paths))  # each file once, in id order of its first piece
    if len(unique) == len(paths):
        piece_file = np.arange(len(paths), dtype=np.int64)
    else:  # a file appended to: its pieces are one file
        number = {path: k for k, path in enumerate(unique)}
        piece_file = np.fromiter((number[path] for path in paths), np.int64, len(paths))
    ids = np.asarray(ids, np.int64)
    at = np.searchsorted(first, ids, side="right") - 1
    outside = (at < 0) | (ids >= stop[np.maximum(at, 0)]) if len(pieces) else np.ones(len(ids), bool)
    if outside.any():
        row = int(np.argmax(outside))
        raise OutputError(f"{VIEW}: row {row} holds sample id {int(ids[row])}, which no input file's ids hold")
    of_row = piece_file[at]
    used = np.zeros(len(unique), bool)  # the files that have rows, numbered in id order of their first row
    used[of_row] = True
    cut = len(root.rstrip("/")) + 1 if root else 0
    return RowSources(
        file=(np.cumsum(used) - 1)[of_row],
        row=ids - first[at] + first_row[at],
        files=[unique[k][cut:] for k in np.flatnonzero(used).tolist()],
        root=root,
    )


def stored_ids(output_dir: str, records: Sequence[ShardRecord]) -> np.ndarray:
    """The ``sample_id`` column of the shards ``records`` (in id order), as the shards hold it: which ids
    have a row of the view."""
    columns = []
    for record in records:
        with storage.open_h5(storage.join(output_dir, record.file)) as h5:
            ids = h5[SAMPLE_ID][:] if SAMPLE_ID in h5 else np.zeros(0, np.int64)
        if len(ids) != record.num_samples or (len(ids) and (ids[0] < record.start or ids[-1] >= record.stop)):
            held = f" from {int(ids[0])} to {int(ids[-1])}" if len(ids) else ""
            raise OutputError(f"{record.file}: {len(ids)} sample ids{held}, expected {record.num_samples} "
                              f"within {span(record.start, record.stop)}")
        columns.append(ids)
    ids = np.concatenate(columns) if columns else np.zeros(0, np.int64)
    if np.any(np.diff(ids) <= 0):
        raise OutputError(f"the shards' sample ids are not increasing (first at row {int(np.argmax(np.diff(ids) <= 0)) + 1})")
    return ids


def spec_row_sources(spec: JobSpec, records: Sequence[ShardRecord]) -> RowSources:
    """The sources of the rows of the shards ``records`` of ``spec``'s run. A user's own pipeline has one
    source, ``(pipeline)``, whose row is the id: there is no file to name."""
    ids = stored_ids(spec.output_dir, records)
    if spec.open_ended:
        return row_sources(spec.files, ids, "")
    patterns = (spec.config.get("input") or {}).get("paths") or []
    paths = [f.path for f in spec.files if f.num_samples]
    return row_sources(spec.files, ids, input_root(patterns, paths))


def write_virtual_view(
    output_dir: str, records: Sequence[ShardRecord], guard: fence.Fence | None = None,
    sources: RowSources | None = None,
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Write ``jacobians.h5``: one virtual dataset per shard dataset, all shards in id order, and with
    ``sources``, the rows' sources (``source_file``, ``source_row``, ``source_files``, attribute
    ``source_root``) as datasets of its own.

    Rows are the shards' rows in id order; rejected samples have no row, so row ``i`` holds the sample
    with id ``sample_id[i]`` (row ``i`` is id ``i`` when nothing was rejected). Sources are relative paths
    (``shards/...``), which HDF5 resolves against the view's own folder, so the output folder can be
    moved. A row whose shard file is missing reads as no value at all (``_missing``: NaN, -1), never as
    zeros; its source datasets, stored in the view itself, still read. Returns each per-row dataset's
    per-sample shape and dtype. ``guard``: the run's fence for the commit.
    """
    import h5py

    total = sum(record.num_samples for record in records)
    fields: dict[str, tuple] = {}

    def per_sample(name: str, item) -> None:
        if isinstance(item, h5py.Dataset) and name.split("/")[0] not in (PARTIALS, REJECTED_GROUP):
            fields[name] = (item.shape[1:], item.dtype)

    with storage.open_h5(storage.join(output_dir, records[0].file)) as first:
        first.visititems(per_sample)
    layouts = {name: h5py.VirtualLayout((total, *shape), dtype) for name, (shape, dtype) in fields.items()}
    row = 0
    for record in records:
        for name, (shape, _) in fields.items():
            source = h5py.VirtualSource(record.file, name, shape=(record.num_samples, *shape))
            layouts[name][row : row + record.num_samples] = source
        row += record.num_samples

    def write(temp: Path) -> None:
        with h5py.File(temp, "w", libver="latest") as view:
            view.attrs["jacobeam_version"] = version()
            for name, layout in layouts.items():
                view.create_virtual_dataset(name, layout, fillvalue=_missing(fields[name][1]))
                faults.reached("view_write")
            if sources is not None:
                view.create_dataset(SOURCE_FILE, data=sources.file)
                view.create_dataset(SOURCE_ROW, data=sources.row)
                view.create_dataset(SOURCE_FILES, data=np.array(sources.files, dtype=object), dtype=h5py.string_dtype())
                view.attrs[SOURCE_ROOT] = sources.root

    storage.write_atomically(storage.join(output_dir, VIEW), write, "view", guard)
    found = {name: (tuple(int(d) for d in shape), dtype.name) for name, (shape, dtype) in fields.items()}
    return found if sources is None else {**found, SOURCE_FILE: ((), "int64"), SOURCE_ROW: ((), "int64")}


def _missing(dtype) -> Any:
    """What a row of the view reads where its shard is missing: never a value a shard could hold as data.
    NaN for floats, -1 for signed integers (``sample_id``, ``output_index``), the largest value for unsigned
    ones, True for flags (``nonfinite``: the row has no finite values)."""
    kind = np.dtype(dtype).kind
    if kind == "f":
        return np.nan
    if kind == "i":
        return -1
    if kind == "u":
        return np.iinfo(dtype).max
    return True if kind == "b" else None


def view_datasets(view) -> dict[str, Any]:
    """Every dataset of an open ``jacobians.h5``, nested ones (``jacobian/<input>``) included."""
    import h5py

    found: dict[str, Any] = {}

    def visit(name: str, item) -> None:  # returns None: visititems stops at the first value that is not
        if isinstance(item, h5py.Dataset):
            found[name] = item

    view.visititems(visit)
    return found


def missing_sources(root: str | Path, view) -> list[str]:
    """Problems with an open ``jacobians.h5``: each virtual source file that is missing. (HDF5 reads a
    missing source as fill values without an error, so a reader must check.)"""
    readers: dict[str, list[str]] = {}  # each source file: the datasets that read from it
    for name, dataset in view_datasets(view).items():
        for source in sorted({s.file_name for s in dataset.virtual_sources()}) if dataset.is_virtual else []:
            readers.setdefault(source, []).append(name)
    problems = []
    for source, names in sorted(readers.items()):
        if not storage.exists(storage.join(root, source)):
            others = f" (as do {', '.join(names[1:])})" if len(names) > 1 else ""
            problems.append(f"{VIEW}:{names[0]} reads from {source}, which is missing{others}")
    return problems


def removed_runs(spec: JobSpec) -> list[Rejected]:
    """The removed file pieces' ids (``JobSpec.removed``) as runs, cut at the shard ranges' bounds (as a
    shard's rejected samples are), for the coverage check and the manifest."""
    if not spec.removed:
        return []
    bounds = sorted({r.start for r in spec.ranges()} | {r.stop for r in spec.ranges()})
    runs = []
    for f in spec.removed:
        cuts = [f.first_id, *bounds[bisect.bisect_right(bounds, f.first_id):bisect.bisect_left(bounds, f.stop_id)], f.stop_id]
        runs += [Rejected(f.path, "removed", f.row(lo), lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    return runs


def _intervals(runs: Sequence[Rejected]) -> list[list[int]]:
    """Rejected ids as merged ``[start, stop)`` intervals (compact in the manifest)."""
    merged: list[list[int]] = []
    for run in sorted((r for r in runs if r.start is not None), key=lambda r: r.start):
        if merged and merged[-1][1] == run.start:
            merged[-1][1] = run.stop
        else:
            merged.append([run.start, run.stop])
    return merged


def write_rejected(output_dir: str, rejected: Sequence[Rejected], guard: fence.Fence | None = None) -> str:
    """Write ``rejected.jsonl``, one line per rejected sample (``id``, ``file``, ``row``, ``reason``) in id
    order, files without ids first; empty when nothing was rejected. Returns its sha256."""
    ordered = sorted(rejected, key=lambda r: (r.start is not None, r.start or 0, r.file))
    text = "".join(json.dumps(line) + "\n" for run in ordered for line in run.lines())
    storage.write_atomically(storage.join(output_dir, REJECTED_FILE), lambda temp: temp.write_text(text), "rejected",
                             guard)
    return hashlib.sha256(text.encode()).hexdigest()


def input_entries(spec: JobSpec) -> Iterator[dict[str, Any]]:
    """One row of ``inputs.h5`` per input file (a piece of one, ``SourceFile.first_row``), in id order:
    what a later run places the files by (``pipeline.ids.place_files``) and ``verify`` reads them again by."""
    files = sorted([*spec.files, *spec.removed], key=lambda f: (f.first_id, f.path)) if spec.removed else spec.files
    for source in files:
        yield {
            "path": source.path,
            "key": source.key,
            "first_id": source.first_id,
            "stop_id": source.stop_id,
            "num_samples": source.num_samples,
            **({"first_row": source.first_row} if source.first_row else {}),  # rows appended to a file
            "dtype": source.dtype,
            "data_sha256": source.data_sha256,
            **({"stamp": source.stamp} if source.stamp else {}),
            **({"unreadable": source.unreadable} if source.unreadable else {}),
            **({"removed": True} if source.removed else {}),  # gone: its ids stay taken (``place_files``)
            **({"label": source.label} if source.label is not None else {}),  # jacobian.labels folders or table
        }


def build_manifest(
    spec: JobSpec,
    records: Sequence[ShardRecord],
    fields: dict[str, Any],
    rejected: Sequence[Rejected] = (),
    rejected_sha256: str | None = None,
    input_files: dict[str, Any] | None = None,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    first = next((record for record in records if record.num_samples), records[0])
    attrs = read_attrs(storage.join(spec.output_dir, first.file))
    computed = sum(record.num_samples for record in records if record.computed)
    stored = sum(record.num_samples for record in records)
    num_rejected = sum(run.num_samples for run in rejected)

    def rejected_in(record: ShardRecord) -> int:  # the range's ids neither stored nor removed (files gone)
        removed = sum(max(0, min(record.stop, f.stop_id) - max(record.start, f.first_id)) for f in spec.removed)
        return record.stop - record.start - record.num_samples - removed

    return {
        "jacobeam_version": version(),
        "created_at": _now(),
        "config": spec.config,
        "num_samples": spec.num_samples,  # input samples, i.e. ids 0..num_samples
        "num_rows": stored,  # samples stored (rows of jacobians.h5): num_samples minus the rejected ones
        "input_shape": shape_record(spec.sample_shape),  # a list, or {input name: list} for several inputs
        "output_shape": [int(d) for d in attrs["output_shape"]],
        "dtype": str(attrs["dtype"]),
        "model_fingerprint": first.model_fingerprint,
        # What the engine ran and why, as the first worker that computed a shard reported it; where every
        # shard was kept, as the folder's last manifest recorded it (the engine that computed them).
        "engine": next((record.engine for record in records if record.engine), None) or (previous or {}).get("engine"),
        "run_key": spec.run_key,
        "run_identity": spec.identity,
        # Where the folder was written: a copy of it (moved with its inputs) matches their paths by it.
        "output_dir": spec.output_dir,
        "model_identity": spec.model_identity or None,
        "datasets": {name: {"shape": ["n", *shape], "dtype": dtype} for name, (shape, dtype) in fields.items()},
        "stored": _stored(spec, records, previous),
        # jacobian.labels folders or table: how each file's label was given, and the class names by index.
        **({"labels": spec.labels} if spec.labels else {}),
        # The input files' table, one row each (``input_entries``), is in inputs.h5 (``inputs_table``).
        "input_files": input_files,
        "id_segments": [list(segment) for segment in spec.id_segments] or [[0, spec.num_samples]],
        "rejected": {
            "file": REJECTED_FILE,
            "sha256": rejected_sha256,
            "count": num_rejected,
            "ids": _intervals(rejected),
            "unreadable_files": sorted(run.file for run in rejected if run.start is None),
            "policy": spec.config.get("input", {}).get("on_bad_sample", "error"),
        },
        # The ids of input files gone since they were computed: neither rows nor rejected samples.
        "removed": {
            "count": sum(f.num_samples for f in spec.removed),
            "ids": _intervals(removed_runs(spec)),
            "files": len({f.path for f in spec.removed}),
        },
        "nonfinite": {"count": sum(record.nonfinite for record in records), "dataset": NONFINITE},
        "shards": [
            {
                "file": record.file,
                "start": record.start,
                "stop": record.stop,
                "num_samples": record.num_samples,
                "rejected": rejected_in(record),
                "nonfinite": record.nonfinite,
                **record.checksums,  # crc32c; sha256 for a kept remote shard written before CRC32C
                # The digest of its samples as read: with the inputs' stamps above, what tells a later run
                # that this shard (not another under its name) is up to date (``pipeline.folder.stale_shards``).
                **({"samples_sha256": record.samples_sha256} if record.samples_sha256 else {}),
                "computed_in_this_run": record.computed,
                **({"worker_pid": record.worker_pid, "engine_builds": record.engine_builds} if record.computed else {}),
                **({"self_check": record.self_check["checked"]} if record.self_check else {}),
            }
            for record in records
        ],
        # Each shard recomputed samples on their own (jacobian.self_check): what was checked, the largest
        # relative error, every kink and mismatch.
        "self_check": self_check.summary(spec.self_check, records),
        # The versions of this run's launcher; each shard records those of the worker that computed it.
        "versions": model_identity.library_versions(),
        "tf_threads": spec.tf_threads,
        "run": _run(spec.run_id, spec.started_at, computed, stored - computed),
    }


def rerun_manifest(manifest: dict[str, Any], run_id: str, started_at: float, tf_threads: int | None) -> dict[str, Any]:
    """The manifest of run ``run_id``, which found its folder up to date (``pipeline.up_to_date``):
    ``manifest``, the last run's, as ``build_manifest`` writes it for a run that computed nothing and
    kept every shard (the engine that computed them, no worker's figures, no time spent checking)."""
    recorded = {key: value for key, value in manifest.items() if key != "inputs"}  # the table's rows: inputs.h5

    def kept(shard: dict[str, Any]) -> dict[str, Any]:
        shard = {key: value for key, value in shard.items() if key not in ("worker_pid", "engine_builds")}
        if "self_check" in shard:
            shard["self_check"] = [{k: v for k, v in check.items() if k != "timing"} for check in shard["self_check"]]
        return {**shard, "computed_in_this_run": False}

    return {
        **recorded,
        "created_at": _now(),
        "shards": [kept(shard) for shard in manifest["shards"]],
        **({"self_check": {**manifest["self_check"], "seconds": 0.0}} if manifest.get("self_check") else {}),
        "tf_threads": tf_threads,
        "run": _run(run_id, started_at, 0, manifest["num_rows"]),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _run(run_id: str, started_at: float, computed: int, kept: int) -> dict[str, Any]:
    """The manifest's ``run``: ``run_id`` is its lease's holder (a run that lost the folder to this one
    names it)."""
    wall = time.time() - started_at
    return {"id": run_id, "wall_seconds": round(wall, 3), "samples_computed": computed, "samples_kept": kept,
            "samples_per_second": round(computed / wall, 2) if wall > 0 else None}


def _parameters(spec: JobSpec, records, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameter side's ``stored.parameters``: the objective, and the weights as the engine laid them out
    (``parameter_space.ParameterLayout.describe``: names, shapes, offsets, the layers of
    ``frobenius_by_layer``), with the projection's block rows: what rebuilds ``P``. A run that computed no
    shard has no engine's layout: the ``previous`` manifest's stands (the same run identity, the same weights)."""
    side = spec.engine.parameters
    engine = next((record.engine for record in records if record.engine and "layout" in record.engine), {})
    layout = engine.get("layout") or {
        key: value for key, value in (((previous or {}).get("stored") or {}).get("parameters") or {}).items()
        if key not in ("objective", "loss", "layers_asked", "projection_rebuilt_by")}
    found: dict[str, Any] = {"objective": side.objective, "loss": side.loss,
                             "layers_asked": None if side.layers is None else list(side.layers), **layout}
    if spec.engine.reduce.kind == "project":
        found["projection_rebuilt_by"] = "jacobeam.transforms.engine.parameter_space.projection_rows"
    return found


def _stored(spec: JobSpec, records=(), previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """How the stored datasets were made: the rows rule, the reduction and its parameters."""
    selection, reduction = spec.engine.outputs, spec.engine.reduce
    stored: dict[str, Any] = {"outputs": selection.rule, "reduce": reduction.kind}
    if selection.rule == "indices":
        stored["indices"] = list(selection.indices)
    if selection.rule == "top_k":
        stored["top_k"] = selection.k
    if selection.rule == "label":
        stored["labels_key"] = spec.label_key
    if reduction.kind in ("vjp", "jvp"):
        stored["vectors"] = reduction.vectors
    if reduction.kind == "project":
        stored["projection"] = {
            "dim": reduction.project_dim,
            "kind": reduction.project_kind,
            "seed": reduction.project_seed,
        }
        if reduction.project_structure != "dense":  # a dense projection's record as before the key existed
            from jacobeam.transforms.engine.parameter_space import kronecker_factors

            stored["projection"].update(structure=reduction.project_structure,
                                        kronecker_factors=list(kronecker_factors(reduction.project_dim)))
    if reduction.kind == "basis":
        stored["basis"] = {"input": reduction.basis_input, "output": reduction.basis_output}
    if spec.engine.parameters is not None:
        stored["parameters"] = _parameters(spec, records, previous)
    return stored


def check_shards(records: Sequence[ShardRecord], spec: JobSpec) -> list[str]:
    """Every shard the manifest will name is, on disk, the one its record describes: this run's key and
    the checksum its writer recorded (locally the bytes are read again; remotely the sidecar, which the
    writer checked against the bytes; a kept shard's was read by this run when it kept it). A shard
    replaced after its commit, by another run or by hand, stops the run before a manifest names it.
    Returns how the library versions of the workers that computed shards in this run differ from this
    process's (one line each), for a warning."""
    ours, versions = model_identity.library_versions(), []
    for record in records:
        path = storage.join(spec.output_dir, record.file)
        try:
            attrs = read_attrs(path)
        except (OSError, ValueError) as err:
            raise OutputError(f"{path}: the shard this run committed cannot be read any more ({err})") from err
        theirs = attrs.get("run_key")
        found = model_identity.version_differences(model_identity.versions_from_attrs(attrs) or {}, ours)
        if record.computed and found:
            versions.append(f"{record.file}: {', '.join(found)}")
        if theirs != spec.run_key:
            raise OutputError(f"{path}: replaced by another run's shard (run key {theirs}, this run {spec.run_key}) "
                              "after this run committed it: two runs are writing one output folder")
        if not record.computed or record.crc32c is None:  # a kept shard: this run's plan read its checksum
            continue
        if storage.is_local(path):
            crc = storage.crc32c(path)
        else:
            crc = storage.read_text(path + CRC32C_SUFFIX).strip() if storage.exists(path + CRC32C_SUFFIX) else None
        if crc != record.crc32c:
            raise OutputError(f"{path}: its bytes changed after this run committed it (crc32c {crc}, committed "
                              f"{record.crc32c}): two runs are writing one output folder, or it was edited")
    return versions


def remove_temp_files(output_dir: str, run_id: str | None = None, guard: fence.Fence | None = None) -> None:
    """Delete temporary files that killed writers left behind (only jacobeam's own names): every run's,
    or with ``run_id`` only that run's. ``guard``: the run's fence."""
    shards = storage.join(output_dir, SHARDS_DIR)
    temps = [storage.join(shards, name) for name in storage.listdir(shards) if is_shard_temp(name)]
    temps += [storage.join(output_dir, name) for name in storage.listdir(output_dir) if is_folder_temp(name)]
    ours = [path for path in temps if run_id is None or temp_run(storage.name_of(path)) == run_id]
    if ours:
        with fence.held(guard):
            storage.delete(*ours)


def write_manifest(output_dir: str, manifest: dict[str, Any], guard: fence.Fence | None = None) -> None:
    text = json.dumps(manifest, indent=2) + "\n"
    storage.write_atomically(storage.join(output_dir, MANIFEST), lambda temp: temp.write_text(text), "manifest", guard)


def _previous(output_dir: str) -> dict[str, Any] | None:
    """The folder's manifest before this run's replaces it, or None."""
    path = storage.join(output_dir, MANIFEST)
    return json.loads(storage.read_text(path)) if storage.exists(path) else None


def finalize(records: Sequence[ShardRecord], spec: JobSpec) -> dict[str, Any]:
    """Check that ``records`` and their rejected samples (and the plan's unreadable files) cover every id
    once, then write
    ``aggregates.h5`` (from the partial sums stored in the shards, if the job asks for aggregates),
    ``jacobians.h5``, ``rejected.jsonl`` and, last, ``manifest.json``; returns the manifest."""
    if spec.open_ended:  # a user's pipeline: ids 0..n-1, n known now
        count = max((record.stop for record in records), default=0)
        spec = dataclasses.replace(spec, files=(dataclasses.replace(spec.files[0], num_samples=count),))
    rejected = [*spec.file_rejects, *(run for record in records for run in record.rejected)]
    # The ids of removed files (``JobSpec.removed``) are covered as rejected ones are, but counted apart.
    ordered = check_coverage(records, spec.num_samples, [*rejected, *removed_runs(spec)])
    stored = [record for record in ordered if record.num_samples]
    if not stored:
        first = rejected[0]  # a sample's, or a whole file's (unreadable: no row)
        where = first.file if first.row is None else f"{first.file}: row {first.row}"
        raise InputError(f"input.paths: all {spec.num_samples} samples are rejected; nothing to compute "
                         f"({where}: {first.reason}, ...)")
    versions = check_shards(ordered, spec)
    if versions:  # a worker image other than the launcher's: the numbers may differ in the last bits
        log.warning("%d shard(s) computed with other library versions than this process's (the manifest's "
                    "versions): %s%s", len(versions), versions[0], ", ..." if len(versions) > 1 else "")
    weights = sorted({record.model_fingerprint for record in stored})
    if len(weights) > 1:  # worker processes that each loaded the model (runner.launcher_loads_model)
        raise OutputError(
            f"the shards were computed with {len(weights)} different model weights (fingerprints "
            + ", ".join(f"{w[:16]}…" for w in weights) + "): the model must load the same weights in every "
            "process (a factory: seed its initializers)"
        )
    guard = fence.of(spec)
    summary = write_aggregates(combine_shards(spec, ordered), spec, ordered)
    fields = write_virtual_view(spec.output_dir, stored, guard, spec_row_sources(spec, stored))
    rejected_sha256 = write_rejected(spec.output_dir, rejected, guard)
    # Its own only: at its end a run answers for its own files (the next run's start removes a killed run's).
    remove_temp_files(spec.output_dir, spec.run_id, guard)
    inputs_table.keep_previous(spec.output_dir, guard)  # the old manifest's table, until the new manifest
    input_files = inputs_table.write_table(spec.output_dir, input_entries(spec), guard)
    manifest = build_manifest(spec, ordered, fields, rejected, rejected_sha256, input_files, _previous(spec.output_dir))
    manifest["aggregates"] = summary
    write_manifest(spec.output_dir, manifest, guard)
    with fence.held(guard):
        inputs_table.drop_previous(spec.output_dir)
    if spec.obsolete:  # stale shards that no range of this run replaced: gone once no manifest names them
        with fence.held(guard):
            storage.delete(*(storage.join(spec.output_dir, file + suffix)
                             for file in spec.obsolete for suffix in ("", *CHECKSUM_SUFFIXES)))
    return manifest


@no_annotations
@beam.typehints.with_input_types(tuple[None, Iterable[ShardRecord]], JobSpec)
@beam.typehints.with_output_types(dict[str, Any])
def _all_records(keyed: tuple[None, Iterable[ShardRecord]], spec: JobSpec) -> dict[str, Any]:
    return finalize(list(keyed[1]), spec)


class Finalize(beam.PTransform):
    """``PCollection[ShardRecord] -> PCollection[manifest dict]``: one step after every shard is done.

    The records, each under one and the same key, meet in a ``GroupByKey`` (every runner groups; no side
    input, no combiner lifting needed), and ``finalize`` runs once on all of them. Rejected samples come
    from the records (each shard lists those of its range) and the plan (files that cannot be opened),
    the aggregates from the partial sums stored in the shards.
    """

    def __init__(self, spec: JobSpec):
        super().__init__()
        self._spec = spec

    def expand(self, records):
        return (
            records
            | "Key" >> beam.Map(lambda record: (None, record))
            | "AllShards" >> beam.GroupByKey()
            | "WriteManifest" >> beam.Map(_all_records, self._spec)
        )
