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

import collections
import concurrent.futures
import dataclasses
import logging
import os
import re
import stat
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from jacobeam.transforms.errors import CorruptInputError, InputError
from jacobeam.transforms.inputs.arrays import npy_header_end
from jacobeam.transforms.inputs.readers import assign_ids, check_consistent, describe, unreadable_file
from jacobeam.transforms.inputs.registry import IMAGE_SUFFIXES
from jacobeam.transforms.inputs.types import ImageOptions, Key, Shape, SourceFile
from jacobeam.transforms.output import storage

log = logging.getLogger(__name__)

_BLOCK = 256  # files described per task
# Image formats a folder may hold that jacobeam does not read (Keras's image folders also take BMP and GIF).
_OTHER_IMAGES = (".bmp", ".gif", ".webp", ".tif", ".tiff", ".heic")


def list_inputs(patterns: list[str]) -> dict[str, str]:
    """Every file the globs match, each once, sorted, with its stamp (``SourceFile.stamp``: size and time
    of the last change, from the listing). A folder (a pattern without wildcards naming one, or ending in
    ``/``) stands for every PNG/JPEG image under it, at any depth, but hidden ones: a name starting with a
    dot, or under a folder whose does (macOS's ``._photo.jpg`` resource forks, ``.ipynb_checkpoints``)."""
    from apache_beam.io.filesystems import FileSystems

    paths: dict[str, str] = {}
    for given in patterns:
        # Absolute: Beam matches a glob without a folder part ("*.npy") against nothing, and workers
        # need not share the launcher's working directory.
        if storage.is_local(given) and os.path.exists(given):  # a file or folder, whatever its name holds ("exp[1]")
            pattern, folder = storage.absolute(given), os.path.isdir(given)
            glob = storage.join(escaped(pattern), "**") if folder else escaped(pattern)
        else:
            pattern = glob_of(given)
            folder = not _WILDCARD.search(given) and (pattern.endswith("/") or storage.is_folder(pattern))
            glob = storage.join(pattern, "**") if folder else pattern
        if storage.is_local(glob):
            found = _local_match(glob)
        else:
            (match,) = FileSystems.match([glob])
            found = {m.path: _stamp(m) for m in match.metadata_list}
        if folder:
            inside = len(storage.join(pattern, ""))  # the matched paths' part below the folder
            shown = {path: stamp for path, stamp in found.items() if not _hidden(path[inside:])}
            found = {path: stamp for path, stamp in shown.items() if path.lower().endswith(IMAGE_SUFFIXES)}
            _warn_other_images(given, shown)
        if not found:
            what = "holds no PNG or JPEG images" if folder else "matches no files"
            where = "" if pattern == given else f" (looked for {pattern})"
            raise InputError(f"input.paths: {given!r} {what}{where}")
        paths.update(found)  # not a new dict per pattern: a list of a million files took hours
    ordered = sorted(paths)  # a local listing is in order already, but where a folder sorts after a file
    return paths if ordered == list(paths) else {path: paths[path] for path in ordered}


_WILDCARD = re.compile(r"[*?[]")


def escaped(path: str) -> str:
    """``path`` as a glob matching only itself: each wildcard character in brackets (``exp[1]``: ``exp[[]1]``)."""
    return _WILDCARD.sub(lambda found: f"[{found.group(0)}]", path)


def glob_of(given: str) -> str:
    """An ``input.paths`` entry as an absolute glob: a relative one joined to the working directory as that
    folder itself (a ``[`` in its name is not a glob's: every relative path failed to match)."""
    if not storage.is_local(given) or os.path.isabs(given):
        return given
    return os.path.normpath(os.path.join(escaped(os.getcwd()), given)) + ("/" if given.endswith("/") else "")


def glob_root(given: str) -> str:
    """The literal folder an ``input.paths`` entry names before its first wildcard (``data/train/*/*.png``:
    ``data/train``; ``exp[[]1]/*.png``: ``exp[1]``), absolute; a folder given as it is, that folder."""
    if storage.is_local(given) and os.path.isdir(given):
        return storage.absolute(given).rstrip("/")
    literal = []
    for part in glob_of(given).rstrip("/").split("/"):
        if _wild(part):
            break
        literal.append(_ESCAPED.sub(r"\1", part))
    return "/".join(literal) or "/"


_ESCAPED = re.compile(r"\[([*?[])\]")  # a wildcard character in brackets of its own: that character


def _wild(pattern: str) -> bool:
    """Whether a glob holds a wildcard (not only characters in brackets of their own)."""
    return bool(_WILDCARD.search(_ESCAPED.sub("", pattern)))


