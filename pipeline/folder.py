"""What an output folder already holds, judged by content, and how it differs from a planned run."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Collection
from typing import Any

from jacobeam.pipeline.identity import identity_differences, run_identity
from jacobeam.pipeline.ids import path_mapper
from jacobeam.transforms import model_identity
from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.model_differences import differences as model_changes
from jacobeam.transforms.output import inputs_table, storage
from jacobeam.transforms.output.layout import (
    AGGREGATES,
    CHECKSUM_SUFFIXES,
    ENGINE_PLAN,
    INPUT_STAMPS,
    INPUTS_PREVIOUS,
    INPUTS_TABLE,
    MANIFEST,
    REJECTED_FILE,
    SAMPLES_SHA256,
    SHARDS_DIR,
    VIEW,
    is_checksum_file,
    is_folder_temp,
    is_shard_file,
    is_shard_temp,
    shard_ids,
)
from jacobeam.transforms.output.shards import attr_text, read_attrs
from jacobeam.transforms.spec import JobSpec, ShardRange, shard_inputs

log = logging.getLogger(__name__)

@dataclasses.dataclass
class Folder:
    """A read-only look at an output folder: what jacobeam wrote there before."""

    root: str  # absolute local path or remote URL
    manifest: dict[str, Any] | None = None
    shards: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # file name -> attrs
    owned: list[str] = dataclasses.field(default_factory=list)  # files jacobeam wrote (shown by content)
    alien: list[str] = dataclasses.field(default_factory=list)  # jacobeam's names, not jacobeam's content
    unproven: list[str] = dataclasses.field(default_factory=list)  # remote shards not proven complete

    @property
    def empty(self) -> bool:
        return self.manifest is None and not self.shards


def _is_jacobeam_view(path: str) -> bool:
    with storage.open_h5(path) as view:
        if "jacobeam_version" in view.attrs:
            return True
        datasets = list(view.values())
        return bool(datasets) and all(
            getattr(d, "is_virtual", False)
            and all(s.file_name.startswith(f"{SHARDS_DIR}/") for s in d.virtual_sources())
            for d in datasets
        )


def _is_aggregates(path: str) -> bool:
    with storage.open_h5(path) as h5:
        return "count" in h5 and set(h5) <= {"count", "mean", "mean_abs", "jtj"}


def _is_inputs_table(path: str) -> bool:
    with storage.open_h5(path) as h5:
        return {"count", "keys"} <= set(h5.attrs) and set(h5) <= {inputs_table.COLUMNS}


def _with_inputs(root: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its input files' rows (``inputs_table.with_inputs``); a table that cannot be read
    is the folder's problem, named, not a reason to call the manifest another program's."""
    try:
        return inputs_table.with_inputs(root, manifest)
    except (OSError, ValueError, KeyError) as err:
        raise OutputError(f"output folder {root}: {MANIFEST} lists its input files in {INPUTS_TABLE}, which cannot be "
                          f"read ({err}); use --overwrite to replace the folder's result") from err


def _is_rejected_list(path: str) -> bool:
    for line in storage.read_text(path).splitlines():
        record = json.loads(line)
        if not isinstance(record, dict) or set(record) != {"id", "file", "row", "reason"}:
            return False
    return True


def _is_engine_plan(path: str) -> bool:
    try:
        plan = json.loads(storage.read_text(path))
    except (OSError, ValueError):
        return False
    return isinstance(plan, dict) and {"key", "plan"} <= set(plan)


