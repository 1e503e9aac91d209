"""Loading the model to differentiate: a Keras file, a SavedModel, a Python factory or a built-in.

Imports TensorFlow, so only workers (in ``setup()``) and tests import this module.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from transforms.errors import ModelError

BUILTIN_SEED = 0


@dataclass
class LoadedModel:
    """A model ready to call on a batch: ``call(x[n, *input_shape]) -> y[n, *output_shape]``."""

    call: Callable[[tf.Tensor], tf.Tensor]
    variables: list[tf.Variable]
    source: str
    input_shape: tuple[int | None, ...] | None = None  # per sample, where the model declares it
    keras_model: Any = None  # the Keras model itself, when it is one (``jacobeam verify`` clones it in float64)

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


BUILTINS: dict[str, Callable[..., keras.Model]] = {"mlp": build_mlp, "cnn": build_cnn}


def _from_object(obj: Any, source: str) -> LoadedModel:
    if isinstance(obj, keras.Model):
        declared = obj.input_shape if isinstance(obj.input_shape, tuple) else None  # one input only
        return LoadedModel(
            lambda x: obj(x, training=False), list(obj.weights), source, declared[1:] if declared else None, obj
        )
    if callable(obj):
        return LoadedModel(obj, _variables(obj), source)
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
        return LoadedModel(fn, _variables(loaded), path)
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
    return LoadedModel(lambda x: signature(**{input_name: x})[output_name], _variables(loaded), path)


def load(path: str | None = None, factory: str | None = None, builtin: str | None = None) -> LoadedModel:
    """Load a model from exactly one source (see ``pipeline.config.ModelConfig``)."""
    if builtin is not None:
        return _from_object(BUILTINS[builtin](), f"builtin:{builtin}")
    if factory is not None:
        module_name, _, attr = factory.partition(":")
        try:
            build = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ModelError(f"model.factory {factory!r}: cannot import: {err}") from err
        return _from_object(build(), f"factory:{factory}")
    assert path is not None
    if not tf.io.gfile.exists(path):
        raise ModelError(f"model.path {path}: no such file or directory")
    if path.endswith(".keras") or path.endswith(".h5"):
        # safe_mode stays on: a model file must not run arbitrary code when loaded. There is deliberately
        # no option to turn it off: code to run belongs in a factory the config names (model.factory).
        # With safe_mode Keras also never imports a module that the file's config names: a layer class
        # must already be registered (by a module the user imported, e.g. through model.factory).
        try:
            model = keras.models.load_model(path, compile=False, safe_mode=True)
        except Exception as err:  # Keras raises ValueError, TypeError, ... for files it cannot rebuild
            if "safe_mode" not in str(err):
                raise ModelError(f"model.path {path}: cannot load: {type(err).__name__}: {str(err)[:500]}") from err
            raise ModelError(
                f"model.path {path}: refused: loading it would run Python code stored in the file (Keras "
                "safe_mode). Build such a model in a Python function and name it in model.factory instead"
            ) from err
        return _from_object(model, path)
    if tf.io.gfile.isdir(path):
        return _load_saved_model(path)
    raise ModelError(f"model.path {path}: expected a .keras file or a SavedModel directory")
