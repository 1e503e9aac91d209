"""Loading the model to differentiate: a Keras file, a SavedModel, a Python factory or a built-in.

Imports TensorFlow, so only workers (in ``setup()``) and tests import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from jacobeam.transforms.errors import ModelError, first_line

BUILTIN_SEED = 0


@dataclass
class LoadedModel:
    """A model ready to call on a batch.

    ``call(xs)`` takes a list with one tensor ``(n, *input_shape_k)`` per model input, in the order of
    ``input_names``, and returns one tensor ``(n, *output_shape)``.
    """

    call: Callable[[list[tf.Tensor]], tf.Tensor]
    variables: list[tf.Variable]
    source: str
    input_names: tuple[str, ...] = ("x",)
    input_shapes: tuple[tuple[int | None, ...], ...] | None = None  # per sample, where the model declares them
    keras_model: keras.Model | None = None
    # ``transforms.model_identity.model_identity`` of the source it was loaded from (``load`` sets it);
    # None for a model wrapped by hand.
    identity: dict[str, Any] | None = None

    def with_dtype(self, dtype: str) -> LoadedModel:
        """The same model computing in ``dtype`` (a float64 twin with identical weights, say)."""
        if self.keras_model is None:
            if dtype == "float32":
                return self
            raise ModelError(f"{self.source}: compute_dtype {dtype} needs a Keras model (this one is not)")
        if self.keras_model.dtype == dtype:
            return self
        try:
            twin = _keras_in_dtype(self.keras_model, dtype)
        except (ValueError, TypeError) as err:  # Lambda layers under safe_mode, layers without a config
            raise ModelError(
                f"{self.source}: cannot rebuild the model in {dtype} (compute_dtype: {dtype}): {first_line(err)}"
            ) from err
        return dataclasses.replace(wrap_model(twin, self.source), identity=self.identity)

    def with_logits(self) -> LoadedModel:
        """The same model without its last layer's softmax (``without_softmax``), computing its logits."""
        return dataclasses.replace(wrap_model(without_softmax(self.keras_model, self.source), self.source),
                                   identity=self.identity)

    def fingerprint(self) -> str:
        """sha256 over the model's weights (shapes, dtypes and values, in the model's order)."""
        digest = hashlib.sha256()
        for variable in self.variables:
            value = np.ascontiguousarray(variable.numpy())
            digest.update(f"{value.dtype.str}{value.shape}".encode())
            digest.update(value.tobytes())
        return digest.hexdigest()


def seeded_weights(model: keras.Model, seed: int) -> None:
    """Deterministic weights from numpy, so every framework and run sees identical numbers."""
    rng = np.random.default_rng(seed)
    weights = []
    for weight in model.get_weights():
        if weight.ndim == 1:
            weights.append(rng.normal(0.0, 0.1, weight.shape))
        else:
            fan_in = int(np.prod(weight.shape[:-1]))
            weights.append(rng.normal(0.0, 1.0 / np.sqrt(fan_in), weight.shape))
    model.set_weights([w.astype(model.dtype) for w in weights])


def build_mlp(seed: int = BUILTIN_SEED, dtype: str = "float32") -> keras.Model:
    """Workload W1: x[784] -> Dense 512 tanh -> Dense 512 tanh -> Dense 10."""
    model = keras.Sequential(
        [
            keras.Input((784,), dtype=dtype),
            keras.layers.Dense(512, activation="tanh", dtype=dtype),
            keras.layers.Dense(512, activation="tanh", dtype=dtype),
            keras.layers.Dense(10, dtype=dtype),
        ],
        name="builtin_mlp",
    )
    seeded_weights(model, seed)
    return model


def build_cnn(seed: int = BUILTIN_SEED, dtype: str = "float32") -> keras.Model:
    """Workload W2: x[28, 28, 1] -> two 3x3 valid convs (32, 64, relu) -> maxpool 2 -> Dense 128 -> 10."""
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1), dtype=dtype),
            keras.layers.Conv2D(32, 3, activation="relu", dtype=dtype),
            keras.layers.Conv2D(64, 3, activation="relu", dtype=dtype),
            keras.layers.MaxPooling2D(2, dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(128, activation="relu", dtype=dtype),
            keras.layers.Dense(10, dtype=dtype),
        ],
        name="builtin_cnn",
    )
    seeded_weights(model, seed)
    return model


