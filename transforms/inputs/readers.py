"""Reading input samples in slices, whatever the file format; sample ids.

A file's format follows from its name (``transforms.inputs.registry``), and each format has its module:
``transforms.inputs.arrays`` (``.npy``, ``.npz``, ``.h5``/``.hdf5``: samples along an array's first axis),
``transforms.inputs.tfrecords`` (TFRecord files: one ``tf.train.Example`` per sample) and
``transforms.inputs.images`` (PNG/JPEG: one sample per file), all with the signatures of
``types.Format``. This module dispatches to them and holds what does not depend on the format:
``describe``, ``open_samples``, the consistency checks, ``iter_slices`` and helpers for samples. Sample ids are
positions in the concatenation of the input files (see ``pipeline.ids`` for how files are placed:
sorted path order, new files of an incremental run after the old ones).

A model with several inputs reads one array per input from each file: ``input.key`` is then a mapping
``{input name: array key}``, and samples are dicts ``{input name: rows}`` (``Samples``). The arrays of
one file hold one row per sample each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs import arrays, images
from jacobeam.transforms.inputs.registry import file_format, format_of
from jacobeam.transforms.inputs.types import ImageOptions, Key, SampleReader, Samples, Shape, SourceFile
from jacobeam.transforms.output.layout import PIPELINE_INPUT


def open_rows(path: str, key: str | None, setting: str = "input.key") -> contextlib.AbstractContextManager[arrays.Rows]:
    """Open one array of a file (``key``, named by the config's ``setting``), for reading rows in slices."""
    fmt = file_format(path)
    if format_of(path) is not arrays:
        raise InputError(f"{path}: {setting} names arrays of .npy, .npz and .h5 files; this is a {fmt} file")
    return arrays.open_rows(path, key, setting)


def open_samples(source: SourceFile) -> contextlib.AbstractContextManager[SampleReader]:
    """Open a file's samples for reading in slices: ``read(start, stop)`` returns ``(rows, *shape)``,
    or ``{input name: (rows, *shape)}`` when ``source.key`` maps inputs to arrays."""
    return format_of(source.path).open_samples(source)


def describe(path: str, key: Key, sample_shape: Shape | None = None, image: ImageOptions | None = None) -> SourceFile:
    """Read what a file holds from its headers: how many samples, their shape(s) and dtype(s). A TFRecord
    file's records are counted from their boundaries (a ``.gz`` one is read through); its
    ``sample_shape`` comes from the config. An image's shape comes from its header or ``input.image``."""
    return format_of(path).describe(path, key, sample_shape, image)


def unreadable_file(path: str, key: Key, reason: str) -> SourceFile:
    """A file that cannot be opened at all: it holds no samples, hence no ids (``on_bad_sample: skip``)."""
    return SourceFile(path=path, key=key, num_samples=0, sample_shape=(), dtype="", unreadable=reason)


def check_labels(source: SourceFile, label_key: str) -> np.dtype:
    """The file holds one label per sample under ``label_key``, numbers; returns their dtype (their values
    are checked by the worker that reads them, ``transforms.inputs.checks``)."""
    fmt = file_format(source.path)
    if fmt not in ("npz", "h5"):
        # Whatever the key, a .npy file would give its samples for labels.
        holds = "a .npy file holds one array, its samples" if fmt == "npy" else f"labels are not read from {fmt} files"
        per_file = "" if fmt == "npy" else (
            ", or give each file one label: jacobian.labels {folders: true} (its class subfolder) or "
            "{table: <.csv or .json of file to label>}")
        raise InputError(
            f"{source.path}: jacobian.labels.key {label_key!r}: {holds}; labels need a named array beside the "
            f"samples, in .npz or .h5 files{per_file}"
        )
    with open_rows(source.path, label_key, "jacobian.labels.key") as labels:
        shape, dtype = tuple(int(d) for d in labels.shape), np.dtype(labels.dtype)
    if shape not in ((source.num_samples,), (source.num_samples, 1)):
        raise InputError(
            f"{source.path}: labels {label_key!r} of shape {shape}; expected ({source.num_samples},), "
            "one output index per sample"
        )
    if dtype.kind not in "iuf":
        raise InputError(f"{source.path}: labels {label_key!r} are {dtype}; expected integer output indices")
    return dtype


def check_consistent(files: Sequence[SourceFile], expected: Shape | None = None) -> None:
    """All readable files must hold samples of one shape (per input): ``expected`` (``input.sample_shape``)
    if given, else the shape of the first of them (in sorted order)."""
    readable = [f for f in files if f.unreadable is None]
    if not readable:
        return
    where = "input.sample_shape"
    if expected is None:
        expected, where = readable[0].sample_shape, None
    for other in readable:
        if not isinstance(expected, Mapping):
            if other.sample_shape != expected:
                raise InputError(
                    f"{other.path}: samples of shape {other.sample_shape}; expected {expected} "
                    f"({where or f'the sample shape of {readable[0].path}'})"
                )
            continue
        for name, shape in expected.items():
            if other.sample_shape[name] != shape:
                raise InputError(
                    f"{other.path}: input {name} ({other.key[name]!r}) has samples of shape "
                    f"{other.sample_shape[name]}; expected {shape} ({where or f'input {name} in {readable[0].path}'})"
                )


def assign_ids(files: Sequence[SourceFile]) -> list[SourceFile]:
    """Give each file its id range in the concatenation, in sorted path order."""
    placed, next_id = [], 0
    for source in sorted(files, key=lambda f: f.path):
        placed.append(source if source.first_id == next_id else source.replaced(first_id=next_id))
        next_id += source.num_samples
    return placed


def iter_slices(
    files: Sequence[SourceFile], start: int, stop: int, max_rows: int, label_key: str | None = None
) -> Iterator[tuple[np.ndarray, Samples, np.ndarray | None]]:
    """Yield ``(sample_ids, samples, labels)`` covering ids ``[start, stop)`` in order, in slices of
    at most ``max_rows`` rows, each from one file. ``samples`` has shape ``(rows, *sample_shape)`` and
    the file's own dtype (a dict of such arrays by input name for several inputs); ``labels``
    ``(rows,)`` come from the array ``label_key`` of the same file (None without one). Slices end at
    file boundaries, so batching across files is the caller's job, except that consecutive image
    files (one sample each) are read together, up to ``max_rows`` per slice.
    """
    pending: list[SourceFile] = []  # consecutive images not yet read

    def read_images() -> Iterator[tuple[np.ndarray, np.ndarray, None]]:
        if pending:
            batch = pending.copy()
            pending.clear()
            yield np.array([image.first_id for image in batch], np.int64), images.read_images(batch), None

    for source in files:
        lo, hi = max(start, source.first_id), min(stop, source.stop_id)
        if lo >= hi:
            continue
        if source.image is not None:
            pending.append(source)
            if len(pending) == max_rows:
                yield from read_images()
            continue
        yield from read_images()
        with contextlib.ExitStack() as stack:
            rows = stack.enter_context(open_samples(source))
            labels = stack.enter_context(open_rows(source.path, label_key, "jacobian.labels.key")) if label_key else None
            for first in range(lo, hi, max_rows):
                last = min(first + max_rows, hi)
                local = slice(source.row(first), source.row(last))
                yield (
                    np.arange(first, last, dtype=np.int64),
                    rows.read(local.start, local.stop),
                    labels.read(local.start, local.stop).reshape(-1) if labels else None,
                )
    yield from read_images()


# --- samples of one or several inputs, as one shape -------------------------------------------------------


def parts(samples: Samples) -> list[tuple[str | None, np.ndarray]]:
    """The arrays of ``samples`` by input name, sorted; ``[(None, samples)]`` for one input."""
    return sorted(samples.items()) if isinstance(samples, Mapping) else [(None, samples)]


def as_dtype(samples: Samples, dtype: str) -> Samples:
    if isinstance(samples, Mapping):
        return {name: values.astype(dtype, copy=False) for name, values in samples.items()}
    return samples.astype(dtype, copy=False)


def row_bytes(source: SourceFile) -> int:
    """Bytes of one sample, all its arrays together."""
    shapes = source.sample_shape if isinstance(source.sample_shape, Mapping) else {None: source.sample_shape}
    dtypes = source.dtype if isinstance(source.dtype, Mapping) else {None: source.dtype}
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtypes[name]).itemsize for name, shape in shapes.items())


