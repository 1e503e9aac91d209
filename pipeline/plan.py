"""Turn a validated config into a job: resolve the input globs, check and scan the files, place them on
the id line, fix the shard ranges, and decide what the output folder already holds.

Everything in ``make_job`` runs in the launching process before any output is touched: a bad input, a
bad sample (``input.on_bad_sample: error``), a model that does not fit the inputs or a folder holding
another run's result fails here, with nothing written. ``prepare_output`` then makes the first writes
(create the folder, apply ``--overwrite``, remove a killed run's temporary files).

This module imports no TensorFlow; the model check (``pipeline.checks``) imports it when called.

Ids. A fresh run numbers the samples of its input files in sorted path order. When the output folder
already has a manifest (an earlier, complete run), every file it lists keeps its ids, and files that
are new are sorted among themselves and placed after the old ones: ids never move, so the old shards
stay valid and only the new samples are computed (incremental runs). Each run that adds files adds an
"id segment"; shard ranges tile each segment from its start in steps of ``samples_per_shard``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from typing import Any

from jacobeam.pipeline.config import Config, ConfigError, to_dict
from jacobeam.transforms.output import storage
from jacobeam.transforms.errors import CorruptInputError, InputError, OutputError
from jacobeam.transforms.output.layout import AGGREGATES
from jacobeam.transforms.finalize import remove_temp_files
from jacobeam.transforms.output.layout import MANIFEST, REJECTED_FILE, VIEW, is_folder_temp
from jacobeam.transforms.inputs.images import ImageOptions
from jacobeam.transforms.inputs.readers import (
    IMAGE_SUFFIXES,
    Key,
    Shape,
    SourceFile,
    assign_ids,
    check_consistent,
    check_labels,
    describe,
    shape_record,
    unreadable_file,
)
from jacobeam.transforms.inputs.scan import FileScan, scan_files
from jacobeam.transforms.output.shards import read_attrs
from jacobeam.transforms.output.layout import CHECKSUM_SUFFIX, SHARDS_DIR, is_checksum_file, is_shard_temp, shard_name
from jacobeam.transforms.spec import JobSpec, ModelSource, Rejected, ShardRange, shard_inputs

log = logging.getLogger(__name__)

_SHARD_FILE = re.compile(r"^shard-(\d{12})-(\d{12})\.h5$")
_MAX_LISTED = 8  # differences shown in one error message


# --- inputs -------------------------------------------------------------------------------------------


def _match(patterns: list[str]) -> list[str]:
    """Every file the globs match, each once, sorted. A folder (a pattern without wildcards naming one,
    or ending in ``/``) stands for every PNG/JPEG image under it, at any depth."""
    from apache_beam.io.filesystems import FileSystems

    paths: set[str] = set()
    for pattern in patterns:
        folder = not any(c in pattern for c in "*?[") and (pattern.endswith("/") or storage.is_folder(pattern))
        (match,) = FileSystems.match([storage.join(pattern, "**") if folder else pattern])
        found = [m.path for m in match.metadata_list if not folder or m.path.lower().endswith(IMAGE_SUFFIXES)]
        if not found:
            raise InputError(f"input.paths: {pattern!r} " + ("holds no PNG or JPEG images" if folder else "matches no files"))
        paths.update(found)
    return sorted(paths)


def resolve_inputs(
    patterns: list[str], key: Key, on_bad_sample: str = "error", sample_shape: Shape | None = None,
    image: ImageOptions | None = None,
) -> list[SourceFile]:
    """Every file the globs match (each file once), described, in sorted path order with ids in that
    order. Under ``skip`` a file that cannot be opened is kept as an unreadable file without samples.
    Files are described a few at a time (an image is decoded to learn its shape)."""

    def described(path: str) -> SourceFile:
        try:
            return describe(path, key, sample_shape, image)
        except CorruptInputError as err:
            if on_bad_sample != "skip":
                raise InputError(f"{err} (input.on_bad_sample is error; 'skip' would leave this file out)") from err
            log.warning("skipping %s: %s", path, err.reason)
            return unreadable_file(path, key, err.reason)

    paths = _match(patterns)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="jacobeam-describe") as pool:
        files = assign_ids(list(pool.map(described, paths)))
    check_consistent(files, sample_shape)
    if not any(f.num_samples for f in files):
        raise InputError(f"input.paths: the {len(files)} matched file(s) hold no readable samples")
    return files


def scan_inputs(files: list[SourceFile], on_bad_sample: str) -> dict[str, FileScan]:
    """Read every sample once (see ``transforms.inputs.scan``); under ``error`` the first bad one stops the run."""
    began = time.monotonic()
    scans = scan_files(files)
    log.info("scanned %d input file(s) in %.1f s", len(scans), time.monotonic() - began)
    if on_bad_sample == "error":
        bad = [(path, rows) for path, scan in sorted(scans.items()) for rows in scan.bad]
        if bad:
            path, rows = bad[0]
            total = sum(scan.num_bad for scan in scans.values())
            more = f"; {total} bad sample(s) in all" if total > 1 else ""
            raise InputError(
                f"{path}: row {rows.row}: {rows.reason}{more}. Nothing was written "
                "(input.on_bad_sample is error; set it to skip to leave bad samples out)"
            )
    return scans


# --- run identity -------------------------------------------------------------------------------------


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """What decides the values stored for a sample id, down to the last bit, and how ids are grouped
    into shards: the model source, ``input.key`` (and ``input.sample_shape``, ``input.image`` where
    given), ``output.samples_per_shard`` and the whole ``jacobian`` section but ``threads`` and
    ``self_check`` (flattened to dotted keys, for messages naming the key).

    Not part of it: threads (how fast), the self-check (how the results are checked, not what they
    are), compression (how stored), the input globs (an incremental run may add one; the files
    themselves are compared one by one) and ``on_bad_sample`` (a sample is rejected or not by the data
    alone; the policy only decides whether a run with rejections goes ahead).
    """
    identity = {
        "model.path": config["model"].get("path"),
        "model.factory": config["model"].get("factory"),
        "model.builtin": config["model"].get("builtin"),
        "input.key": config["input"].get("key"),
        "output.samples_per_shard": config["output"]["samples_per_shard"],
    }
    # Keys added later enter only where given, so that an older run's identity (and run_key) stays valid.
    for key in ("sample_shape", "image"):
        if config["input"].get(key) is not None:
            identity[f"input.{key}"] = config["input"][key]

    def flatten(prefix: str, section: dict[str, Any]) -> None:
        for key, value in section.items():
            if isinstance(value, dict):
                flatten(f"{prefix}{key}.", value)
            elif f"{prefix}{key}" != "jacobian.threads" and not prefix.startswith("jacobian.self_check."):
                identity[f"{prefix}{key}"] = value

    flatten("jacobian.", config.get("jacobian", {}))
    return identity


def run_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _identity_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    return [
        f"{key} is {json.dumps(theirs.get(key))} there, {json.dumps(ours.get(key))} in this run"
        for key in sorted(set(theirs) | set(ours))
        if theirs.get(key) != ours.get(key)
    ]


# --- placing files on the id line, shard ranges ---------------------------------------------------------


def _with_hashes(files: list[SourceFile], scans: dict[str, FileScan]) -> list[SourceFile]:
    return [dataclasses.replace(f, data_sha256=scans[f.path].data_sha256) if f.path in scans else f for f in files]


def place_files(
    files: list[SourceFile], previous: dict[str, Any] | None
) -> tuple[list[SourceFile], list[tuple[int, int]], list[str]]:
    """Give each file its ids: kept from the previous manifest, new files after the old ones.

    Returns the placed files (in id order), the id segments, and how the inputs differ from the
    previous run's (a file gone, or holding other data), which makes the folder another run's result.
    """
    if previous is None:
        placed = assign_ids(files)
        return placed, [(0, max(f.stop_id for f in placed))], []
    current = {f.path: f for f in files}
    placed, differences, end = [], [], 0
    for entry in previous["inputs"]:
        path, old_stop = entry["path"], entry["first_id"] + entry["num_samples"]
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
                ("data sha256", entry.get("data_sha256"), now.data_sha256),
            )
            if before != after and not (what == "data sha256" and before is None)
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


def rejected_runs(files: list[SourceFile], scans: dict[str, FileScan]) -> tuple[list[Rejected], list[Rejected]]:
    """The scan's bad rows as rejected id runs, and the unreadable files (which have no ids)."""
    runs, unreadable = [], []
    for f in files:
        if f.unreadable is not None:
            unreadable.append(Rejected(file=f.path, reason=f.unreadable))
            continue
        for bad in scans[f.path].bad if f.path in scans else ():
            runs.append(Rejected(f.path, bad.reason, bad.row, f.first_id + bad.row, f.first_id + bad.stop_row))
    return sorted(runs, key=lambda r: r.start), unreadable