def build_cifar_resnet(seed: int = BUILTIN_SEED, dtype: str = "float32", blocks: int = 3,
                       widths: tuple[int, ...] = (16, 32, 64)) -> keras.Model:
    """A CIFAR-size ResNet (the default, ResNet-20: 0.27M weights; ``blocks=2, widths=(64, 128, 256, 512)``,
    ResNet-18: 11M): x[32, 32, 3] -> conv ``widths[0]`` -> a stage of ``blocks`` basic residual blocks per
    width (BatchNorm, ReLU; stride 2 and a 1x1 shortcut where the width changes) -> global average pool ->
    Dense 10 (logits). BatchNorm runs in inference mode with seeded statistics."""
    layers = keras.layers

    def conv(x, name, width, stride=1, size=3):
        return layers.Conv2D(width, size, strides=stride, padding="same", use_bias=False, dtype=dtype, name=name)(x)

    def norm(x, name):
        return layers.BatchNormalization(dtype=dtype, name=name)(x)

    inputs = keras.Input((32, 32, 3), dtype=dtype)
    x = layers.ReLU(dtype=dtype)(norm(conv(inputs, "stem_conv", widths[0]), "stem_bn"))
    for stage, width in enumerate(widths):
        for block in range(blocks):
            at, stride = f"stage{stage + 1}_block{block + 1}", 2 if stage and not block else 1
            y = layers.ReLU(dtype=dtype)(norm(conv(x, f"{at}_conv1", width, stride), f"{at}_bn1"))
            y = norm(conv(y, f"{at}_conv2", width), f"{at}_bn2")
            shortcut = norm(conv(x, f"{at}_shortcut", width, stride, size=1), f"{at}_shortcut_bn") if stride != 1 else x
            x = layers.ReLU(dtype=dtype)(layers.Add(dtype=dtype)([y, shortcut]))
    x = layers.GlobalAveragePooling2D(dtype=dtype)(x)
    model = keras.Model(inputs, layers.Dense(10, dtype=dtype, name="logits")(x), name="builtin_cifar_resnet")
    seeded_weights(model, seed)
    seeded_batchnorm(model, seed + 1)
    return model


def seeded_batchnorm(model: keras.Model, seed: int) -> None:
    """BatchNormalization layers given seeded statistics a trained net has (scales near 1, positive
    variances; ``seeded_weights`` draws every vector near 0)."""
    rng = np.random.default_rng(seed)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.gamma.shape[0]
            values = (1.0 + rng.normal(0, 0.1, n), rng.normal(0, 0.1, n), rng.normal(0, 0.1, n),
                      1.0 + np.abs(rng.normal(0, 0.1, n)))
            layer.set_weights([v.astype(model.dtype) for v in values])


BUILTINS: dict[str, Callable[..., keras.Model]] = {"mlp": build_mlp, "cnn": build_cnn, "cifar_resnet": build_cifar_resnet}


