"""Every commit of a run proves first that the run still holds its output folder's lease: the fencing
token of lease-based locking, here the holder's id in the lease record (``JobSpec.run_id``).

A run paused past the stale time (SIGSTOP, a VM migration, a laptop lid) may have been taken over when
it resumes; its heartbeat notices only at the next beat, so each commit checks for itself: a shard's
rename, ``aggregates.h5``, ``jacobians.h5``, ``rejected.jsonl``, ``manifest.json``, the engine's plan, and
every deletion. A run that finds another holder, or none, raises ``LostLeaseError`` and commits nothing
more.

Locally the check and the commit hold the folder's lock, which a take-over also takes
(``transforms.output.lease``): a take-over cannot fall between them. On S3 and GCS there is no lock over
two objects: the check is a read of the lease just before the commit's request, so a take-over in
between those two requests is not seen (the lease's own changes are conditional on the store; see
``docs/resuming.md``). Folders without a lease (HDFS, ...) have no fence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterator

from jacobeam.transforms.errors import LostLeaseError
from jacobeam.transforms.output import lease, storage
from jacobeam.transforms.output.layout import MANIFEST


@functools.lru_cache(maxsize=16)
def _lease_file(folder: str, run_id: str):
    return lease.lease_file(folder, run_id)  # an S3 or GCS client is made once per process


@dataclasses.dataclass(frozen=True)
class Fence:
    """``with fence():`` around a commit: raises ``LostLeaseError`` unless run ``run_id`` holds the lease
    of ``folder``, and (locally) keeps it so until the block ends."""

    folder: str
    run_id: str

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        file = _lease_file(self.folder, self.run_id)
        with file.locked():
            found = file.read()
            holder = None if found is None else lease.parse(found[0])
            if holder is None or holder.get("holder") != self.run_id:
                taken = f"another run took it: {lease.describe(holder)}" if holder else _finished_by(self.folder)
                raise LostLeaseError(f"output folder {self.folder}: this run ({self.run_id}) no longer holds its "
                                     f"lease ({taken}); it commits nothing more")
            yield


def lost(spec) -> LostLeaseError | None:
    """Why the run ``spec`` describes no longer holds its folder's lease (None while it does, or holds none):
    for a run that failed, whose error may only be a symptom (the other run's shards in its way)."""
    guard = of(spec)
    if guard is None:
        return None
    try:
        with guard():
            return None
    except LostLeaseError as err:
        return err


def _finished_by(folder: str) -> str:
    """Who took the folder over, once that run has finished and freed the lease: its manifest says."""
    try:
        manifest = json.loads(storage.read_text(storage.join(folder, MANIFEST)))
        return f"run {manifest['run']['id']} took it over and finished at {manifest['created_at']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another run took it over and freed it"


def of(spec) -> Fence | None:
    """The fence of the commits of the run ``spec`` (a ``JobSpec``) describes: None for a run that holds
    no lease (``JobSpec.fenced``)."""
    return Fence(spec.output_dir, spec.run_id) if spec.fenced else None


@contextlib.contextmanager
def held(fence: Fence | None) -> Iterator[None]:
    """``with held(fence):`` around a commit; nothing to check without a fence."""
    if fence is None:
        yield
        return
    with fence():
        yield