def shard_ranges(segments: list[tuple[int, int]], step: int, runs: list[Rejected]) -> list[ShardRange]:
    """Tile each id segment from its start in steps of ``step``; attach each range's rejected samples."""
    ranges, first_run = [], 0  # runs are sorted and disjoint, ranges come in id order: one pass
    for first, last in segments:
        for lo in range(first, last, step):
            hi = min(lo + step, last)
            while first_run < len(runs) and runs[first_run].stop <= lo:
                first_run += 1
            clipped, index = [], first_run
            while index < len(runs) and runs[index].start < hi:
                clipped.append(runs[index].clip(lo, hi))
                index += 1
            ranges.append(ShardRange(lo, hi, tuple(c for c in clipped if c)))
    return ranges


# --- what the output folder holds -----------------------------------------------------------------------


@dataclasses.dataclass
class Folder:
    """A read-only look at an output folder: what jacobeam wrote there before."""

    root: str  # absolute local path or remote URL
    manifest: dict[str, Any] | None = None
    shards: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # file name -> attrs
    owned: list[str] = dataclasses.field(default_factory=list)  # files jacobeam wrote (shown by content)
    alien: list[str] = dataclasses.field(default_factory=list)  # jacobeam's names, not jacobeam's content
    unproven: list[str] = dataclasses.field(default_factory=list)  # remote shards not proven complete

    @property
    def empty(self) -> bool:
        return self.manifest is None and not self.shards


