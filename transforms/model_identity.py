"""The model's identity: what of the model decides the numbers a run stores, and the library versions
that computed them. A model file's is read from its files without importing TensorFlow or loading the
model; a factory's is that of the model it builds.

One identity serves the launcher's check of an output folder (``pipeline.folder``), the shards a run
keeps (``transforms.write.kept_record``), the worker's check that it loaded the planned model, and the
key of the engine's set-up decisions (``transforms.engine.decisions``). Launcher and worker compute it
with the same function: ``transforms.engine.models.load`` passes the model it built to
``model_identity``, in the launcher (``pipeline.checks``) as in every worker.

``model_identity(source)`` is a JSON-able dict:

- ``kind``: ``keras`` (a ``.keras`` file), ``h5`` (a legacy Keras HDF5 file), ``saved_model``,
  ``factory`` or ``builtin``;
- ``architecture``: sha256 of the model's configuration (``config.json`` of a ``.keras`` zip, the
  ``model_config`` attribute of an ``.h5`` file, for a factory the built model's ``to_json()``: what a
  ``.keras`` file of it would hold) with every name replaced by the order it first appears in (Keras
  numbers default names per process: ``dense_3`` says nothing of the model), the compile configuration
  and object ids left out; None for a SavedModel, a builtin, and a factory that builds no Keras model or
  one Keras cannot serialize;
- ``weights``: sha256 over the weight arrays' dtypes, shapes and values (for a SavedModel: over its
  files, which hold graph and weights; for a factory: the built model's weights, in the model's order);
  None for a builtin, whose code makes its weights;
- ``code``: None but where the configuration does not list the model's layers. For a factory whose
  model does not (a subclassed ``keras.Model``, whose layers live in its class's code; a ``tf.Module``),
  sha256 of the factory module's source file, the callable's name and the source file of the built
  model's class; for a builtin, of its builder's source (``engine/models.py``, jacobeam's own: all else
  it runs is Keras and numpy, whose versions are compared). What a factory's model is made of is
  therefore covered wherever its code lives (a helper module that defines its layers, a change of an
  activation there), and a factory's module can change in ways that build the same model (a comment)
  without changing it. Code that a configuration names but does not hold (the ``call`` of a custom
  layer class) is not covered, for a factory as for a ``.keras`` file.

A factory is run to know its identity: ``model_identity`` without the built model loads it (importing
TensorFlow). A factory that draws its weights anew on each call builds another identity each time:
refused beside a folder's shards (``the weights differ``) and by the worker whose model is not the
planned one.

The full configuration (``architecture_config``) is kept beside it so that a refusal can name the layer
and key that changed (``transforms.model_differences``). ``library_versions`` are looked up in the
packages' metadata.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import functools
import hashlib
import io
import json
import os
import platform
import re
import zipfile
import zlib
from collections.abc import Iterable, Mapping
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
# Keys of a Keras configuration whose strings are layer names.
_NAMING_KEYS = {"name", "keras_history", "input_layers", "output_layers"}

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


def model_identity(source: ModelSource, built: Any = None) -> dict[str, Any]:
    """The identity of ``source`` (see the module docstring), with its ``architecture_config``; raises
    ``ModelError`` for a model that cannot be read.

    ``built``: for a factory, the ``LoadedModel`` it built (``transforms.engine.models.load`` passes
    it); without, the factory is loaded here, which imports TensorFlow. Ignored for other sources."""
    if source.builtin is not None:
        return _identity("builtin", code=_builtin_code(source.builtin))
    if source.factory is not None:
        if built is None:  # load() computes the identity of what it built, with ``built``
            return dataclasses.replace(source, logits=False).load().identity
        return built_identity(source.factory, built)
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


def built_identity(factory: str, built: Any) -> dict[str, Any]:
    """The identity of the model that ``factory`` built, ``built`` (a ``transforms.engine.models.LoadedModel``),
    in the fields of a ``.keras`` file's: ``architecture`` from its Keras configuration (``to_json()``, what
    a ``.keras`` file of it holds in ``config.json``, Keras' default names as ``default_names`` gives them:
    the same digest as that file's), kept as ``architecture_config``; ``weights`` over the values of its
    weights, in the model's order (``weights_digest``); ``code`` only where the configuration lists no
    layers. Reads the model through its own methods: imports nothing of TensorFlow."""
    keras_model = getattr(built, "keras_model", None)
    config = None
    if keras_model is not None:
        try:
            config = default_names(json.loads(keras_model.to_json()))
        except Exception:  # noqa: BLE001 - a subclassed model or layer Keras cannot serialize (no get_config)
            config = None
    weights = weights_digest(variable.numpy() for variable in built.variables)
    code = None
    if layers_of(config) is None:  # its layers are in code: the factory's module, the model's class's
        classes = [type(keras_model).__module__] if keras_model is not None else []
        code = _factory_code(factory, classes)
    return _identity("factory", config=config, weights=weights, code=code)


def default_names(config: Any) -> Any:
    """``config`` with each name Keras gave by default (``dense_7``: its class's in snake case, numbered per
    process) replaced by the one it gets in a process that builds only this model (``dense``, ``dense_1``,
    in the order they appear), wherever the name appears: what a shard stores of a factory's model is the
    same in every process that builds it (a resumed run writes the same bytes), and reads like the
    ``config.json`` of a ``.keras`` file of it. Names given by the factory are kept."""
    found: list[tuple[str, str | None]] = []  # (name, its class's prefix where Keras may have given it)

    def collect(value: Any) -> None:
        if isinstance(value, dict):
            inner = value.get("config")
            if isinstance(value.get("class_name"), str) and isinstance(inner, dict) and isinstance(inner.get("name"), str):
                name, prefix = inner["name"], _snake_case(value["class_name"])
                found.append((name, prefix if re.fullmatch(rf"{re.escape(prefix)}(_\d+)?", name) else None))
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)

    collect(config)
    kept = {name for name, prefix in found if prefix is None}  # the factory's own: never given to another
    given: dict[str, str] = {}
    counts: dict[str, int] = {}
    for name, prefix in found:
        if prefix is None or name in given:
            continue
        while True:
            count = counts.get(prefix, 0)
            counts[prefix] = count + 1
            candidate = prefix if count == 0 else f"{prefix}_{count}"
            if candidate not in kept:
                break
        given[name] = candidate

    def renamed(value: Any, naming: bool = False) -> Any:
        """Strings in name positions only (a layer's ``name``, the layers a tensor or the model's inputs
        and outputs come from): an activation ``tanh`` stays, whatever a ``keras.ops.tanh`` is called."""
        if isinstance(value, dict):
            return {k: renamed(v, naming or k in _NAMING_KEYS) for k, v in value.items()}
        if isinstance(value, list):
            return [renamed(v, naming) for v in value]
        return given.get(value, value) if naming and isinstance(value, str) else value

    return renamed(config)


def _snake_case(name: str) -> str:
    """A class name as Keras names its instances by default (``keras.src.utils.naming.to_snake_case``)."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def weights_digest(arrays: Iterable[Any]) -> str:
    """sha256 over arrays' dtypes, shapes and values, in their order (a built model's weights)."""
    import numpy as np

    digest_ = hashlib.sha256()
    for array in arrays:
        value = np.ascontiguousarray(array)
        digest_.update(f"{value.dtype.str}{value.shape}".encode())
        digest_.update(value.tobytes())
    return digest_.hexdigest()