def read_folder(output_dir: str) -> Folder:
    """What the folder holds, judged by content: a file with one of jacobeam's names counts as jacobeam's
    only if it looks like what jacobeam writes; otherwise it is listed as alien and never touched.

    In a remote folder a shard counts only when it has jacobeam's attributes and a checksum sidecar (see
    ``transforms.output.shards``; the worker checks its bytes against the sidecar before keeping it); one that
    jacobeam wrote (it has a sidecar, or a ``run_key``) but that fails this is listed as owned, not as a
    shard: ``prepare_output`` removes it and it is computed again."""
    root = storage.normalize(output_dir)
    folder = Folder(root)
    for name in storage.listdir(root):
        path = storage.join(root, name)
        if is_folder_temp(name):
            folder.owned.append(path)
            continue
        if name == ENGINE_PLAN:  # a cache of the engine's set-up: never a reason to refuse the folder
            if _is_engine_plan(path):
                folder.owned.append(path)
            continue
        if name not in (MANIFEST, VIEW, REJECTED_FILE, AGGREGATES, INPUTS_TABLE, INPUTS_PREVIOUS) or not storage.is_file(path):
            continue
        try:
            if name == MANIFEST:
                manifest = json.loads(storage.read_text(path))
                ours = isinstance(manifest, dict) and {"jacobeam_version", "run_key"} <= set(manifest) and (
                    "inputs" in manifest or "input_files" in manifest)
                folder.manifest = _with_inputs(root, manifest) if ours else None
            elif name in (INPUTS_TABLE, INPUTS_PREVIOUS):
                ours = _is_inputs_table(path)
            elif name == VIEW:
                ours = _is_jacobeam_view(path)
            elif name == AGGREGATES:
                ours = _is_aggregates(path)
            else:
                ours = _is_rejected_list(path)
        except (OSError, ValueError):
            ours = False
        (folder.owned.append(path) if ours else folder.alien.append(path))
    shards = storage.join(root, SHARDS_DIR)
    names = storage.listdir(shards)
    for name in names:
        path = storage.join(shards, name)
        if is_shard_temp(name) or is_checksum_file(name):
            folder.owned.append(path)
        elif is_shard_file(name):
            try:
                attrs = read_attrs(path)
            except (OSError, ValueError):
                attrs = {}
            # Remote: a sidecar marks a shard whose copy finished; the worker checks its bytes against
            # it (and computes the shard again on a mismatch), so the launcher need not read every shard.
            remote = not storage.is_local(root)
            sidecar = any(name + suffix in names for suffix in CHECKSUM_SUFFIXES)
            if "run_key" in attrs and (sidecar or not remote):
                folder.shards[name] = attrs
                folder.owned.append(path)
            elif remote and ("run_key" in attrs or sidecar):
                log.warning("%s: not proven complete (no readable shard with a checksum sidecar); computing it again", path)
                folder.owned.append(path)
                folder.unproven += [path, *(path + suffix for suffix in CHECKSUM_SUFFIXES)]
            else:
                folder.alien.append(path)
    return folder


def _absolute_paths(inputs: list[list[Any]], as_now: Callable[[str], str] = storage.absolute) -> list[list[Any]]:
    """A shard's ``inputs`` attribute with local paths as this run names the files (``as_now``;
    absolute: older shards list them relative)."""
    return [[as_now(path), *rest] for path, *rest in inputs]


def judged_by_weights(folder: Folder) -> bool:
    """Whether the folder holds a manifest or shards written before shards stored the model's identity:
    those are compared with the model by its loaded weights alone (``LoadedModel.fingerprint``), which
    the launcher must load the model to know."""
    return (folder.manifest is not None and "model_identity" not in folder.manifest) or any(
        model_identity.IDENTITY_ATTR not in attrs for attrs in folder.shards.values()
    )


def recorded_run_key(folder: Folder, identity: dict[str, Any]) -> str | None:
    """The run key the folder's manifest (else its first shard, by name) recorded, when its recorded run
    identity is ``identity`` as ``identity_differences`` compares them (file names resolved): a folder
    written by this run under another spelling of a path, or by a version that keyed the path as written.
    This run then writes under that key, so that every shard of the folder has one. None otherwise."""
    if folder.manifest is not None:
        recorded = [(folder.manifest.get("run_identity") or run_identity(folder.manifest["config"]),
                     folder.manifest["run_key"])]
    else:
        recorded = [(json.loads(attr_text(attrs["run_identity"])), attr_text(attrs["run_key"]))
                    for _, attrs in sorted(folder.shards.items()) if "run_identity" in attrs][:1]
    return next((key for theirs, key in recorded if not identity_differences(theirs, identity)), None)