def _keras_in_dtype(model: keras.Model, dtype: str) -> keras.Model:
    """A copy of the Functional or Sequential ``model`` computing in ``dtype``, with its weights cast.

    Each layer (and each ``keras.ops`` call of a functional model) is rebuilt from its config, in which every
    floating-point dtype is replaced by ``dtype``: a dtype name or a serialized ``DTypePolicy``, the layer's
    own and those of the layers nested in its config (a Sequential or Functional submodel and its inputs, a
    wrapper's layer). The copy is built with ``dtype`` as Keras' default dtype policy, for the sublayers a
    layer creates without passing its dtype on; the previous default (thread-local in Keras) is restored
    after, also on error, and ``floatx`` is never changed. Each rebuilt layer then gets its original's
    weights, cast to its variables' dtypes (integer ones, a counter say, stay integers). What cannot be
    rebuilt raises a one-line ValueError naming the layer and why.
    """

    def retyped(config: Any, layer: str) -> Any:
        """``config`` (of the layer named ``layer``) with each floating-point dtype in it, at any depth,
        replaced by ``dtype``."""
        if isinstance(config, list | tuple):
            return type(config)(retyped(item, layer) for item in config)
        if not isinstance(config, dict):
            return config
        new = {key: retyped(value, layer) for key, value in config.items() if key != "dtype"}
        if "dtype" not in config:
            return new
        try:
            policy = None if config["dtype"] is None else keras.dtype_policies.get(config["dtype"])
        except (ValueError, TypeError):  # not a dtype, an argument that happens to be called so: kept
            policy = None
        if getattr(policy, "quantization_mode", None) is not None:
            name = config.get("name", layer)
            whose = "its" if name == layer else f"its sublayer {name!r}'s"
            raise ValueError(f"{whose} dtype policy {policy.name!r} is quantized: its weights cannot be cast to {dtype}")
        floating = policy is not None and keras.backend.is_float_dtype(policy.compute_dtype)
        return {**new, "dtype": dtype if floating else config["dtype"]}

    rebuilt = []  # (original layer, its copy)

    def clone_layer(layer: Any) -> Any:
        try:
            copy = layer.__class__.from_config(retyped(layer.get_config(), layer.name))
        except Exception as err:  # no get_config, a class Keras cannot find or will not load (safe_mode), ...
            reason = first_line(ValueError(str(err).rpartition("Exception encountered: ")[2]))  # Keras' wrapping
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) cannot be rebuilt from its config: {reason}"
            ) from err
        if isinstance(layer, keras.layers.Layer):  # not a stateless keras.ops operation
            rebuilt.append((layer, copy))
        return copy

    try:
        declared = model.inputs
    except AttributeError:  # a subclassed model
        declared = None
    if not declared:
        raise ValueError(
            f"{type(model).__name__} is not a Functional or Sequential model with declared inputs (keras.Input): "
            f"only those can be rebuilt in {dtype}"
        )
    inputs = [
        keras.Input(shape=t.shape[1:], dtype=dtype if keras.backend.is_float_dtype(t.dtype) else t.dtype, name=t.name)
        for t in declared
    ]
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        twin = keras.models.clone_model(
            model, input_tensors=inputs[0] if len(inputs) == 1 else inputs, clone_function=clone_layer
        )
    finally:
        keras.config.set_dtype_policy(previous)
    for layer, copy in rebuilt:
        if len(copy.weights) != len(layer.weights):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) rebuilt from its config has {len(copy.weights)} "
                f"weights, not {len(layer.weights)}"
            )
        copy.set_weights([np.asarray(w.numpy()).astype(v.dtype) for w, v in zip(layer.weights, copy.weights)])
    return twin


def _activation_name(layer: Any) -> str | None:
    """The name of a layer's activation (``softmax``, ``linear``, ...), or None if it has none."""
    activation = getattr(layer, "activation", None)
    if activation is None:
        return None
    try:
        name = keras.activations.serialize(activation)
    except (TypeError, ValueError):  # a callable Keras cannot name
        name = None
    if isinstance(name, dict):  # a registered custom activation
        name = name.get("config") if isinstance(name.get("config"), str) else name.get("class_name")
    return name if isinstance(name, str) else getattr(activation, "__name__", type(activation).__name__)


def last_activation(keras_model: keras.Model | None) -> str | None:
    """The activation the model's outputs end in: ``softmax`` for a last ``Softmax`` layer, the activation's
    name for a layer with one (``sigmoid``, ``linear``, ...); None where there is none or no Keras model."""
    if keras_model is None:
        return None
    try:
        last = keras_model.outputs[0]._keras_history.operation
    except (AttributeError, IndexError, ValueError, TypeError):
        layers = getattr(keras_model, "layers", None) or []
        last = layers[-1] if layers else None
    if last is None:
        return None
    return "softmax" if type(last).__name__ == "Softmax" else _activation_name(last)


def without_softmax(model: keras.Model, source: str = "the model") -> keras.Model:
    """A new functional model computing ``model``'s logits: its last layer's softmax removed (``model.logits``).

    A last layer with ``activation='softmax'`` (``Dense``, a convolution, ...) is rebuilt from its config with
    a linear activation and given the same weights; a last ``Softmax`` layer (or ``keras.ops.softmax``) or
    ``Activation('softmax')`` layer is dropped, the outputs taken from its input. ``model`` itself is not
    changed, and the new model survives ``get_config``/``from_config`` (the float64 twin of ``with_dtype``).
    Anything else raises a one-line ``ModelError``.
    """
    prefix = f"model.logits: {source}"
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        outputs = None
    if not outputs:
        raise ModelError(f"{prefix}: the model has no defined outputs (declare its inputs with keras.Input)")
    if len(outputs) != 1:
        raise ModelError(f"{prefix}: the model has {len(outputs)} outputs; logits need a model with one output")
    history = outputs[0]._keras_history
    last = history.operation
    described = f"its last layer {last.name!r} ({type(last).__name__})"
    node = last._inbound_nodes[history.node_index]
    inputs = node.input_tensors
    if len(inputs) != 1:
        raise ModelError(f"{prefix}: {described} takes {len(inputs)} inputs; expected one")
    activation = _activation_name(last)
    if type(last).__name__ == "Softmax" or (isinstance(last, keras.layers.Activation) and activation == "softmax"):
        logits = inputs[0]
    elif activation == "softmax" and "activation" in last.get_config():
        linear = last.__class__.from_config({**last.get_config(), "activation": "linear"})
        logits = linear(inputs[0])
        linear.set_weights(last.get_weights())
    else:
        has = "no activation" if activation is None else f"activation {activation!r}"
        raise ModelError(f"{prefix}: {described} has {has}, not softmax: there are no logits to take")
    # One input as a tensor, several as a list: the structure wrap_model calls and _keras_in_dtype clones.
    inputs = model.inputs[0] if len(model.inputs) == 1 else list(model.inputs)
    return keras.Model(inputs, logits, name=f"{model.name}_logits")


