"""A pipeline of the user's own claiming its output folder (``WriteShards``): the folder's lease
(``transforms.output.lease``), and a refusal to write into a folder holding another run's result unless
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
from jacobeam.transforms.output import lease, storage
from jacobeam.transforms.output.layout import (
    AGGREGATES,
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

_claimed: dict[str, lease.Lease] = {}  # the leases ``claim`` took in this process, by folder


def claim(spec: JobSpec, replace: bool = False) -> None:
    """Take ``spec.output_dir``'s lease (a local, S3 or GCS folder; ``LeaseBusy`` while another run holds
    it) and check that it holds no other run's result; with ``replace``, remove that result (only files
    with jacobeam's names) instead of refusing. The lease is held until ``release`` (``finalize`` calls it)
    or the process ends; claiming a folder this process holds again keeps its lease."""
    root = spec.output_dir
    if lease.supported(root):
        held = _claimed.get(root)
        if held is None or not held.held:
            _claimed[root] = lease.Lease(root).acquire()
    try:
        others = other_runs(spec)
        if others and not replace:
            raise OutputError(
                f"output folder {root} holds another run's result ({'; '.join(others)}): "
                "WriteShards(spec, replace=True) replaces it (only files jacobeam wrote), or choose another output_dir"
            )
    except BaseException:
        release(root)
        raise
    if not others:
        return
    log.warning("WriteShards: replacing another run's result in %s", root)
    storage.delete(*_owned_files(root))


def release(output_dir: str) -> None:
    """Release the lease ``claim`` took for ``output_dir`` in this process, if any."""
    held = _claimed.pop(output_dir, None)
    if held is not None:
        held.release()


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


def _owned_files(root: str) -> list[str]:
    shards = storage.join(root, SHARDS_DIR)
    inside = [
        storage.join(shards, name) for name in storage.listdir(shards)
        if is_shard_file(name) or is_checksum_file(name) or is_shard_temp(name)
    ]
    top = [storage.join(root, name) for name in storage.listdir(root)
           if name in (MANIFEST, VIEW, AGGREGATES, REJECTED_FILE) or is_folder_temp(name)]
    return inside + top
