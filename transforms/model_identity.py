"""The model's identity: what of the model decides the numbers a run stores, read from the model's files
without importing TensorFlow or loading the model, and the library versions that computed them.

One identity serves the launcher's check of an output folder (``pipeline.folder``), the shards a run
keeps (``transforms.write.kept_record``), the worker's check that it loaded the planned model, and the
key of the engine's set-up decisions (``transforms.engine.decisions``).

``model_identity(source)`` is a JSON-able dict:

- ``kind``: ``keras`` (a ``.keras`` file), ``h5`` (a legacy Keras HDF5 file), ``saved_model``,
  ``factory`` or ``builtin``;
- ``architecture``: sha256 of the model's configuration (``config.json`` of a ``.keras`` zip, the
  ``model_config`` attribute of an ``.h5`` file) with every name replaced by the order it first appears
  in (Keras numbers default names per process: ``dense_3`` says nothing of the model), the compile
  configuration and object ids left out; None for other kinds;
- ``weights``: sha256 over the weight arrays' dtypes, shapes and values (for a SavedModel: over its
  files, which hold graph and weights); None for a factory or builtin, whose code makes its weights;
- ``code``: for a factory ``pkg.mod:fn``, sha256 of the module's source file (found, not executed) and
  the callable's name; for a builtin, of its builder's source. Code the module imports from elsewhere is
  not covered: the worker still compares the weights it loaded with those of the kept shards.

The full configuration (``architecture_config``) is kept beside it so that a refusal can name the layer
and key that changed (``differences``). ``library_versions`` are looked up in the packages' metadata.
"""

from __future__ import annotations

import ast
import base64
import functools
import hashlib
import io
import json
import os
import platform
import zipfile
import zlib
from collections.abc import Mapping
from importlib import machinery, metadata
from typing import Any

from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import ModelSource, version

# Compared between a folder and a run: a change of one of these is refused unless accepted
# (``jacobeam run --accept-library-versions``).
COMPARED_LIBRARIES = ("tensorflow", "keras", "numpy", "jacobeam")
_DISTRIBUTIONS = {"tensorflow": "tensorflow", "keras": "keras", "numpy": "numpy", "apache_beam": "apache-beam",
                  "h5py": "h5py"}
# Keys of a Keras configuration that do not decide the numbers: the optimizer and loss, and ids of
# objects in the saving process.
_IGNORED_KEYS = {"compile_config", "shared_object_id"}

# A shard's attributes (HDF5 keeps an attribute in its object header, at most 64 KiB: a large model's
# configuration is stored compressed, and left out where it still does not fit; the manifest has it).
IDENTITY_ATTR = "model_identity"  # JSON: the identity but its configuration (``stored``)
ARCHITECTURE_ATTR = "model_architecture"  # base64 of the zlib-compressed JSON configuration
VERSIONS_ATTR = "library_versions"  # JSON: ``library_versions()`` of the worker that wrote the shard
THREADS_ATTR = "tf_threads"  # TensorFlow threads of that worker (0: TensorFlow's default)
_MAX_ATTR_BYTES = 60_000


@functools.cache
def library_versions() -> dict[str, str | None]:
    """The installed versions, from the packages' metadata (importing TensorFlow to ask would cost seconds)."""

    def installed(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"jacobeam": version(), "python": platform.python_version(),
            **{key: installed(dist) for key, dist in _DISTRIBUTIONS.items()}}


def compared_versions(versions: Mapping[str, Any]) -> dict[str, Any]:
    return {name: versions.get(name) for name in COMPARED_LIBRARIES if name in versions}


def version_differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """``tensorflow 2.21.0 there, 2.22.0 now`` for each compared library whose version differs (a library
    that one side did not record is not compared)."""
    return [
        f"{name} {theirs[name]} there, {ours[name]} now"
        for name in COMPARED_LIBRARIES
        if name in theirs and name in ours and theirs[name] != ours[name]
    ]


def shard_attrs(identity: Mapping[str, Any], tf_threads: int | None) -> dict[str, Any]:
    """The attributes a shard stores of the model (when it has an ``identity``), the versions and threads
    that computed it."""
    attrs: dict[str, Any] = {VERSIONS_ATTR: json.dumps(library_versions(), sort_keys=True), THREADS_ATTR: tf_threads or 0}
    if identity:
        attrs[IDENTITY_ATTR] = attr_value(identity)
        if identity.get("architecture_config") is not None:
            packed = base64.b64encode(zlib.compress(json.dumps(identity["architecture_config"]).encode(), 9)).decode()
            if len(packed) <= _MAX_ATTR_BYTES:
                attrs[ARCHITECTURE_ATTR] = packed
    return attrs