def stored_fingerprint(folder: Folder) -> str | None:
    """The loaded weights' fingerprint the folder's shards recorded (the first, by name), or None."""
    return next((attr_text(attrs["model_fingerprint"]) for _, attrs in sorted(folder.shards.items())
                 if attr_text(attrs.get("model_fingerprint", ""))), None)


def folder_differences(
    folder: Folder, spec: JobSpec, fingerprint: str | None, accept_library_versions: bool = False,
    outdated: Collection[str] | None = None,
) -> list[str]:
    """How what the folder holds differs from this run; empty when it can be resumed or extended.

    The model is compared by its identity (``transforms.model_identity``) where the folder recorded one,
    else (a folder written before) by the weights' ``fingerprint``, when the launcher loaded the model.
    Library versions are compared with the manifest's (the last finished run's; a run that accepted
    others wrote its own there), or without a manifest with each shard's; unless accepted. The shards
    ``outdated`` (``unfinished_outdated``'s, computed here where not given) are computed again, not
    differences."""
    differences = []
    by_place: dict[str, list[str]] = {}  # the same difference in many places (manifest, shards) is listed once
    ours = spec.model_identity
    current = model_identity.library_versions()

    def model_differences(theirs: dict[str, Any] | None, stored: str | None) -> list[str]:
        if theirs is not None and ours:
            return [f"model: {d}" for d in model_changes(theirs, ours)]
        if fingerprint and stored and stored != fingerprint:
            return [f"model weights differ (fingerprint {stored[:16]}… there, {fingerprint[:16]}… in this run)"]
        return []

    def version_differences(theirs: dict[str, Any] | None) -> list[str]:
        found = model_identity.version_differences(theirs or {}, current)
        if not found or accept_library_versions:
            return []
        return [f"computed with other library versions: {', '.join(found)} (--accept-library-versions adds "
                "shards computed with these)"]

    if folder.manifest is not None:
        manifest = folder.manifest
        theirs = manifest.get("run_identity") or run_identity(manifest["config"])
        differences += [f"{MANIFEST}: written by a different run: {d}" for d in identity_differences(theirs, spec.identity)]
        for difference in model_differences(manifest.get("model_identity"), manifest.get("model_fingerprint")):
            by_place.setdefault(difference, []).append(MANIFEST)
        for difference in version_differences(manifest.get("versions")):
            by_place.setdefault(difference, []).append(MANIFEST)
    expected = set(spec.ranges()) if folder.shards else set()  # planning costs in the folder's shards, not all ids
    as_now = path_mapper(folder.manifest, list(spec.files), spec.output_dir)
    removed = _removed_pieces(spec)
    outdated = set(unfinished_outdated(folder, spec) if outdated is None else outdated)
    for name, attrs in folder.shards.items():
        where = f"{SHARDS_DIR}/{name}"
        shard = ShardRange(*shard_ids(name))
        if name in outdated:
            continue
        if shard not in expected:
            by_place.setdefault("not one of this run's shards (ids grouped differently: another input set or "
                                "samples_per_shard)", []).append(where)
            continue
        if "run_identity" in attrs:
            found = identity_differences(json.loads(attr_text(attrs["run_identity"])), spec.identity)
        else:
            theirs = attr_text(attrs["run_key"])
            found = [] if theirs == spec.run_key else [f"run key {theirs}, this run {spec.run_key}"]
        found = [f"written by a different run: {d}" for d in found]
        found += model_differences(model_identity.from_attrs(attrs), attr_text(attrs.get("model_fingerprint", "")))
        if folder.manifest is None:
            found += version_differences(model_identity.versions_from_attrs(attrs))
        if _other_inputs(attrs, shard, spec, as_now, removed):
            found.append("computed from other input data (its ids now mean other samples)")
        for difference in found:
            by_place.setdefault(difference, []).append(where)
    for difference, places in by_place.items():
        shards = len(places) - 1
        more = " more" if places[0] != MANIFEST else ""
        others = f" (so do {shards}{more} shards)" if shards else ""
        differences.append(f"{places[0]}: {difference}{others}")
    return differences