def shape_record(shape: Shape) -> list[int] | dict[str, list[int]]:
    """A sample shape as plain JSON data: a list, or ``{input name: list}``."""
    if isinstance(shape, Mapping):
        return {name: [int(d) for d in dims] for name, dims in shape.items()}
    return [int(d) for d in shape]


def shape_from_record(record: list[int] | dict[str, list[int]]) -> Shape:
    if isinstance(record, Mapping):
        return {name: tuple(dims) for name, dims in record.items()}
    return tuple(record)


def from_a_pipeline(manifest: Mapping[str, Any]) -> bool:
    """Whether a user's own pipeline wrote the folder (``WriteShards(pipeline_spec(...))``): its manifest
    lists no input file to read the samples from again."""
    # A manifest that lists no files (they are in inputs.h5) says so in its config, as every such one does.
    return bool(manifest["config"].get("pipeline")) or next(iter(manifest.get("inputs", ())), {}).get("path") == PIPELINE_INPUT


def manifest_sources(manifest: Mapping[str, Any]) -> list[SourceFile]:
    """The input files a manifest lists, as ``SourceFile``s to read samples from again (none for a folder
    of a user's own pipeline: ``from_a_pipeline``), but those removed since they were computed."""
    if from_a_pipeline(manifest):
        return []
    shape = shape_from_record(manifest["input_shape"])
    image = ImageOptions.from_config(manifest["config"].get("input", {}).get("image"))
    return [
        SourceFile(
            path=entry["path"],
            key=entry.get("key"),
            num_samples=entry["num_samples"],
            sample_shape=shape,
            dtype=entry["dtype"],
            first_id=entry["first_id"],
            first_row=entry.get("first_row", 0),
            data_sha256=entry.get("data_sha256"),
            unreadable=entry.get("unreadable"),
            image=image if file_format(entry["path"]) == "image" else None,
            label=entry.get("label"),
        )
        for entry in manifest["inputs"]
        if not entry.get("removed")  # a file gone since (``SourceFile.removed``): no samples to read
    ]
