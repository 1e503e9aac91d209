"""Turn a validated config into a job: resolve the input globs, check the files, fix the shard ranges.

Everything here runs in the launching process before any output is touched, and imports no
TensorFlow: a bad input or a foreign output folder fails here, with nothing written.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from pipeline.config import Config, ConfigError, to_dict
from transforms.errors import InputError
from transforms.readers import SourceFile, assign_ids, check_consistent, check_labels, describe
from transforms.shards import SHARDS_DIR, read_attrs, shard_name
from transforms.spec import JobSpec, ModelSource


def resolve_inputs(patterns: list[str], key: str | None) -> list[SourceFile]:
    """Every file the globs match (each file once), described and given its id range."""
    from apache_beam.io.filesystems import FileSystems

    paths: set[str] = set()
    for pattern, match in zip(patterns, FileSystems.match(patterns)):
        if not match.metadata_list:
            raise InputError(f"input.paths: {pattern!r} matches no files")
        paths.update(metadata.path for metadata in match.metadata_list)
    files = assign_ids([describe(path, key) for path in paths])
    check_consistent(files)
    if files[-1].stop_id == 0:
        raise InputError(f"input.paths: the {len(files)} matched file(s) hold no samples")
    return files


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


def run_key(config: Config, files: list[SourceFile]) -> str:
    """A hash of everything that decides the shards' contents, down to the last bit (the whole
    ``jacobian`` section but ``threads``)."""
    resolved = to_dict(config)
    identity = {
        "model": resolved["model"],
        "inputs": [[f.path, f.key, f.num_samples, list(f.sample_shape), f.dtype] for f in files],
        "samples_per_shard": config.output.samples_per_shard,
        "jacobian": {key: value for key, value in resolved["jacobian"].items() if key != "threads"},
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def check_output_folder(spec: JobSpec) -> int:
    """Refuse a folder holding shards of another run; returns how many samples are already complete."""
    shards = Path(spec.output_dir) / SHARDS_DIR
    if not shards.is_dir():
        return 0
    expected = {shard_name(r.start, r.stop): r for r in spec.ranges()}
    done = 0
    for path in sorted(shards.glob("shard-*.h5")):
        shard = expected.get(path.name)
        if shard is None:
            raise ConfigError(
                f"{path}: this shard does not belong to this run's id ranges (another input set or "
                f"samples_per_shard?); use a new output.path"
            )
        found = read_attrs(path).get("run_key")
        if found != spec.run_key:
            raise ConfigError(
                f"{path}: written by a different run (run key {found}, this run {spec.run_key}: the model, "
                "inputs, samples_per_shard or jacobian settings differ); use a new output.path"
            )
        done += shard.stop - shard.start
    return done


def make_job(config: Config, tf_threads: int | None = None) -> tuple[JobSpec, int]:
    """The job for ``config`` and how many of its samples are already complete on disk."""
    files = resolve_inputs(config.input.paths, config.input.key)
    _check_files_named(config)
    label_key = config.jacobian.labels.key if config.jacobian.outputs == "label" else None
    for source in files if label_key else ():
        check_labels(source, label_key)
    if "://" in config.output.path:
        raise ConfigError(f"output.path {config.output.path}: only local output folders are supported so far")
    output_dir = str(Path(config.output.path).resolve())
    spec = JobSpec(
        model=ModelSource(**to_dict(config)["model"]),
        files=tuple(files),
        output_dir=output_dir,
        run_key=run_key(config, files),
        engine=config.jacobian.engine_options(),
        samples_per_shard=config.output.samples_per_shard,
        compression=config.output.compression,
        tf_threads=tf_threads,
        label_key=label_key,
        config=to_dict(config),
        started_at=time.time(),
    )
    return spec, check_output_folder(spec)
