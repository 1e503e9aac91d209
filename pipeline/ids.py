"""Placing input files on the id line and tiling it with shard ranges.

A fresh run numbers the samples of its input files in sorted path order. When the output folder
already has a manifest (an earlier, complete run), every file it lists keeps its ids, and files that
are new are sorted among themselves and placed after the old ones: ids never move, so the old shards
stay valid and only the new samples are computed (incremental runs). Each run that adds files adds an
"id segment"; shard ranges tile each segment from its start in steps of ``samples_per_shard``. A file
that grew by appended rows keeps its old ids, and its new rows are numbered as a new file's would be.
A file gone keeps its ids too, marked removed: they stay taken, holding no sample.
Files are matched with the manifest's by path, resolved (``path_mapper``: another spelling, or a folder
copied or moved together with its inputs, is the same file).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from jacobeam.transforms.inputs.readers import assign_ids, shape_from_record, shape_record
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.output.storage import absolute, exists, is_local
from jacobeam.transforms.spec import ShardRange

log = logging.getLogger(__name__)


def path_mapper(previous: dict[str, Any] | None, files: list[SourceFile], output_dir: str | None = None
                ) -> Callable[[str], str]:
    """``recorded path -> this run's path`` of the same input file, for the paths a folder recorded (its
    manifest's inputs, its shards' ``inputs`` and ``input_stamps``): a path is compared resolved
    (``./d/a.npy``, ``d/a.npy``, its absolute path and a spelling through a symbolic link are one file),
    and where the folder was copied or moved together with its inputs (``cp -a``, run from the copy), a
    file at the same place relative to the output folder as the recorded one is that file. A path that
    is none of this run's files is returned absolute, as it is."""
    current = {f.path for f in files}
    old_root = _recorded_root(previous)
    new_root = os.path.realpath(output_dir) if output_dir and is_local(output_dir) else None

    @functools.cache
    def real_paths() -> dict[str, str]:  # resolved only once a recorded path is not one of this run's as it is
        return {os.path.realpath(path): path for path in current if is_local(path)}

    def as_now(path: str) -> str:
        if path in current:  # as this run names it: most paths, a million in a large folder
            return path
        path = absolute(path)
        if path in current or not is_local(path):
            return path
        resolved = os.path.realpath(path)
        real = real_paths()
        if resolved in real:
            return real[resolved]
        if old_root is not None and new_root is not None:
            moved = os.path.normpath(os.path.join(new_root, os.path.relpath(resolved, old_root)))
            return real.get(moved, path)
        return path

    return as_now


def _recorded_root(previous: dict[str, Any] | None) -> str | None:
    """Where the output folder was when its manifest was written (``output_dir``; a manifest written before
    it recorded that: its config's ``output.path`` if absolute), resolved; None if not known or remote."""
    if previous is None:
        return None
    root = previous.get("output_dir") or (previous.get("config") or {}).get("output", {}).get("path")
    if not root or not is_local(root) or not os.path.isabs(root):
        return None
    return os.path.realpath(root)


def _in_copy(previous: dict[str, Any], output_dir: str | None, folders: set[str]) -> Callable[[str], str | None]:
    """For a folder copied (or moved) together with its inputs: a recorded input path's place in the copy,
    where that is a folder holding this run's input files but the file is not there (deleted from the
    copy; the recorded path is the original's, still there). None otherwise: not copied, or copied
    without its inputs (a recorded file this run does not match is then a narrowed glob's)."""
    old_root = _recorded_root(previous)
    new_root = os.path.realpath(output_dir) if output_dir and is_local(output_dir) else None
    if old_root is None or new_root is None or old_root == new_root:
        return lambda path: None

    def copy_of(path: str) -> str | None:
        if not is_local(path):
            return None
        moved = os.path.normpath(os.path.join(new_root, os.path.relpath(os.path.realpath(path), old_root)))
        return moved if moved != path and os.path.dirname(moved) in folders and not exists(moved) else None

    return copy_of


