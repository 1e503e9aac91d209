"""Turn a validated config into a job: resolve the input globs, describe the files from their headers,
place them on the id line (``pipeline.ids``), fix the shard ranges, and decide what the output folder
already holds.

Everything in ``make_job`` runs in the launching process before any output is touched, and reads
metadata only (listings, headers, the output folder's shard attributes): an unusable input file, labels
of the wrong key or dtype, a model that does not fit the inputs or a folder holding another run's
result fails here, with nothing written. The samples are read, checked and hashed by the workers
(``transforms.inputs.checks``): a bad sample under ``input.on_bad_sample: error`` stops the job there,
and the shards already complete are kept for the rerun. ``prepare_output`` then makes the first writes
(create the folder, apply ``--overwrite``, remove a killed run's temporary files). The shards of input
files whose stamp changed since (``JobSpec.stale``) stay: a worker reads their samples again, keeps
those that read as before, and replaces the others when their new shard is committed.

This module imports no TensorFlow; the model check (``pipeline.checks``) imports it when called. Its
parts: ``pipeline.discover`` (input files), ``pipeline.identity`` (what makes two runs the same),
``pipeline.ids`` (ids and shard ranges), ``pipeline.folder`` (what the output folder holds), and
``pipeline.up_to_date`` (a folder whose result is complete and current: ``plan_run`` then plans nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid

from jacobeam.pipeline import up_to_date
from jacobeam.pipeline.config import Config, to_dict
from jacobeam.pipeline.discover import list_inputs, recorded_descriptions, resolve_inputs
from jacobeam.pipeline.folder import (
    Folder,
    folder_differences,
    holding_removed,
    listed_crc32c,
    read_folder,
    recorded_run_key,
    stale_shards,
    stored_fingerprint,
    unfinished_outdated,
)
from jacobeam.pipeline.identity import run_identity
from jacobeam.pipeline.ids import path_mapper, place_files, shard_ranges
from jacobeam.pipeline.labels import file_labels, relabelled_shards
from jacobeam.pipeline.overwrite import unfinished
from jacobeam.transforms.errors import InputError, ModelError, OutputError
from jacobeam.transforms.finalize import remove_temp_files
from jacobeam.transforms.inputs.readers import check_labels
from jacobeam.transforms.model_identity import model_identity
from jacobeam.transforms.output import fence, storage
from jacobeam.transforms.output.layout import SHARDS_DIR, shard_ids, shard_name
from jacobeam.transforms.spec import JobSpec, ModelSource, Rejected, run_key

log = logging.getLogger(__name__)

_MAX_LISTED = 8  # differences shown in one error message
_COUNTED_BY_TENSORFLOW = (".tfrecord.gz", ".tfrecords.gz")  # a GZIP stream's records: counted by reading it through


@dataclasses.dataclass
class Job:
    spec: JobSpec
    already_done: int  # sample ids (stored or rejected) in complete shards that this run keeps
    remove: list[str]  # jacobeam's files to remove first: --overwrite's, unproven remote shards
    model_output_shape: tuple[int, ...] | None = None
    # Every range has a shard already (stale ones are read again first): the workers load the model only
    # for a range they compute.
    complete: bool = False


@dataclasses.dataclass
class UpToDate:
    """The output folder holds this run's complete result already (``pipeline.up_to_date``): nothing to
    compute, nothing to write but the run's manifest."""

    root: str
    manifest: dict  # as the last run wrote it, with its "inputs" (``inputs_table.with_inputs``)
    files: int  # input files listed


@dataclasses.dataclass
class Replace:
    """The output folder holds another run's complete result, and ``--overwrite`` replaces it: the new
    result is computed beside it, in ``pipeline.overwrite.staging(root)``, and moved in once committed."""

    root: str


def _check_files_named(config: Config) -> None:
    """Every file the config names (besides inputs) exists. A missing one is a ``ModelError``, as when the
    engine cannot read it, not a ``ConfigError``: the config is valid, the file is not there."""
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
            raise ModelError(f"{key} {path}: no such file or directory")


