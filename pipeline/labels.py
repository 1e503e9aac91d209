"""Each input file's label, at planning: ``jacobian.labels`` ``folders`` (the class subfolder that holds the
file) or ``table`` (a CSV or JSON table of file to label), for ``jacobian.outputs: label``.

A file gets one label, for each of its samples (an image has one): ``SourceFile.label``. The workers
hand it on with the samples and check it as they check labels read from an array (an index outside the
model's outputs is a bad sample), the shards record their files' labels (``input_labels``) and the
manifest's table of input files each file's; ``relabelled_shards`` finds the shards computed with other
labels than now (the table edited; a file moved to another class folder is a file gone and a new one),
which are read and computed again. Class subfolders follow Keras's ``image_dataset_from_directory(labels="inferred")``:
the classes are the sorted names of the subfolders of the folder given (``class_names`` fixes them).
The manifest records them under ``labels``, and a later run of the folder keeps them: new class folders
may follow them, but not sort among them (that would renumber the classes computed).

No TensorFlow, no reading of samples: listings and the table only.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jacobeam.pipeline.config import Config
from jacobeam.pipeline.discover import glob_root
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import INPUT_LABELS, SAMPLES_SHA256
from jacobeam.transforms.output.shards import attr_text


def file_labels(
    config: Config, files: Sequence[SourceFile], previous: Mapping[str, Any] | None
) -> tuple[list[SourceFile], dict[str, Any] | None, list[str]]:
    """``files`` with their labels (``SourceFile.label``) under ``outputs: label`` with ``jacobian.labels``
    folders or table; the manifest's ``labels`` (how they were given, and the class names by index);
    and how the classes differ from those of the folder's ``previous`` manifest (a new class folder that
    would renumber them), which make the folder another run's. Files and None otherwise. Raises
    ``InputError`` naming a file without a label, or the table's row that is wrong."""
    labels = config.jacobian.labels
    if not config.jacobian.needs_labels or labels is None or not labels.per_file:
        return list(files), None, []
    recorded = ((previous or {}).get("labels") or {}).get("class_names")
    if labels.folders:
        by_path, class_names, differences = _folder_labels(config.input.paths, files, labels.class_names, recorded)
        section = {"source": "folders", "class_names": class_names}
    else:
        table = storage.absolute(labels.table)
        by_path, differences = _table_labels(table, files, labels.class_names), []
        section = {"source": "table", "table": table, "class_names": labels.class_names}
    return [dataclasses.replace(f, label=by_path.get(f.path)) for f in files], section, differences


# --- class subfolders ------------------------------------------------------------------------------------