def _other_inputs(attrs: dict[str, Any], shard: ShardRange, spec: JobSpec, as_now, removed) -> bool:
    """Whether a shard was computed from other input data than this run's ids of its range mean: path, key,
    first id and samples of each file (not the data sha256 that shards written before planning read headers
    only list: a changed file is told by its stamp, stale_shards), but for files removed since
    (``holding_removed``: such a shard is written again without them)."""
    return "inputs" in attrs and [entry for entry in _recorded_inputs(attrs, as_now)
                                   if (entry[2], entry[3]) not in removed] != _planned_inputs(spec, shard)


def _recorded_inputs(attrs: dict[str, Any], as_now) -> list[list[Any]]:
    """A shard's ``inputs``: path (as this run names it), key, first id and samples of each file."""
    return [entry[:4] for entry in _absolute_paths(json.loads(attr_text(attrs["inputs"])), as_now)]


def _planned_inputs(spec: JobSpec, shard: ShardRange) -> list[list[Any]]:
    """``_recorded_inputs`` as this run's plan has them for the range ``shard``."""
    return [entry[:4] for entry in shard_inputs(spec.files, shard.start, shard.stop)]


def unfinished_outdated(folder: Folder, spec: JobSpec) -> list[str]:
    """The shards (names) of a run that did not finish whose ids this run places otherwise. Without a
    manifest (the run never finished): a file added that sorts among the others, a file that was
    unreadable and is mended. With one: a shard a later run that did not finish wrote again without a
    file deleted then, which is back (put back under its path: the manifest's ids are its). No result
    stands on them, so they are computed again (or, outside this run's ranges, deleted once the manifest is
    written) instead of making the folder another run's: numbering continues from a manifest only."""
    if not folder.shards:
        return []
    ours = {name: attrs for name, attrs in folder.shards.items()
            if attr_text(attrs.get("run_key", "")) == spec.run_key}  # this run's: else another run's result
    as_now = path_mapper(folder.manifest, list(spec.files), spec.output_dir)
    if folder.manifest is None:
        expected = set(spec.ranges())
        return sorted(name for name, attrs in ours.items()
                      if ShardRange(*shard_ids(name)) not in expected
                      or _other_inputs(attrs, ShardRange(*shard_ids(name)), spec, as_now, set()))
    listed = {storage.name_of(entry["file"]): entry.get("samples_sha256") for entry in folder.manifest["shards"]}
    return sorted(name for name, attrs in ours.items()
                  if name in listed and listed[name] != attr_text(attrs.get(SAMPLES_SHA256, ""))
                  and _fewer_inputs(attrs, ShardRange(*shard_ids(name)), spec, as_now))


def _fewer_inputs(attrs: dict[str, Any], shard: ShardRange, spec: JobSpec, as_now) -> bool:
    """Whether a shard lists only some of the files this run's ids of its range mean, each as this run does."""
    if "inputs" not in attrs:
        return False

    def files(entries: list[list[Any]]) -> set[str]:
        return {json.dumps(entry, sort_keys=True) for entry in entries}

    return files(_recorded_inputs(attrs, as_now)) < files(_planned_inputs(spec, shard))


def _removed_pieces(spec: JobSpec) -> set[tuple[int, int]]:
    """The removed pieces (``JobSpec.removed``) by first id and samples: what a shard's ``inputs`` lists of
    each piece besides its path (which a moved folder spells otherwise)."""
    return {(f.first_id, f.num_samples) for f in spec.removed}