def _is_jacobeam_view(path: str) -> bool:
    with storage.open_h5(path) as view:
        if "jacobeam_version" in view.attrs:
            return True
        datasets = list(view.values())
        return bool(datasets) and all(
            getattr(d, "is_virtual", False)
            and all(s.file_name.startswith(f"{SHARDS_DIR}/") for s in d.virtual_sources())
            for d in datasets
        )


def _is_aggregates(path: str) -> bool:
    with storage.open_h5(path) as h5:
        return "count" in h5 and set(h5) <= {"count", "mean", "mean_abs", "jtj"}


def _is_rejected_list(path: str) -> bool:
    for line in storage.read_text(path).splitlines():
        record = json.loads(line)
        if not isinstance(record, dict) or set(record) != {"id", "file", "row", "reason"}:
            return False
    return True


def read_folder(output_dir: str) -> Folder:
    """What the folder holds, judged by content: a file with one of jacobeam's names counts as jacobeam's
    only if it looks like what jacobeam writes; otherwise it is listed as alien and never touched.

    In a remote folder a shard counts only when it has jacobeam's attributes and a checksum sidecar (see
    ``transforms.output.shards``; the worker checks its bytes against the sidecar before keeping it); one that
    jacobeam wrote (it has a sidecar, or a ``run_key``) but that fails this is listed as owned, not as a
    shard: ``prepare_output`` removes it and it is computed again."""
    root = storage.normalize(output_dir)
    folder = Folder(root)
    for name in storage.listdir(root):
        path = storage.join(root, name)
        if is_folder_temp(name):
            folder.owned.append(path)
            continue
        if name not in (MANIFEST, VIEW, REJECTED_FILE, AGGREGATES) or not storage.is_file(path):
            continue
        try:
            if name == MANIFEST:
                manifest = json.loads(storage.read_text(path))
                ours = isinstance(manifest, dict) and {"jacobeam_version", "run_key", "inputs"} <= set(manifest)
                folder.manifest = manifest if ours else None
            elif name == VIEW:
                ours = _is_jacobeam_view(path)
            elif name == AGGREGATES:
                ours = _is_aggregates(path)
            else:
                ours = _is_rejected_list(path)
        except (OSError, ValueError):
            ours = False
        (folder.owned.append(path) if ours else folder.alien.append(path))
    shards = storage.join(root, SHARDS_DIR)
    names = storage.listdir(shards)
    for name in names:
        path = storage.join(shards, name)
        if is_shard_temp(name) or is_checksum_file(name):
            folder.owned.append(path)
        elif _SHARD_FILE.match(name):
            try:
                attrs = read_attrs(path)
            except (OSError, ValueError):
                attrs = {}
            # Remote: a sidecar marks a shard whose copy finished; the worker checks its bytes against
            # it (and computes the shard again on a mismatch), so the launcher need not read every shard.
            remote, sidecar = not storage.is_local(root), name + CHECKSUM_SUFFIX in names
            if "run_key" in attrs and (sidecar or not remote):
                folder.shards[name] = attrs
                folder.owned.append(path)
            elif remote and ("run_key" in attrs or sidecar):
                log.warning("%s: not proven complete (no readable shard with a checksum sidecar); computing it again", path)
                folder.owned.append(path)
                folder.unproven += [path, path + CHECKSUM_SUFFIX]
            else:
                folder.alien.append(path)
    return folder