def attr_value(identity: Mapping[str, Any]) -> str:
    return json.dumps(stored(identity), sort_keys=True)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def from_attrs(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The identity a shard stored (with its configuration where stored); None for a shard written before
    shards stored one."""
    if IDENTITY_ATTR not in attrs:
        return None
    identity = json.loads(_text(attrs[IDENTITY_ATTR]))
    if ARCHITECTURE_ATTR in attrs:
        identity["architecture_config"] = json.loads(zlib.decompress(base64.b64decode(_text(attrs[ARCHITECTURE_ATTR]))))
    return identity


def versions_from_attrs(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    return json.loads(_text(attrs[VERSIONS_ATTR])) if VERSIONS_ATTR in attrs else None


def model_identity(source: ModelSource) -> dict[str, Any]:
    """The identity of ``source`` (see the module docstring), with its ``architecture_config``; raises
    ``ModelError`` for a model that cannot be read."""
    if source.builtin is not None:
        return _identity("builtin", code=_builtin_code(source.builtin))
    if source.factory is not None:
        return _identity("factory", code=_factory_code(source.factory))
    path = source.path
    assert path is not None
    from jacobeam.transforms.output import storage

    try:
        if path.endswith(".keras"):
            with storage.open_read(path) as stream, zipfile.ZipFile(io.BytesIO(stream.read())) as archive:
                config = json.loads(archive.read("config.json"))
                weights = hashlib.sha256()
                for name in sorted(archive.namelist()):
                    if name.endswith(".h5"):
                        _hash_h5_arrays(weights, archive.read(name))
                    elif name not in ("config.json", "metadata.json"):  # metadata: the saving date, Keras' version
                        weights.update(name.encode() + archive.read(name))
            return _identity("keras", config=config, weights=weights.hexdigest())
        if path.endswith(".h5"):
            import h5py

            with storage.open_h5(path) as h5:
                config = h5.attrs.get("model_config")
                if config is None:
                    raise ModelError(f"model.path {path}: an HDF5 file without a model_config (not a Keras model file)")
                config = json.loads(config.decode() if isinstance(config, bytes) else config)
                weights = hashlib.sha256()
                group = h5["model_weights"] if "model_weights" in h5 else h5
                _hash_group(weights, group, h5py)
            return _identity("h5", config=config, weights=weights.hexdigest())
        return _identity("saved_model", weights=_files_digest(path))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        raise ModelError(f"model.path {path}: cannot read the model's identity: {err}") from err


def architecture_digest(config: Any) -> str:
    """sha256 of a Keras configuration, names replaced by their order and ignored keys left out."""
    return hashlib.sha256(json.dumps(_renamed(config), sort_keys=True).encode()).hexdigest()


def _identity(kind: str, config: Any = None, weights: str | None = None, code: str | None = None) -> dict[str, Any]:
    architecture = None if config is None else architecture_digest(config)
    return {"kind": kind, "architecture": architecture, "weights": weights, "code": code,
            "architecture_config": config}


def stored(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity without its ``architecture_config`` (which a shard stores apart): what is compared."""
    return {key: value for key, value in identity.items() if key != "architecture_config"}


def digest(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(stored(identity), sort_keys=True).encode()).hexdigest()


def differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """What changed between two identities, in words: the layers and keys of the architecture, weights,
    code. Empty when they are the same model."""
    if stored(theirs) == stored(ours):
        return []
    if theirs.get("kind") != ours.get("kind"):
        return [f"a {theirs.get('kind')} model there, a {ours.get('kind')} model now"]
    found = []
    if theirs.get("architecture") != ours.get("architecture"):
        old, new = theirs.get("architecture_config"), ours.get("architecture_config")
        layers = _layer_differences(old, new) if old is not None and new is not None else []
        found += layers[:3] or ["the architecture differs"]
        if len(layers) > 3:
            found.append(f"... and {len(layers) - 3} more changes of the architecture")
    if theirs.get("weights") != ours.get("weights"):
        found.append("the model's files differ" if ours.get("kind") == "saved_model" else "the weights differ")
    if theirs.get("code") != ours.get("code"):
        found.append(f"the {ours.get('kind')}'s source code differs")
    return found


def _renamed(config: Any) -> Any:
    """``config`` with every name replaced by ``#k``, the order it first appears in, and the keys that do
    not decide the numbers left out."""
    names: dict[str, str] = {}

    def collect(value) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("name"), str):
                names.setdefault(value["name"], f"#{len(names)}")
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)

    def renamed(value):
        if isinstance(value, dict):
            return {k: renamed(v) for k, v in value.items() if k not in _IGNORED_KEYS}
        if isinstance(value, list):
            return [renamed(v) for v in value]
        return names.get(value, value) if isinstance(value, str) else value

    collect(config)
    return renamed(config)