def listed_crc32c(folder: Folder) -> tuple[tuple[str, str], ...]:
    """``(name, crc32c)`` the folder's manifest lists for each shard on disk that holds the samples it lists
    for it (the same ``samples_sha256``; a later run that replaced the shard with other samples is not
    second-guessed): ``JobSpec.listed_crc32c``."""
    found = []
    for entry in (folder.manifest or {}).get("shards", []):
        name, crc = storage.name_of(entry["file"]), entry.get("crc32c")
        attrs = folder.shards.get(name)
        if crc and attrs is not None and SAMPLES_SHA256 in attrs and entry.get("samples_sha256") == \
                attr_text(attrs[SAMPLES_SHA256]):
            found.append((name, crc))
    return tuple(found)


def holding_removed(folder: Folder, spec: JobSpec) -> list[str]:
    """The folder's shards (names) computed with samples of input files removed since (their ``inputs``
    list a piece of ``JobSpec.removed``): each is written again without them (``transforms.trim``), as a
    stale shard is, and replaces the old one once committed. A shard written again lists them no more."""
    removed = _removed_pieces(spec)
    if not removed:
        return []
    return sorted(name for name, attrs in folder.shards.items()
                  if any((entry[2], entry[3]) in removed for entry in json.loads(attr_text(attrs.get("inputs", "[]")))))


def stale_shards(folder: Folder, spec: JobSpec) -> list[str]:
    """The folder's shards (names) fed by an input file whose stamp changed since they were computed
    (``SourceFile.stamp``: size and time of the last change): a resumed run trusts a stamp, as make and
    rsync do, and reads such a shard's samples again (``JobSpec.stale``). ``stale_names`` says which."""
    now = {f.path: f.stamp for f in spec.files}
    return stale_names(folder, now, path_mapper(folder.manifest, list(spec.files), spec.output_dir))


def stale_names(folder: Folder, now: dict[str, str | None], as_now: Callable[[str], str] = storage.absolute) -> list[str]:
    """The folder's shards (names) that are not known to be up to date with the input files' stamps
    ``now`` (by path, as this run names them; ``as_now`` maps a path the folder recorded to that name).

    A shard is up to date when the stamps it recorded (``input_stamps``) are those of now, or when the
    folder's manifest lists it with the digest of its samples it holds (``samples_sha256``: that shard,
    not another under its name) and lists the stamps of now for its files: the run that wrote the
    manifest found the shard's samples unchanged under those stamps (``transforms.job``), so the next run
    does not read them again. A shard written before shards recorded stamps is judged by the manifest's
    stamps alone, and is stale when there is none to compare. A file absent from ``now`` (gone: what
    ``inspect`` cannot judge) makes no shard stale."""
    manifest = folder.manifest or {}

    @functools.cache
    def listed() -> dict[str, str | None]:  # the manifest's stamps: only where a shard's own are not current
        return {as_now(entry["path"]): entry.get("stamp") for entry in manifest.get("inputs", [])}

    vouched = {storage.name_of(entry["file"]): entry.get("samples_sha256") for entry in manifest.get("shards", [])}

    def current(stamps: dict[str, str | None]) -> bool:
        return all(path not in now or (stamp is not None and now[path] == stamp) for path, stamp in stamps.items())

    stale = []
    for name, attrs in folder.shards.items():
        if INPUT_STAMPS in attrs:
            stamps = {as_now(path): stamp for path, stamp in json.loads(attr_text(attrs[INPUT_STAMPS])).items()}
        else:
            paths = [as_now(entry[0]) for entry in json.loads(attr_text(attrs.get("inputs", "[]")))]
            stamps = {path: listed().get(path) for path in paths}
        if current(stamps):
            continue
        digest = attr_text(attrs[SAMPLES_SHA256]) if SAMPLES_SHA256 in attrs else None
        if digest is not None and vouched.get(name) == digest and current({path: listed().get(path) for path in stamps}):
            continue
        stale.append(name)
    return sorted(stale)