def wrap_model(obj: Any, source: str) -> LoadedModel:
    """A Keras model, or any callable taking one batch tensor, as a ``LoadedModel``."""
    if isinstance(obj, keras.Model):
        inputs = getattr(obj, "inputs", None) or []  # a subclassed model has none
        if len(inputs) > 1:
            return LoadedModel(
                lambda xs: obj(list(xs), training=False),
                list(obj.weights),
                source,
                input_names=tuple(t.name for t in inputs),
                input_shapes=tuple(tuple(t.shape[1:]) for t in inputs),
                keras_model=obj,
            )
        declared = (tuple(inputs[0].shape[1:]),) if inputs else None
        return LoadedModel(
            lambda xs: obj(xs[0], training=False), list(obj.weights), source,
            input_shapes=declared, keras_model=obj,
        )
    if callable(obj):
        return LoadedModel(lambda xs: obj(xs[0]), _variables(obj), source)
    raise ModelError(f"{source}: expected a Keras model or a callable tf.Module, got {type(obj).__name__}")


def _variables(obj: Any) -> list[tf.Variable]:
    """Every variable an object tracks, in a deterministic order (restored SavedModel objects have no
    ``.variables`` unless the saved object had one)."""
    found = getattr(obj, "variables", None)
    if found is not None:
        return list(found)
    if not isinstance(obj, tf.__internal__.tracking.Trackable):
        return []  # a plain function: no weights to fingerprint
    descendants = tf.train.TrackableView(obj).descendants()
    return [item for item in descendants if isinstance(item, tf.Variable)]


def _load_saved_model(path: str) -> LoadedModel:
    loaded = tf.saved_model.load(path)
    # Keras' ``model.export()`` saves a ``serve`` endpoint; ``tf.saved_model.save(module)`` keeps
    # ``__call__`` when it was a tf.function; anything else is served through its signature.
    fn = getattr(loaded, "serve", None) or (loaded if callable(loaded) else None)
    if fn is not None:
        return LoadedModel(lambda xs: fn(xs[0]), _variables(loaded), path)
    signature = loaded.signatures.get("serving_default")
    if signature is None:
        raise ModelError(f"{path}: SavedModel has no 'serve' function and no 'serving_default' signature")
    inputs = signature.structured_input_signature[1]
    outputs = signature.structured_outputs
    if len(inputs) != 1 or len(outputs) != 1:
        raise ModelError(
            f"{path}: serving_default takes {sorted(inputs)} and returns {sorted(outputs)}; "
            "expected one input and one output"
        )
    (input_name,), (output_name,) = inputs, outputs
    return LoadedModel(lambda xs: signature(**{input_name: xs[0]})[output_name], _variables(loaded), path)


def _unreadable_model_file(path: str) -> str | None:
    """Why a Keras model file cannot be what it says, in a few words, or None. Keras itself reports a
    truncated or corrupt ``.keras`` file as "File not found"."""
    try:
        with tf.io.gfile.GFile(path, "rb") as stream:
            if path.endswith(".keras"):
                try:
                    with zipfile.ZipFile(stream) as archive:
                        names = archive.namelist()
                except (zipfile.BadZipFile, EOFError, OSError, tf.errors.OpError):  # too short to seek in, say
                    return "not a zip archive (a .keras file is one): truncated or corrupt"
                if "config.json" not in names:
                    return "the zip archive holds no config.json (not a Keras model file)"
            elif stream.read(8) != b"\x89HDF\r\n\x1a\n":  # a legacy .h5 model (no user block)
                return "not an HDF5 file: truncated or corrupt"
    except (OSError, tf.errors.OpError) as err:
        return f"cannot be read: {first_line(err)}"
    return None