def _recorded_config(config: Config) -> dict:
    """The config as the manifest records it: the local files it names absolute (the model's, the vectors
    and bases of ``reduce: vjp``, ``jvp``, ``basis``), as the input paths are, so that ``verify`` finds them
    from any working directory. The run's identity names them as ``pipeline.identity.comparable`` does
    (the model by its content, other files resolved): a folder resumed by the same config, from a copy of
    its folder or with another spelling of a path, is the same run."""
    recorded = to_dict(config)
    jacobian = recorded["jacobian"]
    for section, key in ((recorded["model"], "path"), (jacobian, "vectors"), (jacobian["basis"], "input"),
                         (jacobian["basis"], "output"), (jacobian["labels"] or {}, "table")):
        if section.get(key):
            section[key] = storage.absolute(section[key])
    return recorded


def _checked_model(config: Config, files) -> tuple[str, tuple[int, ...], dict]:
    from jacobeam.pipeline.checks import check_model

    log.info("loading the model to check it against the inputs")
    return check_model(ModelSource(**to_dict(config)["model"]), files)


def _label_key(config: Config) -> str | None:
    return config.jacobian.labels.key if config.jacobian.needs_labels else None


def _build_spec(config: Config, files, segments, identity, tf_threads, fingerprint, model, key=None) -> JobSpec:
    return JobSpec(
        model=ModelSource(**to_dict(config)["model"]),
        files=tuple(f for f in files if not f.removed),
        removed=tuple(f for f in files if f.removed),
        output_dir=storage.normalize(config.output.path),
        run_key=key or run_key(identity),
        engine=config.jacobian.engine_options(),
        samples_per_shard=config.output.samples_per_shard,
        compression=config.output.compression,
        tf_threads=tf_threads,
        label_key=_label_key(config),
        config=_recorded_config(config),
        started_at=time.time(),
        shard_ranges=tuple(shard_ranges(segments, config.output.samples_per_shard)),
        # Files that cannot be opened (under skip): no ids; what is wrong with a sample, the workers find.
        file_rejects=tuple(Rejected(file=f.path, reason=f.unreadable) for f in files if f.unreadable is not None),
        id_segments=tuple(tuple(s) for s in segments),
        identity=identity,
        model_fingerprint=fingerprint,
        model_identity=model,
        self_check=config.jacobian.self_check.spec(),
        on_bad_sample=config.input.on_bad_sample,
    )


def plan_run(
    config: Config, tf_threads: int | None = None, overwrite: bool = False, check_model: bool = True,
    accept_library_versions: bool = False, identify_model: bool = True, run_id: str = "", *,
    folder: Folder | None = None, shortcut: bool = True,
) -> Job | UpToDate | Replace:
    """``UpToDate`` when the output folder holds this run's complete result already and nothing it was
    computed from changed (``pipeline.up_to_date``: judged from listings, stamps and the folder's
    metadata, not per file); otherwise the job ``make_job`` would plan with the same arguments, the
    listing and the folder read once. ``folder``: as ``read_folder`` found it, where the caller has it.
    ``shortcut`` false: always ``make_job`` (a caller's pipeline runs the job, whatever it finds).
    ``Replace`` where ``overwrite`` is to replace another run's complete result: it is computed in a
    folder of its own first (``pipeline.overwrite``); ``make_job`` plans as if the old result were removed."""
    folder = _prepare(config, tf_threads, check_model, identify_model, folder)
    listed = _listed(config, folder)
    if shortcut and not overwrite:
        model = ModelSource(**to_dict(config)["model"]) if identify_model else None
        why = up_to_date.why_not(folder, _recorded_config(config), listed, model)
        if why is None:
            return UpToDate(folder.root, folder.manifest, len(listed))
        log.debug("planning the run in full: %s", why)
    return _plan_job(config, tf_threads, overwrite, check_model, accept_library_versions, identify_model, run_id,
                     folder, listed, replace=True)


def make_job(
    config: Config, tf_threads: int | None = None, overwrite: bool = False, check_model: bool = True,
    accept_library_versions: bool = False, identify_model: bool = True, run_id: str = "", *,
    folder: Folder | None = None, listed: dict[str, str] | None = None,
) -> Job:
    """Plan the job for ``config`` and check everything that can be checked before the pipeline starts.

    Raises a ``JacobeamError`` naming the file or key for: unusable inputs (by their headers), a model
    that does not take the inputs' samples, and an output folder that
    holds another run's result (unless ``overwrite``): another model (its identity, read from its files:
    ``transforms.model_identity``), or other library versions (unless ``accept_library_versions``).
    Touches no output. ``check_model``: load the model to check it takes the inputs' samples (and to
    compare its weights with a folder written before shards stored the model's identity).
    ``identify_model`` false: the configured model is not the one computed (a test's engine factory),
    the run has no model identity. ``run_id``: the run's lease's, whose commits then prove they hold
    it; a new one, unfenced, if empty (a folder without a lease). ``folder`` and ``listed``: the output
    folder (``read_folder``) and the input files' listing (``discover.list_inputs``), where the caller
    has them already.
    """
    folder = _prepare(config, tf_threads, check_model, identify_model, folder)
    return _plan_job(config, tf_threads, overwrite, check_model, accept_library_versions, identify_model, run_id,
                     folder, listed)


