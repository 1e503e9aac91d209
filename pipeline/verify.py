"""``jacobeam verify OUT [--samples K]``: is what an output folder holds what its manifest says, and right?

1. Every shard listed in the manifest exists and has the manifest's checksum (crc32c, or sha256 in older
   manifests; ``rejected.jsonl`` its sha256).
2. The ids cover the input exactly once: the shards' ``sample_id`` rows and the rejected ids together
   are ``0 .. num_samples``, each once; each shard's ids lie in its range, in order; ``jacobians.h5``
   reads every shard and shows the same ``sample_id`` column; the input files still hold the number
   of samples the manifest lists, and each shard's samples, read again from them, have the sha256 its
   worker computed as it read them (``samples_sha256``).
3. ``K`` randomly chosen stored samples (seeded: ``--seed``) are recomputed from their input rows by the
   run's self-check (``transforms.self_check``, through ``pipeline.recompute``), independently of the
   engine: a per-sample ``tf.GradientTape`` (forward-mode JVPs where the run ran forward) in a float64
   copy of the model, the truth; the rows chosen again (a label read again from the input, ``argmax`` and
   ``top_k`` from the truth's outputs); each stored dataset rebuilt from its definition
   (``transforms.reference_datasets``) and judged row by row by the self-check's rule, word for word, so
   that the run and verify cannot disagree on what is right. Without a float64 copy (SavedModels, plain
   ``tf.Module``) the truth is the compute dtype's reference.
4. ``aggregates.h5`` is the tree-sum of the shards' stored partial sums, bit for bit; where shards store
   full Jacobians, a recomputed sample's shard's partial sums agree with sums over its stored values.

``engine-plan.json`` (the engine's set-up decisions, a cache) is no result: a note says when it is
unreadable or made for other model weights than the manifest's (a next run ignores it then).

A folder written by a pipeline of the user's own (``WriteShards(pipeline_spec(...))``) lists no input
file: steps 1 and 2 are checked (without the input files' sample counts), no sample is recomputed, and
the report says so in a note.

Any mismatch is a problem; ``jacobeam verify`` then exits with status 1. Loading the model runs the
factory named in the manifest's config, as the run did.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from jacobeam.pipeline.coverage import check_digests, check_inputs, check_structure
from jacobeam.pipeline.recompute import check_aggregates, recompute
from jacobeam.transforms.finalize import write_manifest
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.fence import Fence
from jacobeam.transforms.output.layout import AGGREGATES, ENGINE_PLAN, MANIFEST, SHARDS_DIR, is_shard_file


@dataclasses.dataclass
class Report:
    folder: str
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    shards_checked: int = 0
    ids_checked: int = 0
    ids_wrong: int = 0  # of them, missing or present more than once (each kind a problem line)
    samples: list[int] = dataclasses.field(default_factory=list)  # ids recomputed
    # Per stored dataset: the largest error of the recomputed samples, the (smallest) bound, how many.
    checked: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    method: str = ""  # the reference and the truth the datasets were judged against
    tolerance: float | None = None
    aggregates: str = ""  # what of aggregates.h5 was checked
    shard_ids: list = dataclasses.field(default_factory=list, repr=False)  # (file, ids) of the stored shards

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "shards_checked": self.shards_checked,
            "ids_checked": self.ids_checked,
            "samples_recomputed": len(self.samples),
            "sample_ids": self.samples,
            "datasets": self.checked,
            # Kept for scripts that read it: the largest error of any dataset against the reference.
            "max_rel_error": {"tape": max((d["max_error"] for d in self.checked.values()), default=None)},
            "method": self.method,
            "tolerance": self.tolerance,
            "aggregates": self.aggregates,
            "problems": self.problems,
            "notes": self.notes,
        }


def verify(folder: str | Path, samples: int = 0, seed: int = 0) -> Report:
    """Check the output folder (see the module docstring); recompute ``samples`` random samples."""
    root = storage.normalize(folder)
    top = storage.listdir(root)
    if not storage.is_folder(root):
        raise FileNotFoundError(f"{folder}: no such output folder")
    report = Report(folder=root)
    if MANIFEST not in top:
        report.problems.append(f"no {MANIFEST}: the run did not finish; nothing to verify")
        return report
    manifest = json.loads(storage.read_text(storage.join(root, MANIFEST)))
    where = check_structure(root, manifest, report)
    report.shard_ids = where
    from jacobeam.transforms.inputs.readers import from_a_pipeline

    if not from_a_pipeline(manifest):
        check_digests(root, manifest, where, report)
    listed = {storage.name_of(shard["file"]) for shard in manifest["shards"]}
    on_disk = storage.listdir(storage.join(root, SHARDS_DIR))
    extra = [name for name in on_disk if is_shard_file(name) and name not in listed]
    if extra:
        report.notes.append(f"{len(extra)} shard file(s) not in the manifest (an unfinished later run?): {extra[:3]}")
    if ENGINE_PLAN in top:
        _check_engine_plan(storage.join(root, ENGINE_PLAN), manifest, report)

    if samples > 0 and from_a_pipeline(manifest):
        report.notes.append(
            "no sample recomputed: a pipeline of your own wrote this folder (WriteShards), and its manifest lists "
            "no input file to read the samples from; checksums and ids were checked"
        )
    elif samples > 0 and check_inputs(manifest, report):
        recompute(root, manifest, where, samples, seed, report)
    if AGGREGATES in top or manifest.get("aggregates"):
        check_aggregates(root, manifest, report)
    return report


def _check_engine_plan(path: str, manifest: dict[str, Any], report: Report) -> None:
    """The engine's cached set-up decisions are no result: what is wrong with them is a note (a next run
    ignores them and probes again), never a problem."""
    try:
        plan = json.loads(storage.read_text(path))
        fingerprint = plan["key"]["model_fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        report.notes.append(f"{ENGINE_PLAN}: unreadable (a cache of the engine's set-up: the next run probes again)")
        return
    if manifest.get("model_fingerprint") not in (None, fingerprint):
        report.notes.append(f"{ENGINE_PLAN}: made for other model weights than the manifest's (a next run ignores it)")


def record(folder: str | Path, report: Report, guard: Fence | None = None) -> dict[str, Any]:
    """Store the report in the manifest (``verify``); returns the manifest. ``guard``: the fence of the run
    that holds the folder (``run --verify``)."""
    manifest = json.loads(storage.read_text(storage.join(str(folder), MANIFEST)))
    manifest["verify"] = report.as_dict()
    write_manifest(str(folder), manifest, guard)
    return manifest


def format_report(report: Report) -> str:
    lines = [f"{report.folder}: {'verified' if report.ok else 'VERIFICATION FAILED'}"]
    lines.append(f"  shards      {report.shards_checked} checked against the manifest's checksums")
    if report.ids_wrong:
        lines.append(f"  ids         {report.ids_checked:,} checked: {report.ids_wrong:,} not stored or rejected exactly "
                     "once (the problems below)")
    else:
        lines.append(f"  ids         {report.ids_checked:,} checked: each stored or rejected exactly once")
    if report.samples:
        lines.append(f"  recomputed  {len(report.samples)} sample(s): {report.method}")
        for name, seen in report.checked.items():
            kinks = f", {seen['kinks']} at a kink" if seen["kinks"] else ""
            lines.append(
                f"    {name:<22} max relative error {seen['max_error']:.2e} on {seen['samples']} sample(s), "
                f"bound {seen['bound']:.2g} (tolerance {report.tolerance:g}, or 4x float's own error{kinks})"
            )
    if report.aggregates:
        lines.append(f"  aggregates  {report.aggregates}")
    lines += [f"  note: {note}" for note in report.notes]
    lines += [f"  problem: {problem}" for problem in report.problems]
    return "\n".join(lines)