def _layers(config: Any) -> list[dict] | None:
    inner = config.get("config") if isinstance(config, dict) else None
    layers = inner.get("layers") if isinstance(inner, dict) else None
    return layers if isinstance(layers, list) else None


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _layer_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Layer by layer (in order, names aside): ``layer 'd': activation tanh there, relu now``."""
    old_layers, new_layers = _layers(old), _layers(new)
    if old_layers is None or new_layers is None:
        return []
    found = []
    if len(old_layers) != len(new_layers):
        found.append(f"{prefix}{len(old_layers)} layers there, {len(new_layers)} now")
    for there, now in zip(old_layers, new_layers):
        name = (now.get("config") or {}).get("name", "?")
        where = f"{prefix}layer {name!r}"
        if there.get("class_name") != now.get("class_name"):
            found.append(f"{where}: {there.get('class_name')} there, {now.get('class_name')} now")
            continue
        if _layers(there) is not None and _layers(now) is not None:  # a model inside the model
            found += _layer_differences(there, now, f"{where} > ")
            continue
        old_config, new_config = _renamed(there.get("config") or {}), _renamed(now.get("config") or {})
        for key in sorted(set(old_config) | set(new_config)):
            if key != "name" and old_config.get(key) != new_config.get(key):
                found.append(f"{where}: {key} {_shown(there['config'].get(key))} there, {_shown(now['config'].get(key))} now")
        for key in ("build_config", "inbound_nodes"):
            if _renamed(there.get(key)) != _renamed(now.get(key)):
                found.append(f"{where}: its {key.replace('_', ' ')} differs")
    return found


def _hash_h5_arrays(digest_: Any, data: bytes) -> None:
    import h5py

    with h5py.File(io.BytesIO(data), "r") as h5:
        _hash_group(digest_, h5, h5py)


def _hash_group(digest_: Any, group: Any, h5py: Any) -> None:
    """The arrays' dtypes, shapes and values in the file's (name) order: not the bytes of the file, which
    differ between two saves of the same weights."""
    import numpy as np

    def visit(name: str, item: Any) -> None:
        if isinstance(item, h5py.Dataset):
            value = np.ascontiguousarray(item[()])
            digest_.update(f"{name}{value.dtype.str}{value.shape}".encode())
            digest_.update(value.tobytes())

    group.visititems(visit)


def _files_digest(path: str) -> str:
    """sha256 of a directory's files (their paths under it and their bytes), local or remote."""
    from jacobeam.transforms.output import storage

    if storage.is_local(path):
        files = sorted(os.path.relpath(os.path.join(folder, name), path)
                       for folder, _, names in os.walk(path) for name in names)
    else:
        from apache_beam.io.filesystems import FileSystems

        prefix = path.rstrip("/") + "/"
        (match,) = FileSystems.match([prefix + "**"])
        files = sorted(m.path[len(prefix):] for m in match.metadata_list)
    if not files:
        raise ModelError(f"model.path {path}: no such file or directory")
    digest_ = hashlib.sha256()
    for name in files:
        digest_.update(name.encode())
        with storage.open_read(storage.join(path, name)) as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest_.update(chunk)
    return digest_.hexdigest()


def _module_file(module_name: str) -> str | None:
    """The source file of ``module_name``, found on ``sys.path`` without importing it or its packages."""
    spec, locations = None, None
    parts = module_name.split(".")
    for depth in range(len(parts)):
        spec = machinery.PathFinder.find_spec(".".join(parts[: depth + 1]), locations)
        if spec is None:
            return None
        locations = spec.submodule_search_locations
    return spec.origin if spec is not None and spec.has_location else None


def _factory_code(factory: str) -> str:
    module_name, _, attr = factory.partition(":")
    origin = _module_file(module_name)
    if origin is None or not os.path.isfile(origin):
        raise ModelError(f"model.factory {factory!r}: cannot find the module {module_name!r} (on sys.path)")
    with open(origin, "rb") as stream:
        return hashlib.sha256(stream.read() + b"\0" + attr.encode()).hexdigest()


def _builtin_code(name: str) -> str:
    """sha256 of the builtin's builder (``build_<name>``), ``seeded_weights`` and ``BUILTIN_SEED`` as
    written in ``engine/models.py``: read, not imported (it imports TensorFlow)."""
    path = os.path.join(os.path.dirname(__file__), "engine", "models.py")
    with open(path, encoding="utf-8") as stream:
        text = stream.read()
    wanted = {f"build_{name}", "seeded_weights", "BUILTIN_SEED"}
    parts = []
    for node in ast.parse(text).body:
        names = {node.name} if isinstance(node, ast.FunctionDef) else {
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
        if names & wanted:
            parts.append(ast.get_source_segment(text, node) or "")
    return hashlib.sha256(f"{name}\0".encode() + "\n".join(parts).encode()).hexdigest()