def place_files(
    files: list[SourceFile], previous: dict[str, Any] | None, output_dir: str | None = None
) -> tuple[list[SourceFile], list[tuple[int, int]], list[str]]:
    """Give each file its ids: kept from the previous manifest, new files after the old ones.

    Returns the placed files (in id order), the id segments, and how the inputs differ from the
    previous run's (a file holding fewer samples or another kind of them), which makes the folder
    another run's result. A file gone (or removed before) is placed as its pieces, marked removed
    (``SourceFile.removed``): their ids stay taken, their samples leave the result (``JobSpec.removed``);
    a file of that path found again later is a new file, its samples new ids after the old ones. The
    previous manifest's paths are matched with this run's as ``path_mapper`` does (``output_dir``: where
    the folder is now). A file whose stamp changed keeps its ids: the shards
    it feeds are stale (``pipeline.folder.stale_shards``), read again and computed again where their
    samples differ. A file that grew (rows appended) keeps the ids of its old rows and is placed a
    second time, as a piece of its own (``SourceFile.first_row``), for the rows appended: their ids come
    after every old id, as a new file's do.
    """
    if previous is None:
        placed = assign_ids(files)
        return placed, [(0, max(f.stop_id for f in placed))], []
    as_now = path_mapper(previous, files, output_dir)
    current = {f.path: f for f in files}
    copy_of = _in_copy(previous, output_dir, {os.path.realpath(os.path.dirname(path)) for path in current if is_local(path)})
    placed, differences, end = [], [], 0
    covered: dict[str, int] = {}  # rows of each file that the previous run's pieces hold
    gone = [0, 0]  # files newly gone, and their samples: for the log
    for entry in previous["inputs"]:
        # Folders written before paths were made absolute list them relative to the working directory.
        path, old_stop = as_now(entry["path"]), entry["first_id"] + entry["num_samples"]
        end = max(end, old_stop)
        now = current.get(path)
        if now is None and not entry.get("removed") and entry["num_samples"] and exists(path):
            twin = copy_of(path)
            if twin is None:
                # Still there, no longer matched: a narrowed glob, not a deletion (which would drop its samples
                # and renumber them for good when the glob is put back).
                differences.append(f"input file {path} is no longer matched by input.paths but is still there "
                                   f"(its {entry['num_samples']} sample(s) are in this result; to take them out, "
                                   "delete or move the file)")
                continue
            path = twin  # the original's file, still there: the copy's, beside this run's files, is gone
        if now is None or entry.get("removed"):
            # A file gone keeps its ids, marked removed: its samples leave the result, the others stay
            # where they are. One without ids (unreadable) just goes. A file of that path found again
            # (re-added) is a new file: placed after the old ids, below.
            if entry["num_samples"]:
                placed.append(_removed_piece(entry, path, previous))
                if not entry.get("removed"):
                    gone[0] += 1
                    gone[1] += entry["num_samples"]
            continue
        # A file unreadable then (under skip: no ids, no dtype) and readable now is appended, as a new file.
        changed = [] if entry.get("unreadable") else [
            f"{what} {json.dumps(before)} there, {json.dumps(after)} now"
            for what, before, after in (("key", entry.get("key"), now.key), ("dtype", entry.get("dtype"), now.dtype))
            if before != after
        ]
        if changed:
            differences.append(f"input file {path} changed: {', '.join(changed)}")
        first_row = entry.get("first_row", 0)
        covered[path] = max(covered.get(path, 0), first_row + entry["num_samples"])
        if entry["num_samples"] or now.num_samples == 0:  # a file unreadable then, readable now: all appended
            same = (now.first_id, now.num_samples, now.first_row) == (entry["first_id"], entry["num_samples"], first_row)
            placed.append(now if same else dataclasses.replace(now, first_id=entry["first_id"],
                                                               num_samples=entry["num_samples"], first_row=first_row))
    segments = [tuple(s) for s in previous.get("id_segments") or [[0, end]]]
    appended = []  # new files, and the rows appended to old ones
    for path in sorted(current):
        now, rows = current[path], covered.get(path)
        if rows is None:
            appended.append(now)
        elif now.num_samples < rows:
            differences.append(f"input file {path} changed: samples {rows} there, {now.num_samples} now")
        elif now.num_samples > rows:
            appended.append(dataclasses.replace(now, first_row=rows, num_samples=now.num_samples - rows))
    next_id = end
    for piece in appended:  # sorted by path among themselves, after every old id
        placed.append(dataclasses.replace(piece, first_id=next_id))
        next_id += piece.num_samples
    if next_id > end:
        segments.append((end, next_id))
    if gone[0]:
        log.info("%d input file(s) gone since the last run: their %d sample(s) leave the result (their ids stay "
                 "taken, marked removed)", *gone)
    if previous.get("input_shape") is not None and any(f.unreadable is None and not f.removed for f in placed):
        shape = shape_record(next(f.sample_shape for f in placed if f.unreadable is None and not f.removed))
        if shape != previous["input_shape"]:
            differences.append(f"samples of shape {json.dumps(previous['input_shape'])} there, {json.dumps(shape)} now")
    placed.sort(key=lambda f: (f.first_id, f.path))
    return placed, segments, differences


def _removed_piece(entry: dict[str, Any], path: str, previous: dict[str, Any]) -> SourceFile:
    """The piece of a gone file that a previous manifest's ``entry`` lists, marked removed."""
    shape = previous.get("input_shape")
    return SourceFile(
        path=path, key=entry.get("key"), num_samples=entry["num_samples"],
        sample_shape=shape_from_record(shape) if shape is not None else (), dtype=entry.get("dtype"),
        first_id=entry["first_id"], data_sha256=entry.get("data_sha256"), stamp=entry.get("stamp"),
        first_row=entry.get("first_row", 0), removed=True,
    )


def shard_ranges(segments: list[tuple[int, int]], step: int) -> list[ShardRange]:
    """Tile each id segment from its start in steps of ``step``."""
    return [ShardRange(lo, min(lo + step, last)) for first, last in segments for lo in range(first, last, step)]
