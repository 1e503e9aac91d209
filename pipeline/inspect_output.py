"""``jacobeam inspect OUT``: what an output folder holds, and whether it is complete and readable.

A virtual dataset whose source file is missing silently reads fill values, so every source of
``jacobians.h5`` is checked here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jacobeam.pipeline.folder import Folder, read_folder, stale_names
from jacobeam.pipeline.overwrite import pending, unfinished
from jacobeam.pipeline.self_check_report import checks_line, precision_line
from jacobeam.transforms.engine.reductions import DESCRIPTIONS, PARAMETER_DESCRIPTIONS
from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.finalize import missing_sources, view_datasets
from jacobeam.transforms.model_identity import COMPARED_LIBRARIES
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import (
    ENGINE_PLAN,
    INPUTS_TABLE,
    LEASE,
    MANIFEST,
    OVERWRITE_DIR,
    REJECTED_FILE,
    SHARDS_DIR,
    VIEW,
    is_folder_temp,
    is_shard_file,
    is_shard_temp,
    result_datasets,
)


@dataclass
class Report:
    folder: str
    manifest: dict[str, Any] | None
    shards_on_disk: list[str]
    temp_files: list[str]
    view: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # Shards (as the manifest names them) computed from input files whose stamp changed since: the next
    # run reads their samples again and computes those whose samples differ (``pipeline.folder.stale_names``).
    stale: list[str] = field(default_factory=list)
    # Input files the result was computed from that are gone: the next run takes their samples out.
    gone: list[str] = field(default_factory=list)
    # What an --overwrite stopped before its result was complete left beside this result (pipeline.overwrite).
    unfinished_overwrite: str | None = None

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "complete": self.ok,
            "problems": self.problems,
            "stale": self.stale,
            "gone": self.gone,
            "unfinished_overwrite": self.unfinished_overwrite,
            "view": self.view,
            "shards_on_disk": self.shards_on_disk,
            "temp_files": self.temp_files,
            "manifest": self.manifest,
        }


def _check_view(root: str, report: Report) -> None:
    path = storage.join(root, VIEW)
    if not storage.exists(path):
        report.problems.append(f"{VIEW} is missing (a run that did not finish removes it before it replaces a shard "
                               "by one holding other samples; the same command writes it again)")
        return
    import h5py

    with storage.open_h5(path) as view:  # only its layout is read: remote sources need not resolve
        for name, dataset in view_datasets(view).items():
            text = h5py.check_string_dtype(dataset.dtype) is not None  # source_files: "str", not numpy's "object"
            report.view[name] = {"shape": list(dataset.shape), "dtype": "str" if text else dataset.dtype.name}
        report.problems.extend(missing_sources(root, view))


_LOOKED_INTO = 100  # entries of a folder that is no output folder looked into for output folders (not a data folder's)


def output_folder(folder: str) -> tuple[str, list[str]]:
    """``(root, its names)`` of an output folder, finished or not; a FileNotFoundError where there is no
    folder, or a folder no run has written to (``make demo``'s ``jacobeam-demo``, say, which holds the output
    folder ``out``), naming the output folders inside it: "the run did not finish" would send a user to
    rerun a command that did."""
    root = storage.normalize(folder)
    if not storage.is_folder(root):
        raise FileNotFoundError(f"{folder}: no such output folder")
    top = storage.listdir(root)
    ran = {MANIFEST, LEASE, ENGINE_PLAN, INPUTS_TABLE} & set(top) or any(map(is_folder_temp, top))
    if not ran and not storage.is_folder(storage.join(root, SHARDS_DIR)):  # listdir names no folder of an object store
        inside = [] if len(top) > _LOOKED_INTO else [
            name for name in top  # sorted by listdir
            if storage.is_folder(storage.join(root, name)) and MANIFEST in storage.listdir(storage.join(root, name))]
        hint = f"; the output folders in it: {', '.join(inside)}" if inside else ""
        raise FileNotFoundError(f"{folder}: not a jacobeam output folder (no {MANIFEST} or {SHARDS_DIR}/){hint}")
    return root, top


def inspect(folder: str) -> Report:
    root, top = output_folder(folder)
    names = storage.listdir(storage.join(root, SHARDS_DIR))
    manifest = json.loads(storage.read_text(storage.join(root, MANIFEST))) if MANIFEST in top else None
    report = Report(
        folder=root,
        manifest=manifest,
        shards_on_disk=[name for name in names if is_shard_file(name)],
        temp_files=[name for name in names if is_shard_temp(name)] + [name for name in top if is_folder_temp(name)],
    )
    if manifest is None:
        if pending(root) is not None:  # pipeline.overwrite: a run stopped while it moved its result in
            report.problems.append(f"no {MANIFEST}: an --overwrite committed its result in {OVERWRITE_DIR} and was "
                                   "stopped while moving it in; the next run of the folder finishes that")
            return report
        report.problems.append(
            f"no {MANIFEST}: the run did not finish ({len(report.shards_on_disk)} complete shard(s), "
            f"{len(report.temp_files)} temporary file(s)); run the same command again to complete it"
        )
        return report
    report.unfinished_overwrite = unfinished(root)
    for shard in manifest["shards"]:
        if not storage.exists(storage.join(root, shard["file"])):
            report.problems.append(f"{shard['file']} is listed in the manifest but missing")
    if "rejected" in manifest and REJECTED_FILE not in top:
        report.problems.append(f"{REJECTED_FILE} is missing")
    if "input_files" in manifest and manifest["input_files"]["file"] not in top:
        report.problems.append(f"{manifest['input_files']['file']} is missing")
        return report
    _check_view(root, report)
    try:
        state = read_folder(root)  # the manifest with its input files (inputs.h5), the shards' attributes
        report.problems.extend(_rows_changed(state))
        report.stale, report.gone = _stale(state)
    except OutputError as err:  # its input files' table cannot be read
        report.problems.append(str(err))
    return report


def _rows_changed(folder: Folder) -> list[str]:
    """Shards holding another number of rows than the manifest (and the view) says: replaced by a run that
    did not finish (a file's samples removed, other samples rejected), the view reads them wrongly (rows past
    a shorter shard's end cannot be read at all) until a run completes the folder."""
    problems = []
    for entry in folder.manifest["shards"]:
        attrs = folder.shards.get(storage.name_of(entry["file"]), {})
        if "num_rows" in attrs and int(attrs["num_rows"]) != entry["num_samples"]:
            problems.append(f"{entry['file']} holds {int(attrs['num_rows'])} row(s) where the manifest and {VIEW} "
                            f"have {entry['num_samples']}: a run that did not finish replaced it; run the same "
                            "command again to complete the folder")
    return problems


def _stale(folder: Folder) -> tuple[list[str], list[str]]:
    """The shards on disk computed from input files whose stamp changed since, and the input files gone
    since (their shards are not judged): their results may no longer be those of their inputs. Reads the
    inputs' listing and the shards' attributes only."""
    from jacobeam.pipeline.discover import stamps
    from jacobeam.transforms.inputs.readers import from_a_pipeline

    if folder.manifest is None or from_a_pipeline(folder.manifest):
        return [], []
    paths = sorted({storage.absolute(entry["path"]) for entry in folder.manifest["inputs"]
                    if not entry.get("unreadable") and not entry.get("removed")})
    found = stamps(paths)
    return [f"{SHARDS_DIR}/{name}" for name in stale_names(folder, found)], [path for path in paths if path not in found]


def _inputs(shape: list[int] | dict[str, list[int]]) -> str:
    """``input (8, 8, 1)``, or ``inputs image (4, 4, 1), meta (3,)`` for a model with several inputs."""
    if isinstance(shape, dict):
        return "inputs " + ", ".join(f"{name} {tuple(dims)}" for name, dims in shape.items())
    return f"input {tuple(shape)}"


def _input_files(manifest: dict[str, Any]) -> str:
    from jacobeam.transforms.inputs.readers import from_a_pipeline

    if from_a_pipeline(manifest):
        return "none on disk: a pipeline of your own wrote this folder (WriteShards)"
    listed = manifest["input_files"]["count"] if "input_files" in manifest else len(manifest["inputs"])
    return f"{listed} file(s)"


def _model_source(model: dict[str, str | None]) -> str:
    return ", ".join(f"{key} {value}" for key, value in model.items() if value is not None)


def _engine(engine: dict | None) -> str:
    if not engine:
        return "(not recorded: every shard was kept from an earlier attempt)"
    xla = " + XLA" if engine["jit_compile"] else ""
    # Both absent in older manifests.
    by = " by double reverse" if engine.get("double_reverse") else " by layer rules" if engine.get("layer_rules") else ""
    return (
        f"{engine['mode']}{by}{xla}, batch {engine['batch_size']}, {engine['compute_dtype']} -> "
        f"{engine['store_dtype']} ({'; '.join(engine['reasons'])})"
    )


def _stored_shape(shape: list[int | str], rows: int) -> tuple[int, ...]:
    """A manifest ``datasets`` shape (``["n", 3, 8]``) with its ``n`` replaced by ``rows``."""
    return tuple(rows if dim == "n" else int(dim) for dim in shape)


def _selection(stored: dict[str, Any]) -> str:
    rule = stored.get("outputs", "all")
    if rule == "indices":
        return f"indices {stored.get('indices')}"
    if rule == "top_k":
        return f"top_k {stored.get('top_k')}"
    return str(rule)


def _result(manifest: dict[str, Any]) -> str | None:
    """What the folder keeps of each sample's Jacobian: its datasets, shapes, and the reduction in words."""
    datasets = manifest.get("datasets") or {}
    names = result_datasets(datasets)
    if not names:
        return None
    rows = manifest.get("num_rows", manifest["num_samples"])
    shown = ", ".join(f"{name} {_stored_shape(datasets[name]['shape'], rows)} {datasets[name]['dtype']}" for name in names)
    stored = manifest.get("stored") or {}
    kind = stored.get("reduce", "none")
    selected = "" if stored.get("outputs", "all") == "all" else f"; outputs {_selection(stored)}, listed in output_index"
    projection = stored.get("projection")
    if kind == "project" and projection:  # what rebuilds P (docs/what-to-store.md)
        selected += (f"; P {projection['dim']:,} columns, {projection['kind']}, seed {projection['seed']}, "
                     f"{projection.get('structure', 'dense')}")
    side = stored.get("parameters")
    if side is not None:  # wrt: parameters
        objective = side["objective"] if side["objective"] != "loss" else f"loss {side['loss']}"
        size = f"{side['size']:,} weight entries; " if "size" in side else ""  # a no-op rerun's dropped it
        return (f"{shown}: {PARAMETER_DESCRIPTIONS.get(kind, kind)} (wrt: parameters, {size}"
                f"objective: {objective}; reduce: {kind}{selected}){_classes(manifest.get('labels'))}")
    return f"{shown}: {DESCRIPTIONS.get(kind, kind)} (reduce: {kind}{selected}){_classes(manifest.get('labels'))}"


_CLASSES_SHOWN = 8


def _classes(labels: dict[str, Any] | None) -> str:
    """The classes of labels per file (``jacobian.labels`` folders or table) by index, the first few."""
    names = (labels or {}).get("class_names")
    if not names:
        return ""
    shown = ", ".join(f"{i} {name}" for i, name in enumerate(names[:_CLASSES_SHOWN]))
    more = f", ... ({len(names)} classes)" if len(names) > _CLASSES_SHOWN else ""
    return f"; labels from {labels['source']}: {shown}{more}"



def _precision(manifest: dict[str, Any]) -> str | None:
    """How accurate the stored values are, as the self-check measured it (``self_check_report.precision_line``)."""
    jacobian = manifest.get("config", {}).get("jacobian") or {}
    return precision_line(manifest.get("self_check") or {}, jacobian.get("compute_dtype", "float32"),
                          jacobian.get("store_dtype", "float32"))


def _versions(manifest: dict[str, Any]) -> str | None:
    """The libraries that computed the last run (``transforms.model_identity.library_versions``) and its
    TensorFlow threads per worker."""
    versions = manifest.get("versions")
    if not versions:
        return None
    named = ", ".join(f"{name} {versions[name]}" for name in (*COMPARED_LIBRARIES, "python") if versions.get(name))
    threads = manifest.get("tf_threads")
    return named + ("" if "tf_threads" not in manifest else f"; {threads or 'default'} TensorFlow threads per worker")


def format_report(report: Report) -> str:
    lines = [f"{report.folder}: {'complete' if report.ok else 'NOT COMPLETE'}"]
    manifest = report.manifest
    if manifest is not None:
        run = manifest["run"]
        lines += [
            f"  samples     {manifest['num_samples']:,} ({manifest.get('num_rows', manifest['num_samples']):,} stored), "
            f"{_inputs(manifest['input_shape'])} "
            f"-> output {tuple(manifest['output_shape'])}, {manifest['dtype']}",
            f"  model       {_model_source(manifest['config']['model'])}, "
            f"weights sha256 {manifest['model_fingerprint'][:16]}…",
            *([f"  versions    {versions}"] if (versions := _versions(manifest)) else []),
            f"  inputs      {_input_files(manifest)}",
            f"  engine      {_engine(manifest.get('engine'))}",
            *([f"  result      {result}"] if (result := _result(manifest)) else []),
            f"  shards      {len(manifest['shards'])} in manifest, {len(report.shards_on_disk)} on disk",
            *(
                [f"  stale       {len(report.stale)} shard(s) computed from input files changed since (another "
                 f"stamp): {', '.join(report.stale)}; the next run reads their samples again and computes those "
                 "whose samples differ"]
                if report.stale
                else []
            ),
            *(
                [f"  gone        {len(report.gone)} input file(s) deleted since: {', '.join(report.gone[:3])}"
                 f"{', ...' if len(report.gone) > 3 else ''}; the next run takes their samples out"]
                if report.gone
                else []
            ),
            *([f"  overwrite   {report.unfinished_overwrite}"] if report.unfinished_overwrite else []),
            *(
                [
                    f"  rejected    {manifest['rejected']['count']:,} sample(s), "
                    f"{len(manifest['rejected']['unreadable_files'])} unreadable file(s): see {REJECTED_FILE}"
                ]
                if manifest.get("rejected", {}).get("count") or manifest.get("rejected", {}).get("unreadable_files")
                else []
            ),
            *(
                [f"  removed     {manifest['removed']['count']:,} sample(s) of {manifest['removed']['files']:,} input "
                 "file(s) deleted since they were computed: no rows, their ids stay taken"]
                if (manifest.get("removed") or {}).get("count")
                else []
            ),
            *(
                [f"  nonfinite   {manifest['nonfinite']['count']:,} sample(s) with NaN/Inf results"]
                if manifest.get("nonfinite", {}).get("count")
                else []
            ),
            *([f"  self-check  {checks_line(manifest['self_check'])}"] if "self_check" in manifest else []),
            *([f"  precision   {precision}"] if (precision := _precision(manifest)) else []),
            *(
                [
                    f"  verified    {'ok' if manifest['verify']['ok'] else 'FAILED'} at {manifest['verify']['checked_at']}"
                ]
                if "verify" in manifest
                else []
            ),
            f"  last run    {run['wall_seconds']:.1f} s, {run['samples_computed']:,} computed, "
            f"{run['samples_kept']:,} kept, {run['samples_per_second'] or 0:,.0f} samples/s",
            f"  written     {manifest['created_at']} by jacobeam {manifest['jacobeam_version']}",
        ]
    width = max([10, *(len(name) for name in report.view)])
    for name, info in report.view.items():
        lines.append(f"  {VIEW}:{name:<{width}} shape {tuple(info['shape'])} {info['dtype']}")
    lines += [f"  problem: {problem}" for problem in report.problems]
    return "\n".join(lines)
