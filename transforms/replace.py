"""A result replaced with no moment at which the folder holds neither: the new result is computed in a
folder of its own inside the output folder, ``OUT/.jacobeam-overwrite`` (``layout.OVERWRITE_DIR``), and
moved in once its manifest is committed there (``move_in``). ``jacobeam run --overwrite``
(``pipeline.overwrite``) and ``WriteShards(spec, replace=True)`` both replace so.

``move_in`` removes the old manifest (the old result ends there), then the old files (the view first),
moves the new files in (shards first, the view last), writes the manifest at the top and removes the
staged one. Each step can be done again, so a move stopped among them is finished by the next run of the
folder, before it plans. Every removal and move is a commit of the run holding the folder's lease
(``guard``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from jacobeam.transforms.finalize import remove_temp_files, write_manifest
from jacobeam.transforms.output import fence, storage
from jacobeam.transforms.output.layout import (
    AGGREGATES,
    CHECKSUM_SUFFIXES,
    ENGINE_PLAN,
    INPUTS_PREVIOUS,
    INPUTS_TABLE,
    LEASE,
    MANIFEST,
    OVERWRITE_DIR,
    REJECTED_FILE,
    SHARDS_DIR,
    VIEW,
    is_checksum_file,
    is_shard_file,
)
from jacobeam.transforms.testing import faults

log = logging.getLogger(__name__)

# The staged result's files other than its shards, in the order they are moved in: the view, which
# points at the shards, once they are all there.
_FILES = (INPUTS_TABLE, REJECTED_FILE, AGGREGATES, ENGINE_PLAN, VIEW)


def staging(root: str) -> str:
    """Where a replacement of the folder ``root``'s result is computed."""
    return storage.join(storage.normalize(root), OVERWRITE_DIR)


def pending(root: str) -> dict[str, Any] | None:
    """The manifest a replacement of ``root`` committed in its staging folder and has not moved in yet
    (None: there is none)."""
    path = storage.join(staging(root), MANIFEST)
    if not storage.exists(path):
        return None
    try:
        manifest = json.loads(storage.read_text(path))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "run_key" in manifest and "shards" in manifest else None


def move_in(root: str, output_path: str, guard: fence.Fence | None, owned: Callable[[str], list[str]]) -> dict[str, Any] | None:
    """Replace ``root``'s result with the one committed in its staging folder, if one was (``pending``);
    returns the manifest now at the top (None: nothing to move in). ``output_path``: the folder as the run
    names it, which the moved manifest records (``config.output.path``, where it has one); ``owned``: the
    files of ``root`` jacobeam wrote, to remove (the old result's)."""
    manifest = pending(root)
    if manifest is None:
        return None
    root, staged = storage.normalize(root), staging(root)
    log.info("%s: the result committed in %s replaces the folder's result", root, OVERWRITE_DIR)
    remove_temp_files(staged, guard=guard)
    new = _staged_files(staged)
    # The engine's plan is only a cache, kept under its key: the new run's, or an old one never used again.
    named = {shard["file"] for shard in manifest["shards"]} | {VIEW, INPUTS_TABLE, REJECTED_FILE, ENGINE_PLAN}
    named |= {AGGREGATES} if manifest.get("aggregates") else set()
    named |= {name + suffix for name in named for suffix in CHECKSUM_SUFFIXES}
    with fence.held(guard):
        storage.delete(storage.join(root, MANIFEST))
    # Every file but the new result's moved in already (a move stopped among them moved some), the old
    # view first: it would read the old shards and the new ones as one result while they are swapped.
    moved = named - set(new)
    old = sorted((path for path in owned(root) if _relative(root, path) not in moved),
                 key=lambda path: _relative(root, path) != VIEW)
    if old:
        with fence.held(guard):
            storage.delete(*old)
    for name in new:
        with fence.held(guard):
            storage.rename(storage.join(staged, name), storage.join(root, name))
        faults.reached("overwrite_move")
    top = copy.deepcopy(manifest)
    top["output_dir"] = root
    if isinstance((top.get("config") or {}).get("output"), dict):  # a planned run's; a pipeline's has none
        top["config"]["output"]["path"] = output_path
    write_manifest(root, top, guard)
    faults.reached("overwrite_moved")
    with fence.held(guard):
        storage.delete(storage.join(staged, MANIFEST), storage.join(staged, INPUTS_PREVIOUS),
                       storage.join(staged, LEASE))
    _remove_if_empty(staged)
    return top


def _staged_files(staged: str) -> list[str]:
    """The staged result's files to move in, relative to the staging folder, in the order to move them: each
    shard before its checksum sidecar (which marks a remote shard complete), the view last."""
    shards = sorted(name for name in storage.listdir(storage.join(staged, SHARDS_DIR))
                    if is_shard_file(name) or is_checksum_file(name))
    top = set(storage.listdir(staged))
    return [f"{SHARDS_DIR}/{name}" for name in shards] + [name for name in _FILES if name in top]


def _relative(root: str, path: str) -> str:
    return path[len(root):].lstrip("/")


def _remove_if_empty(staged: str) -> None:
    """The local staging folder, emptied (a remote one is gone with its last object)."""
    if not storage.is_local(staged):
        return
    for folder in (os.path.join(staged, SHARDS_DIR), staged):
        try:
            os.rmdir(folder)
        except OSError:
            pass
