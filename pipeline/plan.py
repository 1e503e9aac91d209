"""Turn a validated config into a job: resolve the input globs, check and scan the files, place them on
the id line (``pipeline.ids``), fix the shard ranges, and decide what the output folder already holds.

Everything in ``make_job`` runs in the launching process before any output is touched: a bad input, a
bad sample (``input.on_bad_sample: error``), a model that does not fit the inputs or a folder holding
another run's result fails here, with nothing written. ``prepare_output`` then makes the first writes
(create the folder, apply ``--overwrite``, remove a killed run's temporary files).

This module imports no TensorFlow; the model check (``pipeline.checks``) imports it when called. Its
parts: ``pipeline.discover`` (input files), ``pipeline.identity`` (what makes two runs the same),
``pipeline.ids`` (ids and shard ranges), ``pipeline.folder`` (what the output folder holds).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from jacobeam.pipeline.config import Config, ConfigError, to_dict
from jacobeam.pipeline.discover import resolve_inputs, scan_inputs
from jacobeam.pipeline.folder import folder_differences, read_folder
from jacobeam.pipeline.identity import run_identity, run_key
from jacobeam.pipeline.ids import place_files, rejected_runs, shard_ranges, with_hashes
from jacobeam.transforms.errors import InputError, OutputError
from jacobeam.transforms.finalize import remove_temp_files
from jacobeam.transforms.inputs.readers import check_labels
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import SHARDS_DIR, shard_name
from jacobeam.transforms.spec import JobSpec, ModelSource

log = logging.getLogger(__name__)

_MAX_LISTED = 8  # differences shown in one error message


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


def _recorded_config(config: Config) -> dict:
    """The config as the manifest records it: the model path absolute (a local one), as the input paths
    are, so that ``verify`` finds the model from any working directory. The run's identity keeps the path
    as the user wrote it (``run_identity`` of the config itself), so a folder resumed by the same config
    is the same run."""
    recorded = to_dict(config)
    if recorded["model"].get("path"):
        recorded["model"]["path"] = storage.absolute(recorded["model"]["path"])
    return recorded


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
        config=_recorded_config(config),
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
    files = with_hashes(files, scans)
    fingerprint, output_shape = None, None
    if check_model:
        from jacobeam.pipeline.checks import check_model as check

        log.info("loading the model to check it against the inputs")
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
