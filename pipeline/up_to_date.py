"""Whether an output folder already holds this run's complete result, judged from metadata alone: a
rerun with nothing to do (a scheduled job's usual case) then plans nothing, runs no pipeline and
writes only its manifest (``runner.run``).

The full plan (``pipeline.plan.make_job``) costs in the number of input files: it places every file on
the id line and compares every shard's recorded inputs with the plan, and the pipeline then reads every
kept shard's bytes again and rewrites the view and ``inputs.h5`` (48 s for a million one-sample files,
``benchmarks/README.md``). A folder is up to date when its last complete run was this run and nothing
it was computed from changed since, told the way a resumed run tells a changed input file (its stamp),
as make and rsync do:

- its manifest records this config, run identity, model identity and library versions;
- the listing finds exactly the files its ``inputs.h5`` lists (but those removed), each with the stamp
  recorded there (a file added, gone, grown or rewritten since is another run's work);
- every shard the run's ranges name is there, and no other: each with the run's key and the digest of
  its samples the manifest lists, and none written after the manifest (nor the view, the aggregates,
  the table or the list of rejected samples): a killed later run, or a hand, changed what it named.

Anything else (a remote folder, a labels table whose rows have no stamp, a temporary file a killed run
left, a folder written by another version) is left to the full plan, which answers for every case: the
shortcut only ever agrees with it (``tests/test_up_to_date.py`` compares the two manifests).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jacobeam.pipeline.folder import Folder
from jacobeam.pipeline.identity import identity_differences, run_identity
from jacobeam.transforms import model_identity
from jacobeam.transforms.model_differences import differences as model_changes
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import (
    AGGREGATES,
    INPUTS_PREVIOUS,
    MANIFEST,
    REJECTED_FILE,
    SAMPLES_SHA256,
    SHARDS_DIR,
    VIEW,
    is_folder_temp,
    is_shard_temp,
    shard_name,
)
from jacobeam.transforms.output.shards import attr_text
from jacobeam.transforms.spec import ModelSource, version


def why_not(folder: Folder, config: Mapping[str, Any], listed: Mapping[str, str],
            model: ModelSource | None) -> str | None:
    """None when ``folder`` holds the complete result of the run ``config`` describes (the config as the
    manifest records it, ``plan._recorded_config``) over the input files ``listed`` (path -> stamp, as
    ``discover.list_inputs`` gives them); otherwise why the run must be planned in full. ``model``: the
    model whose identity the folder must record (it is built or read last, only once everything else
    holds); None: not known without the engine (a test's engine factory), never up to date."""
    manifest = folder.manifest
    if model is None:
        return "no model identity to compare"
    if manifest is None or "input_files" not in manifest or folder.alien or folder.unproven:
        return "no complete result of this version's kind"
    if not storage.is_local(folder.root):
        return "a remote output folder"  # its objects' times are the store's: checked by the pipeline
    names = [storage.name_of(path) for path in folder.owned]
    if any(is_folder_temp(name) or is_shard_temp(name) or name == INPUTS_PREVIOUS for name in names):
        return "a stopped run's files are in the folder"
    if manifest.get("jacobeam_version") != version():
        return "written by another version of jacobeam"
    if json.loads(json.dumps(config)) != manifest["config"]:
        return "another config"
    labels = config["jacobian"].get("labels") or {}
    if labels.get("table"):
        return "labels from a table (no stamp of its rows)"
    if identity_differences(manifest.get("run_identity") or {}, run_identity(config)):
        return "another run identity"
    if model_identity.version_differences(manifest.get("versions") or {}, model_identity.library_versions()):
        return "other library versions"
    reason = _shards_differ(folder) or _files_differ(folder, listed)
    if reason:
        return reason
    if not manifest.get("model_identity"):
        return "no model identity recorded"
    if model_changes(manifest["model_identity"], model_identity.model_identity(model)):
        return "another model"
    return None


def _changed_after(path: str, written: float) -> bool:
    """Whether the file at ``path`` is missing or was written after ``written`` (a time in seconds)."""
    try:
        return os.stat(path).st_mtime > written
    except OSError:
        return True


def _shards_differ(folder: Folder) -> str | None:
    manifest, root = folder.manifest, folder.root
    written = os.stat(storage.join(root, MANIFEST)).st_mtime
    listed = {storage.name_of(entry["file"]): entry for entry in manifest["shards"]}
    expected = {shard_name(start, stop) for start, stop in _ranges(manifest)}
    if set(listed) != expected or set(folder.shards) != expected:
        return "the shards are not those of every range"
    for name, attrs in folder.shards.items():
        digest = listed[name].get("samples_sha256")
        if (not digest or attr_text(attrs.get(SAMPLES_SHA256, "")) != digest
                or attr_text(attrs.get("run_key", "")) != manifest["run_key"]):
            return f"{SHARDS_DIR}/{name} is not the shard the manifest lists"
        if _changed_after(storage.join(root, SHARDS_DIR, name), written):
            return f"{SHARDS_DIR}/{name} changed after the manifest"
    others = [VIEW, manifest["input_files"]["file"], REJECTED_FILE, *([AGGREGATES] if manifest.get("aggregates") else [])]
    changed = next((name for name in others if _changed_after(storage.join(root, name), written)), None)
    if changed:
        return f"{changed} is missing or changed after the manifest"
    return None


def _ranges(manifest: Mapping[str, Any]) -> list[tuple[int, int]]:
    from jacobeam.pipeline.ids import shard_ranges

    segments = [tuple(s) for s in manifest.get("id_segments") or [[0, manifest["num_samples"]]]]
    return [(r.start, r.stop) for r in shard_ranges(segments, manifest["config"]["output"]["samples_per_shard"])]


def _files_differ(folder: Folder, listed: Mapping[str, str]) -> str | None:
    """Whether the files listed now are not exactly those the table lists (but removed ones), each with
    its recorded stamp: compared as sorted byte-string columns (a dict per row costs seconds at a
    million rows). A file placed in pieces (it grew) is one file, every piece with its stamp."""
    table = folder.manifest["inputs"]
    kept = ~table.column("removed", False)
    paths, stamps = table.column("path", b"")[kept], table.column("stamp", b"")[kept]
    if (stamps == b"").any():
        return "a file without a recorded stamp"
    if len(paths) > 1 and (paths[1:] < paths[:-1]).any():  # ids in segments (files added later): by path
        order = np.argsort(paths, kind="stable")
        paths, stamps = paths[order], stamps[order]
    piece = paths[1:] == paths[:-1]  # a later piece of the file before it
    if (stamps[1:][piece] != stamps[:-1][piece]).any():
        return "a file's pieces with other stamps"
    first = np.concatenate([[True], ~piece])
    paths, stamps = paths[first], stamps[first]
    if len(paths) != len(listed):
        return f"{len(listed)} input files listed, {len(paths)} recorded"
    now_paths, now_stamps = _utf8(list(listed)), _utf8(list(listed.values()))
    differ = (now_paths != paths) | (now_stamps != stamps)
    if differ.any():
        return f"input file {now_paths[differ.argmax()].decode()} is new or changed"
    return None


def _utf8(texts: list[str]) -> np.ndarray:
    return np.array([text.encode() for text in texts], dtype=bytes)