def _warn_other_images(given: str, paths) -> None:
    """Say how many images of formats jacobeam does not read a folder holds: they are left out."""
    others = collections.Counter(suffix for suffix in map(_suffix, paths) if suffix in _OTHER_IMAGES)
    if others:
        counts = ", ".join(f"{count} {suffix}" for suffix, count in sorted(others.items()))
        log.warning("input.paths %r: %d image(s) left out (%s): jacobeam reads PNG and JPEG images; convert them to "
                    "read them", given, sum(others.values()), counts)


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _hidden(relative: str) -> bool:
    """Whether a path below a folder has a part starting with a dot."""
    return any(part.startswith(".") for part in relative.split("/"))


def _local_match(pattern: str) -> dict[str, str]:
    """What Beam's ``FileSystems.match`` finds for a local ``pattern`` (its glob syntax: ``*`` within a folder,
    ``**`` across folders), with each file's stamp, from one ``stat`` per matched file (Beam's listing
    stats every file under the pattern's folder twice), folders and names in sorted order: a million
    files are listed in a few seconds, most of it the ``stat`` calls (benchmarks/README.md)."""
    from apache_beam.io.filesystem import FileSystem

    if pattern.endswith("/"):
        pattern += "*"
    if not _wild(pattern):  # one file, its name as it is
        literal = _ESCAPED.sub(r"\1", pattern)
        candidates: Iterable[str] = [literal] if os.path.isfile(literal) else []
    else:
        with warnings.catch_warnings():  # "[[]", a "[" escaped (``escaped``), is a "possible nested set" to re
            warnings.simplefilter("ignore", FutureWarning)
            match = re.compile(FileSystem.translate_pattern(pattern)).match
        top = glob_root(pattern)  # the literal folder before the first wildcard

        def walk() -> Iterator[str]:
            for folder, folders, names in os.walk(top):
                folders.sort()
                start = folder if folder.endswith("/") else folder + "/"
                yield from (path for name in sorted(names) if match(path := start + name))

        candidates = walk()
    return _local_stamps(candidates)


def _local_stamps(paths: Iterable[str]) -> dict[str, str]:
    """The stamps of the local files at ``paths``, one ``stat`` each; a file not there (gone since it was
    listed) is left out."""
    found = {}
    for path in paths:
        try:
            status = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(status.st_mode):
            found[path] = f"{status.st_size}:{status.st_mtime!r}"
    return found


def _stamp(metadata) -> str:
    """A file's stamp (``SourceFile.stamp``) from Beam's ``FileMetadata`` of it."""
    return f"{metadata.size_in_bytes}:{metadata.last_updated_in_seconds!r}"


def stamps(paths: list[str]) -> dict[str, str]:
    """The stamps of the files at ``paths`` (as ``SourceFile.stamp``), by path; a file not there is left
    out. Reads the listing only."""
    from apache_beam.io.filesystem import BeamIOError
    from apache_beam.io.filesystems import FileSystems

    local = [path for path in paths if storage.is_local(path)]
    found = _local_stamps(local)  # literal paths: a file named "s[1].npy" is no glob of "s1.npy"
    for path in paths:
        if storage.is_local(path):
            continue
        try:
            (match,) = FileSystems.match([path])
        except BeamIOError:
            continue
        found.update({m.path: _stamp(m) for m in match.metadata_list if m.path == path})
    return found


class _NpyHeaders:
    """Local ``.npy`` files described by their header's bytes: the first file with a header is described
    (``describe``: parsed and checked), later files with the same bytes (a folder of one-sample files) are
    read that far and compared (about 15 us, against 60 us to parse: a minute of a million-file plan)."""

    _READ = 256  # bytes that hold a plain header

    def __init__(self):
        self._seen: dict[bytes, SourceFile] = {}

    def describe(self, path: str, stamp: str) -> SourceFile:
        with storage.open_input(path, headers=True) as stream:
            head = stream.read(self._READ)
        end = npy_header_end(head)
        known = self._seen.get(head[:end]) if len(head) >= end else None
        if known is None:
            known = dataclasses.replace(describe(path, None), path="", stamp=None)
            if len(head) >= end:
                self._seen[head[:end]] = known
        return SourceFile(path=path, key=None, num_samples=known.num_samples, sample_shape=known.sample_shape,
                          dtype=known.dtype, stamp=stamp)


