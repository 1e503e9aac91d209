"""What every input format shares: sample keys and shapes, a file's description, how rows are read.

This module imports nothing of jacobeam, so that the format modules (``arrays``, ``tfrecords``,
``images``) and the format-independent ``readers`` can all take their types from it without importing
each other. A format module provides the ``Format`` functions; ``transforms.inputs.registry`` maps
file names to formats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

# input.key: one array (None: the file's only one), or {input name: array key} for several inputs.
Key = str | Mapping[str, str] | None
# One sample's shape, or {input name: shape}; rows of samples: one array, or {input name: array}.
Shape = tuple[int, ...] | Mapping[str, tuple[int, ...]]
Samples = np.ndarray | Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """How an image file becomes a sample (``input.image``): decoded to 8-bit values ``(H, W, C)``,
    resized (bilinear) to ``size`` if given, converted to ``channels`` if given, then ``x * scale`` and
    ``(x - mean) / std`` (numbers, or one per channel)."""

    size: tuple[int, int] | None = None
    channels: int | None = None
    scale: float = 1 / 255
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def from_config(cls, image: Mapping[str, Any] | None) -> ImageOptions:
        """From ``input.image`` as plain data (the config, or a manifest's copy of it)."""
        image = dict(image or {})

        def numbers(value: Any) -> tuple[float, ...] | None:
            return None if value is None else tuple(float(v) for v in (value if isinstance(value, list) else [value]))

        size = image.get("size")
        return cls(
            size=None if size is None else (int(size[0]), int(size[1])),
            channels=image.get("channels"),
            scale=float(image.get("scale", 1 / 255)),
            mean=numbers(image.get("mean")),
            std=numbers(image.get("std")),
        )


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One input file and the sample ids it covers: ``[first_id, first_id + num_samples)``, rows
    ``first_row ..`` of the file (``row``).

    When ``key`` is a mapping (a model with several inputs), ``sample_shape`` and ``dtype`` are
    mappings by input name too. A file that grew by appended rows since an output folder was computed
    is placed in pieces (``pipeline.ids.place_files``): one ``SourceFile`` for its old rows, which keep
    their ids, one for the rows appended (``first_row`` their first row), whose ids follow every old id.
    """

    path: str
    key: Key
    num_samples: int
    sample_shape: Shape
    dtype: str | Mapping[str, str]
    first_id: int = 0
    # The sha256 of the file's samples, as the launcher's scan computed it before planning read headers
    # only: in an older folder's manifest and shards; None now (each shard stores its samples' digest).
    data_sha256: str | None = None
    # What the file system tells of the file without reading it ("size:modified"): the file's identity. A
    # later run that finds the same trusts the shards computed from it, as make and rsync do; another
    # stamp makes them stale: their samples are read again, and computed again where they differ.
    stamp: str | None = None
    unreadable: str | None = None  # why a file that cannot be opened holds no samples (on_bad_sample: skip)
    image: ImageOptions | None = None  # for an image file: how it is decoded
    first_row: int = 0  # the file's row of id ``first_id`` (0 but for the rows appended to a file: see above)
    # The file is gone since the folder was computed: its ids are kept, but they are neither rows nor
    # rejected samples (``JobSpec.removed``; ``pipeline.ids.place_files``).
    removed: bool = False
    # The label of every sample of the file (``jacobian.labels`` folders or table: its class subfolder, its
    # row of the table), set at planning; None where labels are an array of the file or not used.
    label: int | None = None

    @property
    def stop_id(self) -> int:
        return self.first_id + self.num_samples

    def replaced(self, **changes: Any) -> SourceFile:
        """``dataclasses.replace(self, **changes)`` without its generic ``__init__`` call: planning copies
        each file twice (its stamp, its ids), 7 us a copy, seconds at a million files."""
        unknown = changes.keys() - _SOURCE_FIELDS
        if unknown:
            raise TypeError(f"SourceFile has no field {sorted(unknown)[0]!r}")
        copy = object.__new__(SourceFile)
        copy.__dict__.update(self.__dict__, **changes)  # frozen: its __setattr__ refuses, its __dict__ does not
        return copy

    def row(self, sample_id: int) -> int:
        """The file's row that holds sample ``sample_id`` (one of ``[first_id, stop_id)``)."""
        return sample_id - self.first_id + self.first_row


_SOURCE_FIELDS = frozenset(field.name for field in dataclasses.fields(SourceFile))


class SampleReader(Protocol):
    """A file's samples, open for reading in slices."""

    def read(self, start: int, stop: int) -> Samples:
        """Rows ``[start, stop)``: ``(rows, *sample_shape)``, or ``{input name: (rows, *shape)}``."""


class Format(Protocol):
    """What a format module provides (``arrays``, ``tfrecords``, ``images``), with these signatures."""

    SUFFIXES: Mapping[str, str]  # file name suffix (lower case) -> format name

    def describe(self, path: str, key: Key, sample_shape: Shape | None, image: ImageOptions | None) -> SourceFile:
        """Read what a file holds without reading its samples where the format allows: how many samples,
        their shape(s) and dtype(s). Raises ``InputError`` (unusable as configured) or
        ``CorruptInputError`` (damaged)."""

    def open_samples(self, source: SourceFile) -> AbstractContextManager[SampleReader]:
        """Open a described file's samples for reading in slices."""