def _prepare(config: Config, tf_threads: int | None, check_model: bool, identify_model: bool,
             folder: Folder | None) -> Folder:
    """What planning needs first, done once: TensorFlow's threads set (before a factory is built to know
    its identity, or inputs read with TensorFlow ops), the files the config names checked, and the output
    folder read (``folder``, where the caller has it)."""
    if check_model or (identify_model and config.model.factory is not None):
        from jacobeam.transforms.engine.threads import configure_tf_threads

        configure_tf_threads(tf_threads, warn=False)
    _check_files_named(config)
    return read_folder(config.output.path) if folder is None else folder


def _listed(config: Config, folder: Folder) -> dict[str, str]:
    """``discover.list_inputs`` of the config's globs. Where they match nothing, the folder's result stays:
    every input file gone is refused (a mistyped glob looks the same), saying so."""
    try:
        return list_inputs(config.input.paths)
    except InputError as err:
        recorded = len((folder.manifest or {}).get("inputs") or ())
        if not recorded:
            raise
        raise InputError(f"{err}: refused, as a mistyped glob would be, and the result in {folder.root} ({recorded:,} "
                         "input file(s)) is kept; to empty it, delete the output folder") from None


def _plan_job(config: Config, tf_threads: int | None, overwrite: bool, check_model: bool,
              accept_library_versions: bool, identify_model: bool, run_id: str, folder: Folder,
              listed: dict[str, str] | None, replace: bool = False) -> Job | Replace:
    policy = config.input.on_bad_sample
    # Files whose stamp the folder's manifest recorded keep the description it recorded (no header read).
    known = recorded_descriptions(folder.manifest, to_dict(config)["input"])
    listed = _listed(config, folder) if listed is None else listed
    if any(path.lower().endswith(_COUNTED_BY_TENSORFLOW) and getattr(known.get(path), "stamp", None) != stamp
           for path, stamp in listed.items()):
        # Counting a compressed file's records is this process's first TensorFlow op, which sizes its pools:
        # the in-process runner's workers want theirs.
        from jacobeam.transforms.engine.threads import configure_tf_threads

        configure_tf_threads(tf_threads, warn=False)
    files = resolve_inputs(
        config.input.paths, config.input.key, policy, config.input.shape(), config.input.image_options(), known,
        listed,
    )
    label_key = _label_key(config)
    floats = [f.path for f in files if label_key and f.unreadable is None and check_labels(f, label_key).kind == "f"]
    if floats:
        log.warning("jacobian.labels.key %r: floating-point labels in %d file(s) (%s%s); each must be a whole "
                    "output index", label_key, len(floats), floats[0], ", ..." if len(floats) > 1 else "")
    # jacobian.labels folders or table: each file's label; classes that would renumber the folder's differ.
    files, labels, differences = file_labels(config, files, folder.manifest)
    fingerprint, output_shape, loaded = _checked_model(config, files) if check_model else (None, None, None)
    identity = run_identity(to_dict(config))
    # The model's identity: the loaded model's where it was loaded (a factory is not built twice); a
    # factory's is that of what it builds, so it is built here when it was not (transforms.model_identity).
    model = (loaded or model_identity(ModelSource(**to_dict(config)["model"]))) if identify_model else {}
    if folder.alien:
        raise OutputError(
            f"output folder {folder.root}: " + "; ".join(folder.alien[:_MAX_LISTED])
            + " — jacobeam uses these names, but did not write these files; move them away or choose another output.path"
        )
    placed, segments, placing = place_files(files, folder.manifest, folder.root)
    differences += placing
    # Without loading the model, the weights the kept shards were computed with: a worker that loads
    # others (a factory that draws them) refuses to write a shard beside them.
    kept_weights = fingerprint or stored_fingerprint(folder)
    # The folder's own key where it recorded this identity (another spelling of a path, or an older key).
    key = recorded_run_key(folder, identity)
    spec = _build_spec(config, placed, segments, identity, tf_threads, kept_weights, model, key)
    spec = dataclasses.replace(spec, labels=labels)
    outdated = unfinished_outdated(folder, spec)  # an unfinished run's shards whose ids now mean other samples
    differences += folder_differences(folder, spec, fingerprint, accept_library_versions, outdated)
    remove: list[str] = list(folder.unproven)
    if differences:
        if not overwrite:
            listed = "\n  ".join(differences[:_MAX_LISTED])
            more = f"\n  ... and {len(differences) - _MAX_LISTED} more" if len(differences) > _MAX_LISTED else ""
            left = unfinished(folder.root)
            raise OutputError(
                f"output folder {folder.root} holds the result of a different run:\n  {listed}{more}\n"
                "use --overwrite to replace it (jacobeam removes only files it wrote), or choose another output.path"
                + (f"\n({left})" if left else "")
            )
        if replace and folder.manifest is not None:
            return Replace(folder.root)
        log.warning("--overwrite: replacing the different run in %s", folder.root)
        remove = list(folder.owned)
        files, labels, _ = file_labels(config, files, None)
        placed, segments, _ = place_files(files, None)
        spec = _build_spec(config, placed, segments, identity, tf_threads, fingerprint, model)
        spec = dataclasses.replace(spec, labels=labels)
        already_done, complete = 0, False
    else:
        # A stale shard stays until its replacement is committed (or, where no range of this run is its,
        # until the new manifest no longer names it): the manifest and the view never point at a file gone.
        stale = stale_shards(folder, spec)
        if stale:
            log.info("%d shard(s) computed from input files changed since (another stamp): their samples are "
                     "read again, and those that differ computed again", len(stale))
        trimmed = [name for name in holding_removed(folder, spec) if name not in stale]
        if trimmed:
            log.info("%d shard(s) hold samples of input files gone: each is written again without them, its "
                     "other rows copied (not computed)", len(trimmed))
            stale = sorted([*stale, *trimmed])
        relabelled = [name for name in relabelled_shards(folder, spec, path_mapper(folder.manifest, list(spec.files),
                                                                                    spec.output_dir)) if name not in stale]
        if relabelled:
            log.info("%d shard(s) computed with other labels of their files (jacobian.labels): their samples are "
                     "read again, and computed again where their labels differ", len(relabelled))
            stale = sorted([*stale, *relabelled])
        outdated = [name for name in outdated if name not in stale]
        if outdated:
            log.info("%d shard(s) of a run here that did not finish hold samples whose ids this run places otherwise "
                     "(input files added among the others, mended, or put back): computed again", len(outdated))
            stale = sorted([*stale, *outdated])
        names = {shard_name(r.start, r.stop) for r in spec.ranges()}
        spec = dataclasses.replace(
            spec, stale=tuple(name for name in stale if name in names),
            obsolete=tuple(f"{SHARDS_DIR}/{name}" for name in stale if name not in names),
            listed_crc32c=tuple((name, crc) for name, crc in listed_crc32c(folder) if name in names and name not in stale),
        )
        kept = [shard_ids(name) for name in folder.shards if name not in stale]  # of this run: folder_differences
        already_done = sum(stop - start for start, stop in kept)
        complete = len(kept) + len(spec.stale) == len(spec.ranges())
    # The run's id (its lease's, when it holds one): its temporary files carry it, and each of its
    # commits proves that the lease is still its own (``transforms.output.fence``).
    spec = dataclasses.replace(spec, run_id=run_id or uuid.uuid4().hex[:12], fenced=bool(run_id))
    return Job(spec, already_done, remove, output_shape, complete)


def prepare_output(job: Job) -> None:
    """The run's first writes, once every check has passed: make sure the folder can be written, apply
    ``--overwrite`` (only files jacobeam wrote), remove temporary files that killed runs left. Every
    run's: the run holds the folder's lease (a file system without one is written by one run at a time,
    ``transforms.output.lease.supported``), so no other run is writing them."""
    from jacobeam.pipeline.checks import check_writable

    root = job.spec.output_dir
    check_writable(root)
    guard = fence.of(job.spec)
    with fence.held(guard):
        storage.delete(*job.remove)
    shards = storage.join(root, SHARDS_DIR)
    if job.remove and storage.is_local(root) and os.path.isdir(shards) and not os.listdir(shards):
        os.rmdir(shards)
    remove_temp_files(root, guard=guard)