def recorded_descriptions(manifest: Mapping[str, Any] | None, config_input: Mapping[str, Any]) -> dict[str, SourceFile]:
    """The files an output folder's manifest lists, as ``describe`` found them then (by path, each with the
    stamp it had): a file whose stamp is still that one holds what it held (as the shards' stamps are
    trusted, ``pipeline.folder.stale_shards``), so its headers need not be read again. None of them when
    the config reads files otherwise than the run that wrote the manifest (``input`` but for its paths)."""
    from jacobeam.transforms.inputs.readers import from_a_pipeline, shape_from_record

    def how(section: Mapping[str, Any]) -> dict[str, Any]:
        return {name: value for name, value in section.items() if name not in ("paths", "on_bad_sample")}

    if manifest is None or from_a_pipeline(manifest) or how(manifest["config"].get("input", {})) != how(config_input):
        return {}
    shape = shape_from_record(manifest["input_shape"])
    image = ImageOptions.from_config(manifest["config"].get("input", {}).get("image"))
    found: dict[str, SourceFile] = {}
    for entry in manifest["inputs"]:
        path, stamp = entry["path"], entry.get("stamp")
        if entry.get("unreadable") or not stamp or entry.get("removed"):
            continue
        first_row = entry.get("first_row", 0)
        rows = first_row + entry["num_samples"]  # a file placed in pieces: all its rows
        if path not in found or rows > found[path].num_samples:
            # Its first piece's id: where ids come out the same (a run that adds no file), no copy is made.
            first_id = entry["first_id"] if first_row == 0 else getattr(found.get(path), "first_id", 0)
            found[path] = SourceFile(path=path, key=entry.get("key"), num_samples=rows, sample_shape=shape,
                                     dtype=entry["dtype"], stamp=stamp, first_id=first_id,
                                     image=image if path.lower().endswith(IMAGE_SUFFIXES) else None)
    return found


def resolve_inputs(
    patterns: list[str], key: Key, on_bad_sample: str = "error", sample_shape: Shape | None = None,
    image: ImageOptions | None = None, known: Mapping[str, SourceFile] | None = None,
    listed: Mapping[str, str] | None = None,
) -> list[SourceFile]:
    """Every file the globs match (each file once), described, in sorted path order with ids in that
    order. Under ``skip`` a file that cannot be opened is kept as an unreadable file without samples.
    Remote files are described a few at a time (headers only: remote reads are round trips), in blocks
    (one task per file cost more than reading a header), local ones one after the other. ``known``: descriptions an earlier run
    recorded (``recorded_descriptions``), taken as they are for a file whose stamp is the same.
    ``listed``: ``list_inputs(patterns)``, where the caller has it already."""

    headers = _NpyHeaders() if key is None else None

    def described(path: str) -> SourceFile:
        try:
            if headers is not None and path.endswith(".npy") and storage.is_local(path):
                return headers.describe(path, stamps[path])
            return describe(path, key, sample_shape, image).replaced(stamp=stamps[path])
        except CorruptInputError as err:
            if on_bad_sample != "skip":
                raise InputError(f"{err} (input.on_bad_sample is error; 'skip' would leave this file out)") from err
            log.warning("skipping %s: %s", path, err.reason)
            # Its stamp too: a rerun that finds it unchanged knows it unreadable still (``pipeline.up_to_date``).
            return unreadable_file(path, key, err.reason).replaced(stamp=stamps[path])

    stamps = list_inputs(patterns) if listed is None else listed
    known = known or {}
    found = {path: known[path] for path, stamp in stamps.items() if path in known and known[path].stamp == stamp}
    new = [path for path in stamps if path not in found]
    # Local headers in this thread: in threads they read slower (28 us a PNG against 19 us), the GIL
    # passed between them for each short read; remote ones in threads, each read a round trip.
    found.update((path, described(path)) for path in new if storage.is_local(path))
    remote = [path for path in new if not storage.is_local(path)]
    blocks = [remote[i : i + _BLOCK] for i in range(0, len(remote), _BLOCK)]
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="jacobeam-describe") as pool:
        for block in pool.map(lambda paths: [described(path) for path in paths], blocks):
            found.update((source.path, source) for source in block)
    if new and len(new) < len(stamps):
        log.info("%d input file(s) described from their headers, %d as an earlier run recorded them", len(new),
                 len(found) - len(new))
    files = assign_ids([found[path] for path in stamps])
    check_consistent(files, sample_shape)
    if not any(f.num_samples for f in files):
        raise InputError(f"input.paths: the {len(files)} matched file(s) hold no readable samples")
    return files