def architecture_digest(config: Any) -> str:
    """sha256 of a Keras configuration, names replaced by their order and ignored keys left out."""
    return hashlib.sha256(json.dumps(without_names(config), sort_keys=True).encode()).hexdigest()


def _identity(kind: str, config: Any = None, weights: str | None = None, code: str | None = None) -> dict[str, Any]:
    architecture = None if config is None else architecture_digest(config)
    return {"kind": kind, "architecture": architecture, "weights": weights, "code": code,
            "architecture_config": config}


def stored(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity without its ``architecture_config`` (which a shard stores apart): what is compared."""
    return {key: value for key, value in identity.items() if key != "architecture_config"}


def digest(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(stored(identity), sort_keys=True).encode()).hexdigest()


def without_names(config: Any) -> Any:
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


def layers_of(config: Any) -> list[dict] | None:
    """The layers a model configuration lists (None for a subclassed model's, whose layers are in code)."""
    inner = config.get("config") if isinstance(config, dict) else None
    layers = inner.get("layers") if isinstance(inner, dict) else None
    return layers if isinstance(layers, list) else None


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


def _factory_code(factory: str, modules: Iterable[str] = ()) -> str:
    """sha256 of the factory module's source file (found, not executed), the callable's name, and the
    source files of ``modules`` found on ``sys.path`` (a built model's class's: others, Keras' say, are
    left out)."""
    module_name, _, attr = factory.partition(":")
    origin = _module_file(module_name)
    if origin is None or not os.path.isfile(origin):
        raise ModelError(f"model.factory {factory!r}: cannot find the module {module_name!r} (on sys.path)")
    digest_ = hashlib.sha256()
    with open(origin, "rb") as stream:
        digest_.update(stream.read() + b"\0" + attr.encode())
    for name in sorted(set(modules) - {module_name}):
        found = None if name.split(".")[0] in ("keras", "tensorflow", "builtins", "__main__") else _module_file(name)
        if found is not None and os.path.isfile(found):
            with open(found, "rb") as stream:
                digest_.update(b"\0" + name.encode() + b"\0" + stream.read())
    return digest_.hexdigest()


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
