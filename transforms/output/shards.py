"""A shard on disk: its path, the record a worker reports of it, and the checksum that proves it complete.

Shards are HDF5 files, one per id range, written under a temporary name and renamed when complete
(``shard_writer.ShardWriter`` writes them). Locally, the rename is the only thing that marks a shard
complete: an h5py writer killed mid-write can leave a file that opens and looks plausible, so nothing
else may be trusted.

In a remote folder (``gs://``, ``s3://``, ...) h5py writes the shard to a local temporary file, which is
stream-copied to a temporary remote name and renamed (on GCS and S3 a copy and a delete). A rename made
of a copy is not what a local rename is (a non-atomic store could show a partial copy), so after it a
sidecar ``shards/NAME.crc32c`` records the CRC32C of the shard's bytes (``shards/NAME.sha256``, their
sha256, for a shard written before CRC32C; a ``.crc32c`` sidecar counts first). A remote shard counts as
complete only when its sidecar exists and matches its bytes (the launcher checks that the sidecar is
there, the worker that it matches); any other file under a shard's name is computed again. (Resuming
already reads every kept shard to checksum it for the manifest, so the proof costs one small read per
shard.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import (
    CHECKSUM_SUFFIX,
    CRC32C_SUFFIX,
    REJECTED_FILE,
    REJECTED_GROUP,
    SAMPLES_SHA256,
    SELF_CHECK,
    SHARDS_DIR,
    shard_file,
    shard_name,
)
from jacobeam.transforms.spec import Rejected


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """What a worker reports about one shard; the manifest lists these."""

    file: str  # relative to the output folder
    start: int
    stop: int
    sha256: str | None  # of a kept remote shard written before CRC32C; else None
    model_fingerprint: str
    computed: bool  # False when an existing complete shard was kept
    seconds: float = 0.0
    worker_pid: int = 0
    engine_builds: int = 0  # engines that worker process built for this run (its compute step) so far
    rows: int | None = None  # samples stored; fewer than stop - start when some were rejected
    nonfinite: int = 0  # rows whose results hold NaN or Inf
    engine: dict[str, Any] | None = None  # what the engine ran and why (``JacobianEngine.describe()``)
    # The shard's self-check (its ``self_check`` attribute; for a shard computed in this run, each check's
    # ``timing`` too); None when it checked nothing.
    self_check: dict[str, Any] | None = None
    crc32c: str | None = None  # the CRC32C of the shard's bytes (``storage.crc32c``), or None beside a sha256
    rejected: tuple[Rejected, ...] = ()  # the samples of the range that its worker rejected
    # The shard's ``samples_sha256`` (the digest of its samples as read; None in a shard written before):
    # the manifest lists it, so that a later run can tell the shard it vouched for from another.
    samples_sha256: str | None = None

    @property
    def checksums(self) -> dict[str, str]:
        """The shard's checksums by algorithm, as the manifest lists them: ``crc32c``, or ``sha256``."""
        return {name: value for name, value in (("crc32c", self.crc32c), ("sha256", self.sha256)) if value}

    @property
    def num_samples(self) -> int:
        """Samples stored in the shard (its rows)."""
        return self.stop - self.start if self.rows is None else self.rows


def shard_path(output_dir: str, start: int, stop: int) -> str:
    return storage.join(output_dir, SHARDS_DIR, shard_name(start, stop))


def proven_checksum(path: str) -> dict[str, str] | None:
    """The checksum of a complete shard at ``path`` (``{"crc32c": hex}``; ``{"sha256": hex}`` for a remote
    shard written before CRC32C), or None when there is no complete shard there.

    Locally a shard's name is proof (only a rename gives it); remotely, the sidecar must match the bytes.
    """
    if storage.is_local(path):
        return {"crc32c": storage.crc32c(path)} if os.path.exists(path) else None
    if not storage.exists(path):
        return None
    for suffix, algorithm in ((CRC32C_SUFFIX, "crc32c"), (CHECKSUM_SUFFIX, "sha256")):
        if storage.exists(path + suffix):
            recorded = storage.read_text(path + suffix).strip()
            actual = getattr(storage, algorithm)(path)
            return {algorithm: actual} if recorded == actual else None
    return None


def rejected_record(rejected: list[Rejected] | tuple[Rejected, ...]) -> str:
    """Rejected samples as a shard stores them (``REJECTED_GROUP``'s ``runs``): JSON."""
    return json.dumps([[r.file, r.reason, r.row, r.start, r.stop] for r in rejected])


def read_rejected(h5) -> tuple[Rejected, ...]:
    """The rejected samples an open shard lists (none in a shard written before shards listed them)."""
    if REJECTED_GROUP not in h5:
        return ()
    text = h5[REJECTED_GROUP]["runs"][()]
    return tuple(Rejected(*run) for run in json.loads(text.decode() if isinstance(text, bytes) else text))


def _listed_rejected(output_dir: str, start: int, stop: int) -> tuple[Rejected, ...]:
    """The rejected samples of ids ``[start, stop)`` as the folder's ``rejected.jsonl`` lists them (the
    last complete run's; the plan rejected them then), one per sample."""
    path = storage.join(output_dir, REJECTED_FILE)
    lines = [json.loads(line) for line in storage.read_text(path).splitlines()] if storage.exists(path) else []
    return tuple(Rejected(line["file"], line["reason"], line["row"], line["id"], line["id"] + 1)
                 for line in lines if line["id"] is not None and start <= line["id"] < stop)


def read_attrs(path: str | os.PathLike) -> dict[str, Any]:
    with storage.open_h5(path) as h5:
        return dict(h5.attrs)


def existing_record(
    output_dir: str,
    start: int,
    stop: int,
    model_fingerprint: str,
    checksums: dict[str, str] | None = None,
) -> ShardRecord:
    """The record of a complete shard found on disk (kept, not recomputed); ``checksums`` when known (as
    ``proven_checksum`` gives them), else its CRC32C is computed."""
    path = shard_path(output_dir, start, stop)
    with storage.open_h5(path) as h5:
        attrs, rejected = dict(h5.attrs), read_rejected(h5)
    if not rejected and int(attrs.get("num_rows", stop - start)) < stop - start:
        rejected = _listed_rejected(output_dir, start, stop)  # a shard written before shards listed them
    checked = attrs.get(SELF_CHECK)
    checksums = checksums or {"crc32c": storage.crc32c(path)}
    return ShardRecord(
        file=shard_file(start, stop),
        start=start,
        stop=stop,
        sha256=checksums.get("sha256"),
        crc32c=checksums.get("crc32c"),
        model_fingerprint=model_fingerprint,
        computed=False,
        rows=int(attrs.get("num_rows", stop - start)),
        nonfinite=int(attrs.get("nonfinite_count", 0)),
        self_check=None
        if checked is None
        else json.loads(checked.decode() if isinstance(checked, bytes) else str(checked)),
        rejected=rejected,
        samples_sha256=attr_text(attrs[SAMPLES_SHA256]) if SAMPLES_SHA256 in attrs else None,
    )


def attr_text(value: Any) -> str:
    """An HDF5 string attribute as ``str`` (h5py gives ``bytes`` for some)."""
    return value.decode() if isinstance(value, bytes) else str(value)
