"""Input discovery: the files the config's globs match, listed and described from their headers.

A folder named in ``input.paths`` stands for every PNG/JPEG image under it. Describing a file reads its
headers only (``.npy`` header, ``.npz`` member headers, HDF5 shapes, TFRecord record boundaries, image
headers, or nothing for an image whose shape ``input.image`` gives), so that planning costs in the
number of files, not their bytes. The samples themselves are read, checked and hashed by the workers
(``transforms.inputs.checks``). A file's identity is its stamp from the listing (size and time of the
last change; remotely what the file system's metadata gives): a resumed run trusts it, as make and
rsync do; the shards of a file whose stamp changed are stale, and their workers read their samples
again (``transforms.job``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os

from jacobeam.transforms.errors import CorruptInputError, InputError
from jacobeam.transforms.inputs.readers import assign_ids, check_consistent, describe, unreadable_file
from jacobeam.transforms.inputs.registry import IMAGE_SUFFIXES
from jacobeam.transforms.inputs.types import ImageOptions, Key, Shape, SourceFile
from jacobeam.transforms.output import storage

log = logging.getLogger(__name__)


def _match(patterns: list[str]) -> dict[str, str]:
    """Every file the globs match, each once, sorted, with its stamp (``SourceFile.stamp``: size and time
    of the last change, from the listing). A folder (a pattern without wildcards naming one, or ending in
    ``/``) stands for every PNG/JPEG image under it, at any depth."""
    from apache_beam.io.filesystems import FileSystems

    paths: dict[str, str] = {}
    for given in patterns:
        # Absolute: Beam matches a glob without a folder part ("*.npy") against nothing, and workers
        # need not share the launcher's working directory.
        pattern = storage.absolute(given)
        folder = not any(c in pattern for c in "*?[") and (pattern.endswith("/") or storage.is_folder(pattern))
        (match,) = FileSystems.match([storage.join(pattern, "**") if folder else pattern])
        found = {m.path: _stamp(m) for m in match.metadata_list if not folder or m.path.lower().endswith(IMAGE_SUFFIXES)}
        if not found:
            what = "holds no PNG or JPEG images" if folder else "matches no files"
            where = "" if pattern == given else f" (looked for {pattern})"
            raise InputError(f"input.paths: {given!r} {what}{where}")
        paths.update(found)
    return dict(sorted(paths.items()))


def _stamp(metadata) -> str:
    """A file's stamp (``SourceFile.stamp``) from Beam's ``FileMetadata`` of it."""
    return f"{metadata.size_in_bytes}:{metadata.last_updated_in_seconds!r}"


def stamps(paths: list[str]) -> dict[str, str]:
    """The stamps of the files at ``paths`` (as ``SourceFile.stamp``), by path; a file not there is left
    out. Reads the listing only."""
    from apache_beam.io.filesystem import BeamIOError
    from apache_beam.io.filesystems import FileSystems

    found: dict[str, str] = {}
    for path in paths:
        try:
            (match,) = FileSystems.match([path])
        except BeamIOError:
            continue
        found.update({m.path: _stamp(m) for m in match.metadata_list if m.path == path})
    return found


def resolve_inputs(
    patterns: list[str], key: Key, on_bad_sample: str = "error", sample_shape: Shape | None = None,
    image: ImageOptions | None = None,
) -> list[SourceFile]:
    """Every file the globs match (each file once), described, in sorted path order with ids in that
    order. Under ``skip`` a file that cannot be opened is kept as an unreadable file without samples.
    Files are described a few at a time (headers only: remote reads are round trips)."""

    def described(path: str) -> SourceFile:
        try:
            return dataclasses.replace(describe(path, key, sample_shape, image), stamp=stamps[path])
        except CorruptInputError as err:
            if on_bad_sample != "skip":
                raise InputError(f"{err} (input.on_bad_sample is error; 'skip' would leave this file out)") from err
            log.warning("skipping %s: %s", path, err.reason)
            return unreadable_file(path, key, err.reason)

    stamps = _match(patterns)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="jacobeam-describe") as pool:
        files = assign_ids(list(pool.map(described, stamps)))
    check_consistent(files, sample_shape)
    if not any(f.num_samples for f in files):
        raise InputError(f"input.paths: the {len(files)} matched file(s) hold no readable samples")
    return files