def _folder_labels(
    patterns: Sequence[str], files: Sequence[SourceFile], fixed: list[str] | None, recorded: list[str] | None
) -> tuple[dict[str, int], list[str], list[str]]:
    roots = sorted({glob_root(p) for p in patterns}, key=len, reverse=True)  # the deepest root that holds a file
    classes: dict[str, str] = {}  # path -> class name
    for source in files:
        root = next((r for r in roots if source.path.startswith(r + "/")), None)
        inside = source.path[len(root) + 1:] if root is not None else ""
        if "/" not in inside:
            raise InputError(
                f"{source.path}: not in a class subfolder of {root or ' or '.join(roots)} (jacobian.labels.folders: "
                "each file's label is the subfolder that holds it); move it into one, or out of the input folder"
            )
        name = inside.split("/", 1)[0]
        if name.startswith("."):  # a glob's * matches hidden folders; a folder given as it is leaves them out
            raise InputError(
                f"{source.path}: in the hidden folder {name!r} of {root}, which is no class (jacobian.labels.folders: "
                "hidden folders are not classes, as in Keras); give input.paths the folder itself (hidden files "
                "are left out), or narrow the glob"
            )
        classes[source.path] = name
    differences: list[str] = []
    if fixed is not None:
        names = list(fixed)
        unknown = sorted(set(classes.values()) - set(names))
        if unknown:
            example = next(path for path, name in classes.items() if name == unknown[0])
            raise InputError(f"{example}: its class folder {unknown[0]!r} is not among jacobian.labels.class_names {names}")
    else:
        found = set(classes.values())
        for root in roots:  # as Keras lists classes: every subfolder of a local folder, images or not, hidden ones aside
            if storage.is_local(root) and os.path.isdir(root):
                found.update(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
        names = sorted(found)
        if recorded:
            new = sorted(found - set(recorded))
            among = [name for name in new if name < max(recorded)]
            if among:
                differences.append(
                    f"jacobian.labels.folders: new class folder(s) {among} sort among the classes recorded {recorded}: "
                    "the sorted names would renumber the classes computed (a model retrained on more classes is "
                    "another run; jacobian.labels.class_names fixes the classes whatever folders come)"
                )
            else:  # the recorded classes keep their indices, a class folder gone too; new ones follow
                names = [*recorded, *new]
    index = {name: i for i, name in enumerate(names)}
    return {path: index[name] for path, name in classes.items()}, names, differences


# --- a table of file to label ----------------------------------------------------------------------------


def _table_labels(table: str, files: Sequence[SourceFile], class_names: list[str] | None) -> dict[str, int]:
    """``{input path: label}`` from the table (``.csv`` with columns ``file`` and ``label``, or ``.json``
    ``{file: label}``); files named relative to the table's folder."""
    try:
        text = storage.read_text(table).removeprefix("\ufeff")  # a spreadsheet's CSV may begin with a BOM
    except Exception as err:  # noqa: BLE001 - whatever the file system raises for a file it cannot read
        raise InputError(f"jacobian.labels.table {table}: cannot be read: {err}") from err
    if table.lower().endswith(".json"):
        try:
            mapping = json.loads(text)
        except ValueError as err:
            raise InputError(f"{table}: not JSON: {err}") from err
        if not isinstance(mapping, dict):
            raise InputError(f"{table}: a JSON table of labels is an object {{file: label}}; this is a {type(mapping).__name__}")
        rows = [(f"entry {name!r}", name, value) for name, value in mapping.items()]
    elif table.lower().endswith(".csv"):
        reader = csv.DictReader(io.StringIO(text))
        if not {"file", "label"} <= set(reader.fieldnames or []):
            raise InputError(f"{table}: a CSV table of labels needs a header row naming the columns file and label; "
                             f"its header is {reader.fieldnames}")
        rows = [(f"line {reader.line_num}", row["file"], row["label"]) for row in reader]
    else:
        raise InputError(f"jacobian.labels.table {table}: a table of labels is a .csv or .json file")
    folder = table.rsplit("/", 1)[0]
    index = {name: i for i, name in enumerate(class_names or [])}
    labels: dict[str, int] = {}
    for where, name, value in rows:
        path = _normal(name if os.path.isabs(name) or not storage.is_local(name) else storage.join(folder, name))
        label = _label(value, index if class_names is not None else None)
        if label is None:
            wanted = f"one of jacobian.labels.class_names {class_names}" if class_names is not None else (
                "an integer output index (or name the classes in jacobian.labels.class_names)")
            raise InputError(f"{table}: {where} ({name}): label {value!r} is not {wanted}")
        if labels.setdefault(path, label) != label:
            raise InputError(f"{table}: {where}: {name} is listed twice, with labels {labels[path]} and {label}")
    found: dict[str, int] = {}
    missing = []
    for source in files:
        label = labels.get(_normal(source.path))
        if label is None and storage.is_local(source.path):
            label = labels.get(os.path.realpath(source.path))
        if label is not None:
            found[source.path] = label
        elif source.unreadable is None:
            missing.append(source.path)
    if missing:
        more = f" (and {len(missing) - 1} more input files)" if len(missing) > 1 else ""
        raise InputError(f"{missing[0]}: has no row in jacobian.labels.table {table}{more}; every input file needs a label")
    return found


def _normal(path: str) -> str:
    return os.path.normpath(path) if storage.is_local(path) else path


def _label(value: Any, index: dict[str, int] | None) -> int | None:
    """A table's label as an output index: by name where ``index`` (the class names) is given, else an
    integer (a JSON number, or a CSV cell's text); None where it is not one."""
    if index is not None:
        return index.get(str(value).strip()) if isinstance(value, str) else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


# --- shards computed with other labels ---------------------------------------------------------------------


def relabelled_shards(folder, spec, as_now) -> list[str]:
    """The folder's shards (names) computed with other labels of their files than this run's
    (``SourceFile.label``; ``jacobian.labels`` folders or table), which a file's stamp does not tell: their
    samples are read again, and computed again where their labels differ (``transforms.job``). A shard is
    up to date when the labels it recorded (``input_labels``) are those of now, or when the folder's
    manifest lists it with the digest of its samples it holds and lists the labels of now for its files
    (a run that found its labels unchanged, as ``pipeline.folder.stale_names`` does for stamps). ``as_now``
    maps a recorded path to this run's name of the file (``pipeline.ids.path_mapper``)."""
    if not spec.labels:
        return []
    now = {f.path: f.label for f in spec.files}
    manifest = folder.manifest or {}
    listed: dict[str, int | None] | None = None  # the manifest's labels, read where needed
    vouched = {storage.name_of(entry["file"]): entry.get("samples_sha256") for entry in manifest.get("shards", [])}

    def current(labels: Mapping[str, Any]) -> bool:
        return all(path not in now or now[path] == label for path, label in labels.items())

    stale = []
    for name, attrs in folder.shards.items():
        if INPUT_LABELS not in attrs:
            stale.append(name)
            continue
        recorded = {as_now(path): label for path, label in json.loads(attr_text(attrs[INPUT_LABELS])).items()}
        if current(recorded):
            continue
        digest = attr_text(attrs[SAMPLES_SHA256]) if SAMPLES_SHA256 in attrs else None
        if digest is not None and vouched.get(name) == digest:
            if listed is None:
                listed = {as_now(entry["path"]): entry.get("label") for entry in manifest.get("inputs", [])}
            if current({path: listed.get(path) for path in recorded}):
                continue
        stale.append(name)
    return sorted(stale)
