"""``jacobeam verify OUT [--samples K]``: is what an output folder holds what its manifest says, and right?

1. Every shard listed in the manifest exists and has the manifest's checksum (crc32c, or sha256 in older
   manifests; ``rejected.jsonl`` its sha256).
2. The ids cover the input exactly once: the shards' ``sample_id`` rows and the rejected ids together
   are ``0 .. num_samples``, each once; each shard's ids lie in its range, in order; ``jacobians.h5``
   reads every shard and shows the same ``sample_id`` column, and its ``source_file``/``source_row``
   name, for each row, the input file and row its id comes from (the manifest's files); the samples of
   the shards ``inputs`` names (``--inputs``: ``sampled``, the shards holding the samples of step 3,
   the default; ``all``; ``none``), read again from the input files, have the sha256 its worker
   computed as it read them (``samples_sha256``); the bytes read from input files are counted
   (``storage.count_input_reads``) and reported. Before samples are recomputed, the files verify reads
   still hold the number of samples the manifest lists.
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
import time
from pathlib import Path
from typing import Any

import numpy as np

from jacobeam.pipeline.coverage import check_digests, check_inputs, check_structure, with_checked_inputs
from jacobeam.pipeline.inspect_output import output_folder
from jacobeam.pipeline.recompute import check_aggregates, choose_samples, recompute
from jacobeam.transforms.finalize import write_manifest
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.fence import Fence
from jacobeam.transforms.output.layout import (
    AGGREGATES,
    ENGINE_PLAN,
    MANIFEST,
    PIPELINE_INPUT,
    SHARDS_DIR,
    SOURCE_FILE,
    SOURCE_FILES,
    SOURCE_ROOT,
    SOURCE_ROW,
    VIEW,
    is_shard_file,
)


@dataclasses.dataclass
class Report:
    folder: str
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    shards_checked: int = 0
    ids_checked: int = 0
    ids_wrong: int = 0  # of them, missing or present more than once (each kind a problem line)
    samples: list[int] = dataclasses.field(default_factory=list)  # ids recomputed
    # Per stored dataset: the largest error of the recomputed samples, and of the row nearest its bound the
    # bound and the error's fraction of it (above 1 at a kink only), how many samples, how many at a kink.
    checked: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    method: str = ""  # the reference and the truth the datasets were judged against
    tolerance: float | None = None
    aggregates: str = ""  # what of aggregates.h5 was checked
    # What of the input files was read again (``--inputs``): the reach, the shards re-hashed of all, bytes.
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
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
            "inputs": self.inputs,
            "problems": self.problems,
            "notes": self.notes,
        }


# ``--inputs``: whose samples are read again from the input files and compared with the shards' digests.
INPUT_REACHES = ("sampled", "all", "none")


def verify(folder: str | Path, samples: int = 0, seed: int = 0, inputs: str = "sampled") -> Report:
    """Check the output folder (see the module docstring); recompute ``samples`` random samples; re-hash
    the input samples of the shards holding them (``inputs="sampled"``), of every shard (``"all"``) or of
    none (``"none"``)."""
    if inputs not in INPUT_REACHES:
        raise ValueError(f"inputs={inputs!r}: expected one of {', '.join(INPUT_REACHES)}")
    with storage.count_input_reads() as reads:
        return _verify(folder, samples, seed, inputs, reads)


def _verify(folder: str | Path, samples: int, seed: int, inputs: str, reads: storage.InputReads) -> Report:
    root, top = output_folder(str(folder))
    report = Report(folder=root)
    if MANIFEST not in top:
        report.problems.append(f"no {MANIFEST}: the run did not finish; nothing to verify")
        return report
    manifest = with_checked_inputs(root, json.loads(storage.read_text(storage.join(root, MANIFEST))), report)
    if manifest is None:
        return report
    where = check_structure(root, manifest, report)
    report.shard_ids = where
    _check_sources(root, manifest, where, report)
    from jacobeam.transforms.inputs.readers import from_a_pipeline

    own_pipeline = from_a_pipeline(manifest)
    chosen = {} if own_pipeline else choose_samples(where, samples, seed)
    rehashed = [] if own_pipeline else _rehash(root, manifest, where, chosen, inputs, reads, report)
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
    elif chosen:
        # The files verify reads: every one with --inputs all, else those of the samples and shards read.
        read_ids = np.concatenate([ids for _, ids in rehashed] + [np.fromiter(chosen, np.int64)])
        if check_inputs(manifest, report, None if inputs == "all" else read_ids):
            recompute(root, manifest, where, chosen, report)
    if not own_pipeline:
        report.inputs["bytes_read"] = reads.bytes
    if AGGREGATES in top or manifest.get("aggregates"):
        check_aggregates(root, manifest, report)
    return report


def _rehash(
    root: str, manifest: dict[str, Any], where: list[tuple[str, np.ndarray]], chosen: dict[int, tuple[str, int]],
    reach: str, reads: storage.InputReads, report: Report,
) -> list[tuple[str, np.ndarray]]:
    """Compare the shards' digests with their samples read again, for the shards ``reach`` names; record
    what was read in ``report.inputs``. Returns the shards whose samples were read."""
    sampled = {file for file, _ in chosen.values()}
    shards = {"all": where, "sampled": [(file, ids) for file, ids in where if file in sampled], "none": []}[reach]
    before, started = reads.bytes, time.perf_counter()
    compared = set(check_digests(root, manifest, shards, report))
    report.inputs.update(
        reach=reach, shards=len(where), shards_rehashed=len(compared),
        samples_rehashed=sum(len(ids) for file, ids in shards if file in compared),
        bytes_rehashed=reads.bytes - before, seconds_rehashing=round(time.perf_counter() - started, 3),
    )
    if len(compared) < len(shards) and not any(note.startswith("input samples not compared") for note in report.notes):
        report.notes.append(f"{len(shards) - len(compared)} shard(s) written before shards stored the digest of their "
                            "samples: their input samples were not compared")
    return shards


def _check_sources(root: str, manifest: dict[str, Any], where: list[tuple[str, np.ndarray]], report: Report) -> None:
    """``jacobians.h5``'s per-row sources against the ids the shards hold and the manifest's input files:
    each row names the file and row its id comes from (``transforms.finalize.row_sources``, as the run
    computed them), under the view's own ``source_root``. Skipped where the ids or the view are wrong
    already (reported above)."""
    from jacobeam.transforms.errors import OutputError
    from jacobeam.transforms.finalize import row_sources
    from jacobeam.transforms.inputs.readers import from_a_pipeline, manifest_sources
    from jacobeam.transforms.inputs.types import SourceFile

    path = storage.join(root, VIEW)
    if report.problems or not storage.exists(path):
        return
    with storage.open_h5(path) as view:  # datasets of the view's own: readable remotely too
        if SOURCE_FILE not in view:
            report.notes.append(f"{VIEW}: written before rows named their source (no {SOURCE_FILE} dataset)")
            return
        files, row = view[SOURCE_FILES].asstr()[:].tolist(), view[SOURCE_ROW][:]
        file, source_root = view[SOURCE_FILE][:], str(view.attrs.get(SOURCE_ROOT, ""))
    ids = np.concatenate([ids for _, ids in where]) if where else np.zeros(0, np.int64)
    pieces = ([SourceFile(PIPELINE_INPUT, None, int(manifest["num_samples"]), (), "")] if from_a_pipeline(manifest)
              else manifest_sources(manifest))
    try:
        expected = row_sources(pieces, ids, source_root)
    except OutputError as err:
        report.problems.append(str(err))
        return
    if len(file) != len(ids) or len(row) != len(ids):
        report.problems.append(f"{VIEW}: {len(file)} {SOURCE_FILE} and {len(row)} {SOURCE_ROW} rows, the shards hold {len(ids)}")
        return
    if len(file) and (file.min() < 0 or file.max() >= len(files)):
        report.problems.append(f"{VIEW}: {SOURCE_FILE} points outside the {len(files)} entries of {SOURCE_FILES}")
        return
    named, want = np.asarray(files, object)[file], np.asarray(expected.files, object)[expected.file]
    wrong = (named != want) | (row != expected.row)
    if wrong.any():
        i = int(np.argmax(wrong))
        report.problems.append(
            f"{VIEW}: row {i} (sample {ids[i]}) names {named[i]} row {row[i]} as its source, its id comes from "
            f"{want[i]} row {expected.row[i]} ({int(wrong.sum())} row(s) differ)"
        )


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
        lines.append(f"  ids         {report.ids_checked:,} checked: {report.ids_wrong:,} not stored, rejected or removed "
                     "exactly once (the problems below)")
    else:
        lines.append(f"  ids         {report.ids_checked:,} checked: each stored, rejected or removed exactly once")
    if report.samples:
        lines.append(f"  recomputed  {len(report.samples)} sample(s): {report.method}")
        for name, seen in report.checked.items():
            kinks = f", {seen['kinks']} at a kink" if seen["kinks"] else ""
            lines.append(
                f"    {name:<22} max relative error {seen['max_error']:.2e} on {seen['samples']} sample(s), at most "
                f"{seen['of_bound']:.2g}x its bound (tolerance {report.tolerance:g}, or 4x float's own error{kinks})"
            )
    if report.inputs:
        lines.append(f"  inputs      {_inputs_line(report.inputs)}")
    if report.aggregates:
        lines.append(f"  aggregates  {report.aggregates}")
    lines += [f"  note: {note}" for note in report.notes]
    lines += [f"  problem: {problem}" for problem in report.problems]
    return "\n".join(lines)


def _inputs_line(inputs: dict[str, Any]) -> str:
    """What of the input files was read again, and how many bytes."""
    more = inputs["bytes_read"] != inputs["bytes_rehashed"]  # headers, recomputed samples
    total = f"; {_size(inputs['bytes_read'])} read from input files in all" if more else ""
    if inputs["reach"] == "none":
        return f"not re-hashed (--inputs none): no shard's samples were compared with the input files{total}"
    if inputs["reach"] == "sampled" and not inputs["samples_rehashed"]:
        return ("not re-hashed: no sample recomputed (--samples 0), so no shard sampled; --inputs all re-hashes "
                f"every shard's samples{total}")
    which = "those of the recomputed samples" if inputs["reach"] == "sampled" else "--inputs all"
    return (
        f"re-hashed the samples of {inputs['shards_rehashed']} of {inputs['shards']} shard(s) ({which}): "
        f"{inputs['samples_rehashed']:,} sample(s), {_size(inputs['bytes_rehashed'])} read in "
        f"{inputs['seconds_rehashing']:.1f} s{total}"
    )


def _size(count: int) -> str:
    """Bytes in decimal units, three significant digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"
