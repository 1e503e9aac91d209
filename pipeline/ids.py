"""Placing input files on the id line and tiling it with shard ranges.

A fresh run numbers the samples of its input files in sorted path order. When the output folder
already has a manifest (an earlier, complete run), every file it lists keeps its ids, and files that
are new are sorted among themselves and placed after the old ones: ids never move, so the old shards
stay valid and only the new samples are computed (incremental runs). Each run that adds files adds an
"id segment"; shard ranges tile each segment from its start in steps of ``samples_per_shard``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jacobeam.transforms.inputs.readers import assign_ids, shape_record
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.output.storage import absolute
from jacobeam.transforms.spec import ShardRange


def place_files(
    files: list[SourceFile], previous: dict[str, Any] | None
) -> tuple[list[SourceFile], list[tuple[int, int]], list[str]]:
    """Give each file its ids: kept from the previous manifest, new files after the old ones.

    Returns the placed files (in id order), the id segments, and how the inputs differ from the
    previous run's (a file gone, or holding another number or kind of samples), which makes the folder
    another run's result. A file whose stamp changed keeps its ids: the shards it feeds are computed
    again (``pipeline.folder.stale_shards``).
    """
    if previous is None:
        placed = assign_ids(files)
        return placed, [(0, max(f.stop_id for f in placed))], []
    current = {f.path: f for f in files}
    placed, differences, end = [], [], 0
    for entry in previous["inputs"]:
        # Folders written before paths were made absolute list them relative to the working directory.
        path, old_stop = absolute(entry["path"]), entry["first_id"] + entry["num_samples"]
        end = max(end, old_stop)
        now = current.pop(path, None)
        if now is None:
            differences.append(f"input file {path} (ids {entry['first_id']}..{old_stop} there) is not among this run's inputs")
            continue
        changed = [
            f"{what} {json.dumps(before)} there, {json.dumps(after)} now"
            for what, before, after in (
                ("samples", entry["num_samples"], now.num_samples),
                ("key", entry.get("key"), now.key),
                ("dtype", entry.get("dtype"), now.dtype),
            )
            if before != after
        ]
        if changed:
            differences.append(f"input file {path} changed: {', '.join(changed)}")
        placed.append(dataclasses.replace(now, first_id=entry["first_id"]))
    segments = [tuple(s) for s in previous.get("id_segments") or [[0, end]]]
    next_id = end
    for path in sorted(current):  # new files: sorted among themselves, after every old id
        placed.append(dataclasses.replace(current[path], first_id=next_id))
        next_id += current[path].num_samples
    if next_id > end:
        segments.append((end, next_id))
    if previous.get("input_shape") is not None and any(f.unreadable is None for f in placed):
        shape = shape_record(next(f.sample_shape for f in placed if f.unreadable is None))
        if shape != previous["input_shape"]:
            differences.append(f"samples of shape {json.dumps(previous['input_shape'])} there, {json.dumps(shape)} now")
    placed.sort(key=lambda f: (f.first_id, f.path))
    return placed, segments, differences


def shard_ranges(segments: list[tuple[int, int]], step: int) -> list[ShardRange]:
    """Tile each id segment from its start in steps of ``step``."""
    return [ShardRange(lo, min(lo + step, last)) for first, last in segments for lo in range(first, last, step)]
