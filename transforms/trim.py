"""A shard without the samples of input files gone: written again from the rows it holds, not computed.

A shard computed with samples of an input file removed since (``JobSpec.removed``; the plan lists it
with the stale shards, ``pipeline.folder.holding_removed``) must stop presenting them. Its other rows
are what this run would compute (the same run, the same samples: their files' stamps are those it
recorded), so they are copied into a new shard of the same range: ids, results, ``nonfinite`` flags,
the self-check records and rejected samples of the files kept. The digest of its samples
(``samples_sha256``; with labels, ``labels_sha256``) must then be that of the samples kept: where the
removed files had rows in the shard, the kept samples are read again (read, not computed) and hashed,
and must be the samples the shard holds (the same ids stored, the same rejected); where they had none
(every sample of theirs rejected), the digests stand and nothing is read. The new shard replaces the
old one in one rename when committed (``ShardWriter``'s ``replace``), as a stale shard's replacement
does: until then the old one stays, and the manifest still names it (``jacobians.h5``, which maps its
rows as they were, goes just before: ``ShardWriter._retire_view``).

A shard that cannot be copied so (it holds partial sums, ``jacobian.aggregate``, which cannot lose a
sample's share; its other files' stamps changed too; it stores no digest) is computed again instead.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from jacobeam.transforms.aggregates import PARTIALS
from jacobeam.transforms.inputs.checks import Labels, RangeFindings, checked_slices
from jacobeam.transforms.output import fence, storage
from jacobeam.transforms.output.layout import (
    INPUT_LABELS,
    INPUT_STAMPS,
    LABELS_SHA256,
    NONFINITE,
    REJECTED_GROUP,
    SAMPLE_ID,
    SAMPLES_SHA256,
    SELF_CHECK,
)
from jacobeam.transforms.output.shard_writer import ShardWriter
from jacobeam.transforms.output.shards import ShardRecord, attr_text, existing_record, read_rejected, rejected_record
from jacobeam.transforms.spec import (
    JobSpec,
    Rejected,
    ShardRange,
    input_labels,
    input_stamps,
    shard_inputs,
    store_dtype,
)

_BLOCK_BYTES = 64 << 20  # rows copied at a time: about this many bytes of them
_SET_AT_COMMIT = ("id_start", "id_stop", "num_rows", "nonfinite_count")  # attributes the writer sets itself


def in_removed(spec: JobSpec, ids: np.ndarray) -> np.ndarray:
    """Per id of ``ids``: does it belong to a removed file piece (``JobSpec.removed``)?"""
    ids = np.asarray(ids, np.int64)
    pieces = sorted(spec.removed, key=lambda f: f.first_id)
    first = np.fromiter((f.first_id for f in pieces), np.int64, len(pieces))
    stop = np.fromiter((f.stop_id for f in pieces), np.int64, len(pieces))
    at = np.searchsorted(first, ids, side="right") - 1
    return (at >= 0) & (ids < stop[np.maximum(at, 0)]) if len(pieces) else np.zeros(len(ids), bool)


def without_removed(spec: JobSpec, rejected: tuple[Rejected, ...]) -> tuple[Rejected, ...]:
    """The rejected samples that are not of a removed file: a removed file's ids are neither rows nor
    rejected samples (a run of one file's ids lies within one piece, so its first id tells)."""
    if not spec.removed or not rejected:
        return rejected
    inside = in_removed(spec, np.array([-1 if run.start is None else run.start for run in rejected], np.int64))
    return tuple(run for run, gone in zip(rejected, inside) if not gone)


def _lists_removed(spec: JobSpec, recorded: list[list[Any]], shard: ShardRange) -> bool:
    gone = {(f.first_id, f.num_samples) for f in spec.removed if f.first_id < shard.stop and shard.start < f.stop_id}
    return any((entry[2], entry[3]) in gone for entry in recorded)


def _unchanged(spec: JobSpec, shard: ShardRange, attrs: dict[str, Any], recorded: list[list[Any]]) -> bool:
    """Whether the shard's files that are not removed have the stamps it recorded (by first id: a moved
    folder spells their paths otherwise), so that its rows of them are what this run computes."""
    if INPUT_STAMPS not in attrs:
        return False
    then = json.loads(attr_text(attrs[INPUT_STAMPS]))
    gone = {(f.first_id, f.num_samples) for f in spec.removed}
    recorded_stamps = {entry[2]: then.get(entry[0]) for entry in recorded if (entry[2], entry[3]) not in gone}
    now = input_stamps(spec.files, shard.start, shard.stop)
    current = {entry[2]: now.get(entry[0]) for entry in shard_inputs(spec.files, shard.start, shard.stop)}
    if recorded_stamps != current or None in current.values():
        return False
    if not spec.labels:
        return True
    # Each file's own label (jacobian.labels folders or table) can change without its stamp.
    labels_then = json.loads(attr_text(attrs.get(INPUT_LABELS, "{}")))
    labels_now = input_labels(spec.files, shard.start, shard.stop)
    then = {entry[2]: labels_then.get(entry[0], -1) for entry in recorded if entry[2] in recorded_stamps}
    return then == {entry[2]: labels_now.get(entry[0]) for entry in shard_inputs(spec.files, shard.start, shard.stop)}


def _digests(spec: JobSpec, shard: ShardRange, attrs: dict[str, Any], kept_ids: np.ndarray,
             kept_rejected: tuple[Rejected, ...]) -> dict[str, str] | None:
    """The kept samples' digests, read again from their files (``checks.RangeFindings``, as the shard's
    worker did), or None where what is read is not what the shard holds (other ids stored, or other
    samples rejected)."""
    labels = spec.labelled
    if labels and (LABELS_SHA256 not in attrs or "output_shape" not in attrs):
        return None
    checked = Labels(spec.label_key, math.prod(int(d) for d in attrs["output_shape"])) if labels else None
    findings = RangeFindings(spec.files, "skip", checked)
    read = [ids for ids, _, _ in checked_slices(spec.files, shard.start, shard.stop, spec.engine.batch_size, findings,
                                                 spec.label_key if labels else None)]
    found = np.concatenate(read) if read else np.zeros(0, np.int64)
    same_rejected = ([(r.start, r.stop, r.reason) for r in findings.rejected]
                     == [(r.start, r.stop, r.reason) for r in kept_rejected])
    if not same_rejected or not np.array_equal(found, kept_ids):
        return None
    return {SAMPLES_SHA256: findings.samples_sha256, **({LABELS_SHA256: findings.labels_sha256} if labels else {})}


def _row_datasets(h5) -> list[str]:
    """The shard's per-row datasets (nested ones included) but ``nonfinite``, which the writer makes."""
    import h5py

    names: list[str] = []

    def visit(name: str, item) -> None:
        if isinstance(item, h5py.Dataset) and name.split("/")[0] not in (PARTIALS, REJECTED_GROUP) and name != NONFINITE:
            names.append(name)

    h5.visititems(visit)
    return names


def _as_stored(dataset, lo: int, hi: int, keep: np.ndarray) -> np.ndarray:
    """Rows ``lo .. hi`` of a dataset where ``keep``, as the shard stores them: read as one slice (h5py
    reads a list of rows point by point); bfloat16, which h5py reads as float32, made bfloat16 again
    (exactly), so that the copy stores the same type and bytes."""
    values = dataset[lo:hi]
    values = values if keep.all() else values[keep]
    if values.dtype == np.float32 and dataset.id.get_type().get_size() == 2:
        return values.astype(store_dtype("bfloat16"))
    return values


def trimmed(spec: JobSpec, shard: ShardRange, path: str) -> ShardRecord | None:
    """The shard at ``path`` written again without the samples of removed files, and its record (not
    computed: ``computed`` False); None where it lists no removed file (a retried bundle wrote it
    already: the stale shard's own checks apply) or cannot be copied (see the module's docstring)."""
    with storage.open_h5(path) as h5:
        attrs, rejected = dict(h5.attrs), read_rejected(h5)
        partials = PARTIALS in h5
        ids = h5[SAMPLE_ID][:] if SAMPLE_ID in h5 else np.zeros(0, np.int64)
    recorded = json.loads(attr_text(attrs.get("inputs", "[]")))
    if not _lists_removed(spec, recorded, shard) or partials or not _unchanged(spec, shard, attrs, recorded):
        return None
    keep = ~in_removed(spec, ids)
    kept_rejected = without_removed(spec, rejected)
    new_attrs = {key: value for key, value in attrs.items() if key not in _SET_AT_COMMIT}
    new_attrs.update({"inputs": json.dumps(shard_inputs(spec.files, shard.start, shard.stop)),
                      INPUT_STAMPS: json.dumps(input_stamps(spec.files, shard.start, shard.stop))})
    if INPUT_LABELS in attrs:
        new_attrs[INPUT_LABELS] = json.dumps(input_labels(spec.files, shard.start, shard.stop))
    if not keep.all():  # the removed files had rows here: the digests are of the kept samples, read again
        if SAMPLES_SHA256 not in attrs:
            return None
        digests = _digests(spec, shard, attrs, ids[keep], kept_rejected)
        if digests is None:
            return None
        new_attrs.update(digests)
    if SELF_CHECK in attrs:
        record = json.loads(attr_text(attrs[SELF_CHECK]))
        kept_ids = set(ids[keep].tolist())
        record["checked"] = [check for check in record.get("checked", []) if check.get("id") in kept_ids]
        new_attrs[SELF_CHECK] = json.dumps(record)
    rows = int(keep.sum())
    with ShardWriter(spec.output_dir, shard.start, shard.stop, new_attrs, spec.compression, rows=rows,
                     run_id=spec.run_id, fence=fence.of(spec), replace=True) as writer:
        with storage.open_h5(path) as h5:
            names = _row_datasets(h5)
            row_bytes = sum(h5[name].dtype.itemsize * math.prod(h5[name].shape[1:]) for name in names) or 1
            block = max(1, _BLOCK_BYTES // row_bytes)
            for lo in range(0, len(ids), block):
                hi = min(lo + block, len(ids))
                if keep[lo:hi].any():
                    first = int(ids[lo + np.argmax(keep[lo:hi])])
                    writer.write(first, {name: _as_stored(h5[name], lo, hi, keep[lo:hi]) for name in names})
        if kept_rejected:
            writer.attach(REJECTED_GROUP, {"runs": rejected_record(kept_rejected)})
        checksum = writer.commit(rows)
    return existing_record(spec.output_dir, shard.start, shard.stop, attr_text(attrs.get("model_fingerprint", "")),
                           {"crc32c": checksum})