def _attr_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def folder_differences(folder: Folder, spec: JobSpec, fingerprint: str | None) -> list[str]:
    """How what the folder holds differs from this run; empty when it can be resumed or extended."""
    differences = []
    if folder.manifest is not None:
        manifest = folder.manifest
        theirs = manifest.get("run_identity") or run_identity(manifest["config"])
        differences += [f"{MANIFEST}: written by a different run: {d}" for d in _identity_differences(theirs, spec.identity)]
        if fingerprint and manifest.get("model_fingerprint") not in (None, fingerprint):
            differences.append(
                f"{MANIFEST}: model weights differ (fingerprint {manifest['model_fingerprint'][:16]}… there, "
                f"{fingerprint[:16]}… in this run)"
            )
    expected = {shard_name(r.start, r.stop): r for r in spec.ranges() if r.rows}
    by_shard: dict[str, list[str]] = {}  # the same difference for many shards is listed once
    for name, attrs in folder.shards.items():
        where = f"{SHARDS_DIR}/{name}"
        shard = expected.get(name)
        if shard is None:
            by_shard.setdefault("not one of this run's shards (ids grouped differently: another input set or "
                                "samples_per_shard)", []).append(where)
            continue
        if "run_identity" in attrs:
            found = _identity_differences(json.loads(_attr_str(attrs["run_identity"])), spec.identity)
        else:
            found = [] if _attr_str(attrs["run_key"]) == spec.run_key else [f"run key {_attr_str(attrs['run_key'])}, this run {spec.run_key}"]
        found = [f"written by a different run: {d}" for d in found]
        stored = _attr_str(attrs.get("model_fingerprint", ""))
        if fingerprint and stored and stored != fingerprint:
            found.append(f"model weights differ (fingerprint {stored[:16]}… there, {fingerprint[:16]}… in this run)")
        if "inputs" in attrs and json.loads(_attr_str(attrs["inputs"])) != shard_inputs(spec.files, shard.start, shard.stop):
            found.append("computed from other input data (its ids now mean other samples)")
        elif int(attrs.get("num_rows", shard.stop - shard.start)) != shard.rows:
            found.append(f"holds {int(attrs.get('num_rows', 0))} samples, this run rejects others ({shard.rows} expected)")
        for difference in found:
            by_shard.setdefault(difference, []).append(where)
    for difference, shards in by_shard.items():
        others = f" (so do {len(shards) - 1} more shards)" if len(shards) > 1 else ""
        differences.append(f"{shards[0]}: {difference}{others}")
    return differences


# --- the job ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    spec: JobSpec
    already_done: int  # samples in complete shards that this run keeps
    remove: list[str]  # jacobeam's files to remove first: --overwrite's, unproven remote shards
    model_output_shape: tuple[int, ...] | None = None


def _check_files_named(config: Config) -> None:
    """Every file the config names (besides inputs) exists."""
    from apache_beam.io.filesystems import FileSystems

    jacobian = config.jacobian
    named = {
        "model.path": config.model.path,
        "jacobian.vectors": jacobian.vectors if jacobian.reduce in ("vjp", "jvp") else None,
        "jacobian.basis.input": jacobian.basis.input if jacobian.reduce == "basis" else None,
        "jacobian.basis.output": jacobian.basis.output if jacobian.reduce == "basis" else None,
    }
    for key, path in named.items():
        if path is not None and not FileSystems.exists(path):
            raise ConfigError(f"{key} {path}: no such file or directory")


def _label_key(config: Config) -> str | None:
    return config.jacobian.labels.key if config.jacobian.outputs == "label" else None


