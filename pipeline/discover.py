"""Input discovery: the files the config's globs match, described and scanned once.

A folder named in ``input.paths`` stands for every PNG/JPEG image under it. Every sample is read once
here (``transforms.inputs.scan``), before any output is touched, so that a bad sample under
``input.on_bad_sample: error`` stops the run with nothing written. A file unchanged since the folder's
last complete run (``known_scans``: the same stamp) is not read again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from typing import Any

from jacobeam.transforms.errors import CorruptInputError, InputError
from jacobeam.transforms.inputs.readers import assign_ids, check_consistent, describe, unreadable_file
from jacobeam.transforms.inputs.registry import IMAGE_SUFFIXES
from jacobeam.transforms.inputs.scan import FileScan, Labels, merge_rows, scan_files
from jacobeam.transforms.inputs.types import ImageOptions, Key, Shape, SourceFile
from jacobeam.transforms.output import storage

log = logging.getLogger(__name__)


def _match(patterns: list[str]) -> dict[str, str]:
    """Every file the globs match, each once, sorted, with its stamp (``SourceFile.stamp``: size and time
    of the last change, from the listing). A folder (a pattern without wildcards naming one, or ending in
    ``/``) stands for every PNG/JPEG image under it, at any depth."""
    from apache_beam.io.filesystems import FileSystems

    paths: dict[str, str] = {}
    for given in patterns:
        # Absolute: Beam matches a glob without a folder part ("*.npy") against nothing, and workers
        # need not share the launcher's working directory.
        pattern = storage.absolute(given)
        folder = not any(c in pattern for c in "*?[") and (pattern.endswith("/") or storage.is_folder(pattern))
        (match,) = FileSystems.match([storage.join(pattern, "**") if folder else pattern])
        found = {m.path: f"{m.size_in_bytes}:{m.last_updated_in_seconds!r}" for m in match.metadata_list
                 if not folder or m.path.lower().endswith(IMAGE_SUFFIXES)}
        if not found:
            what = "holds no PNG or JPEG images" if folder else "matches no files"
            where = "" if pattern == given else f" (looked for {pattern})"
            raise InputError(f"input.paths: {given!r} {what}{where}")
        paths.update(found)
    return dict(sorted(paths.items()))


def resolve_inputs(
    patterns: list[str], key: Key, on_bad_sample: str = "error", sample_shape: Shape | None = None,
    image: ImageOptions | None = None,
) -> list[SourceFile]:
    """Every file the globs match (each file once), described, in sorted path order with ids in that
    order. Under ``skip`` a file that cannot be opened is kept as an unreadable file without samples.
    Files are described a few at a time (an image is decoded to learn its shape)."""

    def described(path: str) -> SourceFile:
        try:
            return dataclasses.replace(describe(path, key, sample_shape, image), stamp=stamps[path])
        except CorruptInputError as err:
            if on_bad_sample != "skip":
                raise InputError(f"{err} (input.on_bad_sample is error; 'skip' would leave this file out)") from err
            log.warning("skipping %s: %s", path, err.reason)
            return unreadable_file(path, key, err.reason)

    stamps = _match(patterns)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="jacobeam-describe") as pool:
        files = assign_ids(list(pool.map(described, stamps)))
    check_consistent(files, sample_shape)
    if not any(f.num_samples for f in files):
        raise InputError(f"input.paths: the {len(files)} matched file(s) hold no readable samples")
    return files


def scan_inputs(
    files: list[SourceFile], on_bad_sample: str, labels: Labels | None = None, known: dict[str, FileScan] | None = None
) -> dict[str, FileScan]:
    """Read every sample (and its label) once (see ``transforms.inputs.scan``), but of the files in
    ``known`` (unchanged since an earlier run scanned them: ``known_scans``); under ``error`` the first
    bad one stops the run."""
    began = time.monotonic()
    known = known or {}
    scans = {**scan_files([f for f in files if f.path not in known], labels=labels), **known}
    notes = [f"{len(known)} unchanged since the last run, not read again"] if known else []
    unreadable = sum(1 for f in files if f.unreadable is not None)
    notes += [f"{unreadable} unreadable"] if unreadable else []
    log.info("scanned %d of %d input file(s) in %.1f s%s", len(files) - len(known) - unreadable, len(files),
             time.monotonic() - began, f" ({', '.join(notes)})" if notes else "")
    if on_bad_sample == "error":
        bad = [(path, rows) for path, scan in sorted(scans.items()) for rows in scan.bad]
        if bad:
            path, rows = bad[0]
            total = sum(scan.num_bad for scan in scans.values())
            more = f"; {total} bad sample(s) in all" if total > 1 else ""
            raise InputError(
                f"{path}: row {rows.row}: {rows.reason}{more}. Nothing was written "
                "(input.on_bad_sample is error; set it to skip to leave bad samples out)"
            )
    return scans


def known_scans(
    files: list[SourceFile], manifest: dict[str, Any] | None, rejected: list[dict[str, Any]], labels: Labels | None = None
) -> dict[str, FileScan]:
    """The scans an earlier, complete run made of the files that are unchanged since (the same path,
    stamp and number of samples in its ``manifest``): their sha256 as it recorded it and their bad rows
    from its ``rejected`` lines, so that a rerun or an incremental run reads only new or changed files.
    With ``labels``, only if that run checked the same labels against the same number of outputs."""
    if manifest is None:
        return {}
    if labels is not None:
        theirs = (manifest["config"].get("jacobian", {}).get("labels") or {}).get("key")
        outputs = math.prod(manifest.get("output_shape") or [0])
        if theirs != labels.key or labels.outputs is None or outputs != labels.outputs:
            return {}
    recorded = {storage.absolute(entry["path"]): entry for entry in manifest["inputs"]}
    bad: dict[str, list[tuple[int, str]]] = {}
    for line in rejected:
        if line.get("row") is not None:
            bad.setdefault(storage.absolute(line["file"]), []).append((int(line["row"]), line["reason"]))
    known = {}
    for source in files:
        entry = recorded.get(source.path)
        if (source.unreadable is None and source.stamp is not None and entry is not None
                and entry.get("stamp") == source.stamp and entry["num_samples"] == source.num_samples
                and entry.get("data_sha256") is not None):
            known[source.path] = FileScan(source.path, merge_rows(bad.get(source.path, [])), entry["data_sha256"])
    return known