# A Keras file the launcher loaded to check it (``pipeline.checks``), kept for the first engine this process
# builds from the same file unchanged: a fresh local run loaded it twice (ResNet50's .keras: 1.7-2.3 s each).
# One taker, then it is gone: engines on several threads do not share one Keras model. A factory's model
# is never kept: one that draws new weights on each call is refused because it is built twice.
_kept: tuple[tuple, LoadedModel] | None = None
_kept_lock = threading.Lock()


def _file_state(path: str | None, logits: bool) -> tuple | None:
    """What says a local Keras file's bytes are unchanged without reading them (a write changes its
    modification and change times, a replacement its inode); None for other sources."""
    if path is None or "://" in path or not path.endswith((".keras", ".h5")):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), logits, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _take_kept(state: tuple | None) -> LoadedModel | None:
    global _kept
    with _kept_lock:
        if state is None or _kept is None or _kept[0] != state:
            return None
        loaded, _kept = _kept[1], None
        return loaded


def forget_kept() -> None:
    """Drop a model ``load(keep=True)`` kept and no engine took (a run's end)."""
    global _kept
    with _kept_lock:
        _kept = None


def load(
    path: str | None = None, factory: str | None = None, builtin: str | None = None, logits: bool = False,
    keep: bool = False,
) -> LoadedModel:
    """Load a model from exactly one source (see ``pipeline.config.ModelConfig``); with ``logits``, the
    model without its last layer's softmax (``without_softmax``). ``keep``: a Keras file's model is also
    kept for the next ``load`` of the same file in this process, if the file is unchanged by then (the
    launcher's check hands it to the run's in-process engine; ``forget_kept`` drops it)."""
    global _kept
    state = _file_state(path, logits) if factory is None and builtin is None else None
    kept = _take_kept(state)
    if kept is not None:
        return kept
    loaded = _loaded(path, factory, builtin, logits)
    if keep and state is not None and _file_state(path, logits) == state:  # unchanged while it was read
        with _kept_lock:
            _kept = (state, loaded)
    return loaded


def _loaded(path: str | None, factory: str | None, builtin: str | None, logits: bool) -> LoadedModel:
    from jacobeam.transforms.model_identity import model_identity
    from jacobeam.transforms.spec import ModelSource

    loaded = _load(path, factory, builtin)  # first: its errors name what is wrong with the file
    # A factory's: that of the model it built, as the launcher's (``pipeline.checks``) and every worker's.
    identity = model_identity(ModelSource(path, factory, builtin, logits), built=loaded)
    loaded = dataclasses.replace(loaded, identity=identity)
    if not logits:
        return loaded
    if loaded.keras_model is None:
        raise ModelError(
            f"model.logits: {loaded.source} is not a Keras model (a SavedModel or tf.Module): its softmax cannot "
            "be removed; load a Keras model (.keras file or factory), or set model.logits false"
        )
    return loaded.with_logits()


def _load(path: str | None, factory: str | None, builtin: str | None) -> LoadedModel:
    if builtin is not None:
        return wrap_model(BUILTINS[builtin](), f"builtin:{builtin}")
    if factory is not None:
        module_name, _, attr = factory.partition(":")
        try:
            build = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ModelError(f"model.factory {factory!r}: cannot import: {err}") from err
        return wrap_model(build(), f"factory:{factory}")
    assert path is not None
    if not tf.io.gfile.exists(path):
        raise ModelError(f"model.path {path}: no such file or directory")
    if path.endswith(".keras") or path.endswith(".h5"):
        # safe_mode stays on: a model file must not run arbitrary code when loaded. There is deliberately
        # no option to turn it off: code to run belongs in a factory the config names (model.factory).
        # With safe_mode Keras also never imports a module that the file's config names: a layer class
        # must already be registered (by a module the user imported, e.g. through model.factory).
        problem = _unreadable_model_file(path)
        if problem:
            raise ModelError(f"model.path {path}: the file exists but cannot be read as a Keras model: {problem}")
        try:
            model = keras.models.load_model(path, compile=False, safe_mode=True)
        except Exception as err:  # Keras raises ValueError, TypeError, ... for files it cannot rebuild
            if "safe_mode" not in str(err):
                raise ModelError(f"model.path {path}: cannot load: {type(err).__name__}: {str(err)[:500]}") from err
            raise ModelError(
                f"model.path {path}: refused: loading it would run Python code stored in the file (Keras "
                "safe_mode). Build such a model in a Python function and name it in model.factory instead"
            ) from err
        return wrap_model(model, path)
    if tf.io.gfile.isdir(path):
        return _load_saved_model(path)
    raise ModelError(f"model.path {path}: expected a .keras file or a SavedModel directory")