def _build_spec(config: Config, files, segments, scans, identity, tf_threads, fingerprint) -> JobSpec:
    runs, unreadable = rejected_runs(files, scans)
    ranges = shard_ranges(segments, config.output.samples_per_shard, runs)
    if not any(r.rows for r in ranges):
        raise InputError(f"input.paths: all {max(f.stop_id for f in files)} samples are rejected; nothing to compute")
    return JobSpec(
        model=ModelSource(**to_dict(config)["model"]),
        files=tuple(files),
        output_dir=storage.normalize(config.output.path),
        run_key=run_key(identity),
        engine=config.jacobian.engine_options(),
        samples_per_shard=config.output.samples_per_shard,
        compression=config.output.compression,
        tf_threads=tf_threads,
        label_key=_label_key(config),
        config=to_dict(config),
        started_at=time.time(),
        shard_ranges=tuple(ranges),
        file_rejects=tuple(unreadable),
        id_segments=tuple(tuple(s) for s in segments),
        identity=identity,
        model_fingerprint=fingerprint,
        self_check=config.jacobian.self_check.spec(),
    )


def make_job(config: Config, tf_threads: int | None = None, overwrite: bool = False, check_model: bool = True) -> Job:
    """Plan the job for ``config`` and check everything that can be checked before the pipeline starts.

    Raises a ``JacobeamError`` naming the file, row or key for: unusable inputs, bad samples under
    ``on_bad_sample: error``, a model that does not take the inputs' samples, and an output folder that
    holds another run's result (unless ``overwrite``). Touches no output.
    """
    policy = config.input.on_bad_sample
    if check_model:
        from jacobeam.transforms.engine.threads import configure_tf_threads

        configure_tf_threads(tf_threads, warn=False)  # before reading inputs, which may run TensorFlow ops
    files = resolve_inputs(
        config.input.paths, config.input.key, policy, config.input.shape(), config.input.image_options()
    )
    _check_files_named(config)
    for source in files if _label_key(config) else ():
        if source.unreadable is None:
            check_labels(source, _label_key(config))
    scans = scan_inputs(files, policy)
    files = _with_hashes(files, scans)
    fingerprint, output_shape = None, None
    if check_model:
        from jacobeam.pipeline.checks import check_model as check

        fingerprint, output_shape = check(ModelSource(**to_dict(config)["model"]), files)
    identity = run_identity(to_dict(config))
    folder = read_folder(config.output.path)
    if folder.alien:
        raise OutputError(
            f"output folder {folder.root}: " + "; ".join(folder.alien[:_MAX_LISTED])
            + " — jacobeam uses these names, but did not write these files; move them away or choose another output.path"
        )
    placed, segments, differences = place_files(files, folder.manifest)
    spec = _build_spec(config, placed, segments, scans, identity, tf_threads, fingerprint)
    differences += folder_differences(folder, spec, fingerprint)
    remove: list[str] = list(folder.unproven)
    if differences:
        if not overwrite:
            listed = "\n  ".join(differences[:_MAX_LISTED])
            more = f"\n  ... and {len(differences) - _MAX_LISTED} more" if len(differences) > _MAX_LISTED else ""
            raise OutputError(
                f"output folder {folder.root} holds the result of a different run:\n  {listed}{more}\n"
                "use --overwrite to replace it (jacobeam removes only files it wrote), or choose another output.path"
            )
        log.warning("--overwrite: replacing the different run in %s", folder.root)
        remove = list(folder.owned)
        placed, segments, _ = place_files(files, None)
        spec = _build_spec(config, placed, segments, scans, identity, tf_threads, fingerprint)
        already_done = 0
    else:
        rows = {shard_name(r.start, r.stop): r.rows for r in spec.ranges()}
        already_done = sum(rows[name] for name in folder.shards)
    return Job(spec, already_done, remove, output_shape)


def prepare_output(job: Job) -> None:
    """The run's first writes, once every check has passed: make sure the folder can be written, apply
    ``--overwrite`` (only files jacobeam wrote), remove temporary files that a killed run left."""
    from jacobeam.pipeline.checks import check_writable

    root = job.spec.output_dir
    check_writable(root)
    storage.delete(*job.remove)
    shards = storage.join(root, SHARDS_DIR)
    if job.remove and storage.is_local(root) and os.path.isdir(shards) and not os.listdir(shards):
        os.rmdir(shards)
    remove_temp_files(root)
