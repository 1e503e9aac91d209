"""The last step of a job: check the shards cover every sample once, then write ``jacobians.h5`` and
``manifest.json``.

The manifest is written last, and only after the virtual view: an output folder is complete exactly
when it has a manifest.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam

from transforms.aggregates import PARTIALS
from transforms.errors import OutputError
from transforms.shards import SHARDS_DIR, ShardRecord, is_temp_file, read_attrs
from transforms.spec import JobSpec, version

MANIFEST = "manifest.json"
VIEW = "jacobians.h5"


def check_coverage(records: Sequence[ShardRecord], num_samples: int) -> list[ShardRecord]:
    """Records sorted by id, after checking they tile ``[0, num_samples)`` with no gap or overlap."""
    ordered = sorted(records, key=lambda record: record.start)
    expected = 0
    for record in ordered:
        if record.start != expected:
            raise OutputError(f"shards leave ids {expected}..{record.start} uncovered or overlap there")
        expected = record.stop
    if expected != num_samples:
        raise OutputError(f"shards cover ids 0..{expected}, expected 0..{num_samples}")
    return ordered


def _write_atomically(path: Path, write) -> None:
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def write_virtual_view(output_dir: str, records: Sequence[ShardRecord]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Write ``jacobians.h5``: one virtual dataset per shard dataset, all shards in id order.

    Sources are relative paths (``shards/...``), which HDF5 resolves against the view's own folder,
    so the output folder can be moved. Returns each dataset's per-sample shape and dtype.
    """
    import h5py

    root = Path(output_dir)
    total = records[-1].stop
    fields: dict[str, tuple] = {}

    def per_sample(name: str, item) -> None:
        if isinstance(item, h5py.Dataset) and not name.startswith(f"{PARTIALS}/"):
            fields[name] = (item.shape[1:], item.dtype)

    with h5py.File(root / records[0].file, "r") as first:
        first.visititems(per_sample)
    layouts = {name: h5py.VirtualLayout((total, *shape), dtype) for name, (shape, dtype) in fields.items()}
    for record in records:
        for name, (shape, _) in fields.items():
            source = h5py.VirtualSource(record.file, name, shape=(record.num_samples, *shape))
            layouts[name][record.start : record.stop] = source

    def write(temp: Path) -> None:
        with h5py.File(temp, "w", libver="latest") as view:
            for name, layout in layouts.items():
                view.create_virtual_dataset(name, layout)

    _write_atomically(root / VIEW, write)
    return {name: (tuple(int(d) for d in shape), dtype.name) for name, (shape, dtype) in fields.items()}


def library_versions() -> dict[str, str]:
    import apache_beam
    import h5py
    import numpy
    import tensorflow

    return {
        "jacobeam": version(),
        "python": platform.python_version(),
        "tensorflow": tensorflow.__version__,
        "numpy": numpy.__version__,
        "apache_beam": apache_beam.__version__,
        "h5py": h5py.__version__,
    }


def build_manifest(spec: JobSpec, records: Sequence[ShardRecord], fields: dict[str, Any]) -> dict[str, Any]:
    attrs = read_attrs(Path(spec.output_dir) / records[0].file)
    wall = time.time() - spec.started_at
    computed = sum(record.num_samples for record in records if record.computed)
    return {
        "jacobeam_version": version(),
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": spec.config,
        "num_samples": spec.num_samples,
        "input_shape": list(spec.sample_shape),
        "output_shape": [int(d) for d in attrs["output_shape"]],
        "dtype": str(attrs["dtype"]),
        "model_fingerprint": records[0].model_fingerprint,
        # What the engine ran and why, as the first worker's engine reported it.
        "engine": records[0].engine,
        "run_key": spec.run_key,
        "datasets": {name: {"shape": ["n", *shape], "dtype": dtype} for name, (shape, dtype) in fields.items()},
        "stored": _stored(spec),
        "inputs": [
            {
                "path": source.path,
                "key": source.key,
                "first_id": source.first_id,
                "stop_id": source.stop_id,
                "num_samples": source.num_samples,
                "dtype": source.dtype,
            }
            for source in spec.files
        ],
        "shards": [
            {
                "file": record.file,
                "start": record.start,
                "stop": record.stop,
                "num_samples": record.num_samples,
                "sha256": record.sha256,
                "computed_in_this_run": record.computed,
                **({"worker_pid": record.worker_pid, "engine_builds": record.engine_builds} if record.computed else {}),
            }
            for record in records
        ],
        "versions": library_versions(),
        "run": {
            "wall_seconds": round(wall, 3),
            "samples_computed": computed,
            "samples_kept": spec.num_samples - computed,
            "samples_per_second": round(computed / wall, 2) if wall > 0 else None,
        },
    }


def _stored(spec: JobSpec) -> dict[str, Any]:
    """How the stored datasets were made: the rows rule, the reduction and its parameters."""
    selection, reduction = spec.engine.outputs, spec.engine.reduce
    stored: dict[str, Any] = {"outputs": selection.rule, "reduce": reduction.kind}
    if selection.rule == "indices":
        stored["indices"] = list(selection.indices)
    if selection.rule == "top_k":
        stored["top_k"] = selection.k
    if selection.rule == "label":
        stored["labels_key"] = spec.label_key
    if reduction.kind in ("vjp", "jvp"):
        stored["vectors"] = reduction.vectors
    if reduction.kind == "project":
        stored["projection"] = {"dim": reduction.project_dim, "kind": reduction.project_kind, "seed": reduction.project_seed}
    if reduction.kind == "basis":
        stored["basis"] = {"input": reduction.basis_input, "output": reduction.basis_output}
    return stored


def remove_temp_files(output_dir: str) -> None:
    """Delete temporary shard files that killed writers left behind (only jacobeam's own names)."""
    shards = Path(output_dir) / SHARDS_DIR
    for path in shards.iterdir() if shards.is_dir() else ():
        if is_temp_file(path.name):
            path.unlink(missing_ok=True)


def finalize(records: Sequence[ShardRecord], spec: JobSpec, aggregates: dict[str, Any] | None = None) -> dict[str, Any]:
    ordered = check_coverage(records, spec.num_samples)
    fields = write_virtual_view(spec.output_dir, ordered)
    remove_temp_files(spec.output_dir)
    manifest = build_manifest(spec, ordered, fields)
    manifest["aggregates"] = aggregates or {}
    _write_atomically(
        Path(spec.output_dir) / MANIFEST, lambda temp: temp.write_text(json.dumps(manifest, indent=2) + "\n")
    )
    return manifest


class Finalize(beam.PTransform):
    """``PCollection[ShardRecord] -> PCollection[manifest dict]``: one step after every shard is done
    (and after ``aggregates``, a single-element ``PCollection`` from ``Aggregate``, if given)."""

    def __init__(self, spec: JobSpec, aggregates=None):
        super().__init__()
        self._spec = spec
        self._aggregates = aggregates

    def expand(self, records):
        side = {} if self._aggregates is None else {"aggregates": beam.pvalue.AsSingleton(self._aggregates)}
        return (
            records
            | "AllShards" >> beam.combiners.ToList()
            | "WriteManifest" >> beam.Map(finalize, self._spec, **side)
        )
