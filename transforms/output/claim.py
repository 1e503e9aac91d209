"""A pipeline of the user's own claiming its output folder when it runs (``WriteShards``' first step): the
folder's lease (``transforms.output.lease``), held under the spec's run id, whose commits prove it
(``transforms.output.fence``), and a refusal to write into a folder holding another run's result unless
told to replace it.

``jacobeam run`` does both in its planner (``pipeline.plan``, ``pipeline.folder``), which also resumes.
A user's pipeline (``pipeline_spec``) writes every shard every time, so any result already there is
another run's; a planned job's spec written by ``WriteShards`` may share its folder with runs of the
same plan (the same run key) only.
"""

from __future__ import annotations

import json
import logging

from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output import fence, lease, storage
from jacobeam.transforms.output.layout import (
    AGGREGATES,
    INPUTS_PREVIOUS,
    INPUTS_TABLE,
    MANIFEST,
    REJECTED_FILE,
    SHARDS_DIR,
    VIEW,
    is_checksum_file,
    is_folder_temp,
    is_shard_file,
    is_shard_temp,
)
from jacobeam.transforms.output.shards import read_attrs
from jacobeam.transforms.spec import JobSpec

log = logging.getLogger(__name__)

# A pipeline of one's own has no --wait: it runs again once the other run has ended.
BUSY_HINT = "run the pipeline again once that run has ended, or write another output_dir"


def claim(spec: JobSpec, replace: bool = False) -> lease.Lease | None:
    """Take ``spec.output_dir``'s lease as run ``spec.run_id`` (a local, S3 or GCS folder; ``LeaseBusy``
    while another run holds it) and check that the folder holds no other run's result; with ``replace``,
    remove that result (only files with jacobeam's names) instead of refusing. Returns the lease (None
    where the folder has none), which the caller releases; ``release`` frees it from any process."""
    root = spec.output_dir
    held = lease.Lease(root, run_id=spec.run_id, busy_hint=BUSY_HINT).acquire() if spec.fenced else None
    try:
        others = other_runs(spec)
        if others and not replace:
            raise OutputError(
                f"output folder {root} holds another run's result ({'; '.join(others)}): "
                "WriteShards(spec, replace=True) replaces it (only files jacobeam wrote), or choose another output_dir"
            )
        if others:
            log.warning("WriteShards: replacing another run's result in %s", root)
            with fence.held(fence.of(spec)):
                storage.delete(*owned_files(root))
    except BaseException:
        if held is not None:
            held.release()
        raise
    return held


def release(spec: JobSpec) -> None:
    """Free the lease run ``spec.run_id`` holds on ``spec.output_dir``, from whichever process: its record
    is removed if it still names this run (a request conditional on the record read, on S3 and GCS)."""
    if not spec.fenced:
        return
    file = lease.lease_file(spec.output_dir, spec.run_id)
    found = file.read()
    if found is not None and lease.parse(found[0]).get("holder") == spec.run_id:
        file.take_over(found[1])  # only if it is still the record read


def other_runs(spec: JobSpec) -> list[str]:
    """What in ``spec.output_dir`` another run wrote: its manifest, its shards (one line each kind)."""
    root, found = spec.output_dir, []
    manifest_path = storage.join(root, MANIFEST)
    if storage.exists(manifest_path):
        try:
            theirs = json.loads(storage.read_text(manifest_path)).get("run_key")
        except ValueError:
            theirs = None
        if spec.open_ended or theirs != spec.run_key:
            found.append(f"{MANIFEST} of run key {theirs}")
    shards = storage.join(root, SHARDS_DIR)
    names = [name for name in storage.listdir(shards) if is_shard_file(name)]
    if not spec.open_ended:
        names = [name for name in names if read_attrs(storage.join(shards, name)).get("run_key") != spec.run_key]
    if names:
        found.append(f"{len(names)} shard(s), {SHARDS_DIR}/{names[0]} first")
    return found


def owned_files(root: str) -> list[str]:
    """The files of the folder ``root`` with jacobeam's names (a result's, a killed run's temporary files)."""
    shards = storage.join(root, SHARDS_DIR)
    inside = [
        storage.join(shards, name) for name in storage.listdir(shards)
        if is_shard_file(name) or is_checksum_file(name) or is_shard_temp(name)
    ]
    top = [storage.join(root, name) for name in storage.listdir(root)
           if name in (MANIFEST, VIEW, AGGREGATES, REJECTED_FILE, INPUTS_TABLE, INPUTS_PREVIOUS) or is_folder_temp(name)]
    return inside + top
