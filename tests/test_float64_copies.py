"""Float64 copies of Keras models (``LoadedModel.with_dtype``, the self-check's "float64 truth"): every
model in ``keras.applications`` gets one that computes in float64 throughout and gives the float32
model's outputs to float32 round-off; one that cannot be built is a one-line ``ModelError``; and
building one leaves Keras' default dtype policy and ``floatx`` as they were.

Each architecture is built with no weights downloaded, at the smallest square input it accepts (32x32, or
the size its error names: 71 for Xception, 75 for the Inceptions), with 10 logits (no softmax), and
seeded weights (``seeded_weights``). Its BatchNormalization statistics are then those of seeded images
(as a trained network's would be), so that the output depends on the input through the whole network:
with ``seeded_weights``' N(0, 0.1) moving variances (negative, NaN) or unit ones, the signal dies out in
many of these nets (MobileNet, EfficientNet), their logits are the last layer's biases whatever the
input, and agreeing outputs would check nothing but the head.

With live signal, some of these random nets are ill-conditioned: rounding the input image to float32
alone moves the float64 logits of ResNet152 by 1.5e-4 of their size (ResNet101, ResNet101V2, ResNet152V2,
InceptionV3: 2-4e-5), and the float32 model is 1e-4 to 4e-4 off the copy on the image tested (up to 2e-3
on others). So the copy must agree to 1e-4, or to 30 times what rounding the input does where that is
more; the other 35 nets agree to 2e-5 or better (ConvNeXt, VGG and Xception to 3e-6). A copy with a layer
still in float32 gives outputs as close, which is why the traced graph is checked op by op
(``foreign_float_op``); a weight in the wrong place or a layer rebuilt differently is off by O(1).

Slow (all of ``keras.applications``, one test each: 7 minutes; CI runs them), in spawned processes of
their own, ``PER_PROCESS`` models each: one process holding them all reached 10 GB, which the test worker
then kept for the rest of the run beside the other files it ran, until the kernel killed it. The fast
tests are ConvNeXtTiny (which could not be rebuilt before: its ``inputs + x`` is a ``keras.ops`` call,
its LayerScale carries a DTypePolicy dict, its stem is a Sequential with an input of its own) and small
models for what ``keras.applications`` does not have.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from jacobeam.transforms.engine.models import seeded_weights, wrap_model
from jacobeam.transforms.engine.reference import foreign_float_op
from jacobeam.transforms.errors import ModelError

# Every architecture keras.applications exports (its constructors are its capitalised names; the
# lower-case ones are its modules), so that one added in a new Keras version is covered.
APPLICATIONS = sorted(name for name in dir(keras.applications) if name[:1].isupper())
FAST = "ConvNeXtTiny"
TOLERANCE = 1e-4  # relative to the largest logit, for a well-conditioned net (most of the list: the docstring)
ROUNDOFF = 30  # times what rounding the input to float32 does: the allowance of an ill-conditioned one
PER_PROCESS = 6  # slow checks per spawned process: a few GB at most, one TensorFlow import per six models


def _application(name: str) -> keras.Model:
    """``keras.applications.<name>``, not downloaded, 10 logits, at the smallest square input it accepts."""
    size = 32
    while True:
        try:
            return getattr(keras.applications, name)(
                weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
            )
        except ValueError as err:  # "Input size must be at least 75x75; Received: ..."
            smallest = re.search(r"at least (\d+)x\d+", str(err))
            if smallest is None or int(smallest.group(1)) <= size:
                raise
            size = int(smallest.group(1))


def _layers(layer):
    """``layer`` and every layer of the models nested in it."""
    yield layer
    for inner in getattr(layer, "layers", None) or []:
        yield from _layers(inner)


def _images(model: keras.Model, count: int, seed: int) -> np.ndarray:
    """Seeded float32 images of pixel values 0-255 (what models with their own preprocessing expect)."""
    return np.random.default_rng(seed).uniform(0, 255, (count, *model.inputs[0].shape[1:])).astype(np.float32)


def _seeded(model: keras.Model) -> None:
    """``seeded_weights``, then BatchNormalization as in a trained network: scales 1 + that draw, and the
    moving statistics those of 32 seeded images (one training-mode pass with momentum 0), each variance at
    least a tenth of its layer's mean one (channels nearly constant over the images would otherwise divide
    by ~sqrt(epsilon) and amplify round-off a hundredfold). A Normalization layer's variances are made
    positive (``seeded_weights`` draws them from N(0, 0.1))."""
    seeded_weights(model, 0)
    rng = np.random.default_rng(1)
    norms = []
    for layer in _layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            norms.append(layer)
            layer.set_weights([1.0 + w if v.name == "gamma" else w for w, v in zip(layer.get_weights(), layer.weights)])
        elif isinstance(layer, keras.layers.Normalization) and layer.weights:  # not adapted: mean, variance, count
            weights = [rng.uniform(0.5, 1.5, w.shape) if v.name == "variance" else w
                       for w, v in zip(layer.get_weights(), layer.weights)]
            layer.set_weights([w.astype(v.dtype) for w, v in zip(weights, layer.weights)])
    if not norms:
        return
    momenta = [layer.momentum for layer in norms]
    for layer in norms:
        layer.momentum = 0.0
    model(_images(model, 32, seed=2), training=True)
    for layer, momentum in zip(norms, momenta):
        layer.momentum = momentum
        layer.set_weights([np.maximum(w, 0.1 * w.mean()) if v.name == "moving_variance" else w
                           for w, v in zip(layer.get_weights(), layer.weights)])


def _keras_state() -> tuple[str, str]:
    return keras.config.dtype_policy().name, keras.config.floatx()


def _check_float64_copy(name: str) -> None:
    """``name``'s float64 copy computes in float64 only and gives its float32 outputs to round-off."""
    model = _application(name)
    _seeded(model)
    loaded = wrap_model(model, f"keras.applications.{name}")
    before = _keras_state()
    twin = loaded.with_dtype("float64")
    assert _keras_state() == before
    assert twin.keras_model is not model

    shape = tuple(model.inputs[0].shape[1:])
    traced = tf.function(lambda x: twin.call([x]), autograph=False).get_concrete_function(
        tf.TensorSpec((1, *shape), tf.float64)
    )
    foreign = foreign_float_op(traced.graph, "float64")
    assert foreign is None, f"{name}: the float64 copy still computes {foreign}"

    x, other = _images(model, 2, seed=3)[:, None]
    y32 = loaded.call([tf.constant(x)]).numpy().astype(np.float64)
    y64 = traced(tf.constant(x, tf.float64))
    assert y64.dtype == tf.float64
    y64 = y64.numpy()
    scale = np.max(np.abs(y64))

    def moved(image: np.ndarray) -> float:
        """How far the copy's logits at ``image`` are from those at ``x``, relative to the largest."""
        return float(np.max(np.abs(traced(tf.constant(image, tf.float64)).numpy() - y64)) / scale)

    # What rounding the image to float32 alone does to the logits (each pixel moved by half a float32 ulp,
    # random signs, the worse of two draws): the model's own amplification of round-off, to which float32
    # arithmetic in every layer adds. Most of these nets amplify it little; ResNet152, 2,500 times.
    signs = np.random.default_rng(4).choice([-1.0, 1.0], (2, *x.shape))
    rounding = max(moved(x * (1 + np.finfo(np.float32).eps / 2 * s)) for s in signs)
    error = np.max(np.abs(y64 - y32)) / scale
    allowed = max(TOLERANCE, ROUNDOFF * rounding)
    assert np.isfinite(y64).all() and error < allowed, (
        f"{name}: the float64 copy is {error:.1e} off the float32 model (allowed {allowed:.1e}: rounding the "
        f"input to float32 moves it by {rounding:.1e})"
    )
    assert error > 0, f"{name}: the float64 copy's outputs are the float32 model's, bit for bit"
    assert moved(other) > 1e-2, f"{name}: another image moves the logits by {moved(other):.1e} only (no signal to compare)"


@pytest.fixture(scope="module")
def own_processes():
    """One spawned process at a time, replaced after ``PER_PROCESS`` checks; shut down with the module."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=PER_PROCESS) as pool:
        yield pool


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in APPLICATIONS if name != FAST])
def test_every_keras_application_has_a_float64_copy(name, own_processes):
    own_processes.submit(_check_float64_copy, name).result()  # its assertion, raised here


def test_convnext_tiny_has_a_float64_copy():
    assert FAST in APPLICATIONS
    _check_float64_copy(FAST)


class _Scale(keras.layers.Layer):
    """A layer whose sublayer, a Dense, is created without the layer's dtype (Keras' default policy) and
    whose config carries another layer's config (rebuilt by from_config)."""

    def __init__(self, inner: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.deserialize(inner) if inner else keras.layers.Dense(4, dtype=self.dtype_policy)
        self.extra = keras.layers.Dense(4, use_bias=False)

    def call(self, x):
        return self.inner(x) * self.extra(x)

    def get_config(self):
        return {**super().get_config(), "inner": keras.layers.serialize(self.inner)}


def test_nested_dtypes_are_replaced_and_integer_ones_kept():
    """Dtypes in every form and place: a nested Functional model and a Sequential one without an input of
    its own, a wrapper's layer, a custom layer's sublayers (one in its config, one created with the default
    policy), a mixed_float16 layer, a ``keras.ops.cast`` to float32, and an integer input through an
    Embedding (which stays int32)."""
    numbers, tokens = keras.Input((3, 4), name="numbers"), keras.Input((3,), dtype="int32", name="tokens")
    inner_in = keras.Input((3, 4))
    inner = keras.Model(inner_in, keras.layers.Dense(4, activation="tanh")(inner_in), name="inner")
    stack = keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.LayerNormalization()], name="stack")
    h = keras.layers.TimeDistributed(keras.layers.Dense(4))(inner(numbers))
    h = stack(h) + keras.layers.Embedding(10, 4)(tokens)
    h = keras.ops.cast(_Scale()(h), "float32")
    out = keras.layers.Dense(2, dtype="mixed_float16")(keras.layers.Flatten()(h))
    model = keras.Model([numbers, tokens], out)
    seeded_weights(model, 0)
    before = _keras_state()
    twin = wrap_model(model, "nested").with_dtype("float64")
    assert _keras_state() == before
    assert [t.dtype for t in twin.keras_model.inputs] == ["float64", "int32"]

    specs = [tf.TensorSpec((2, 3, 4), tf.float64), tf.TensorSpec((2, 3), tf.int32)]
    traced = tf.function(lambda a, b: twin.call([a, b]), autograph=False).get_concrete_function(*specs)
    assert foreign_float_op(traced.graph, "float64") is None
    rng = np.random.default_rng(0)
    x, t = rng.normal(size=(2, 3, 4)), rng.integers(0, 10, (2, 3)).astype(np.int32)
    y64 = traced(tf.constant(x), tf.constant(t)).numpy()
    y32 = wrap_model(model, "nested").call([tf.constant(x, tf.float32), tf.constant(t)]).numpy()
    # float16 for the mixed_float16 layer's output: its round-off, not float32's
    np.testing.assert_allclose(y64, y32, rtol=0, atol=1e-2 * np.max(np.abs(y64)))


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_a_quantized_model_is_a_one_line_model_error_naming_the_layer():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="hidden"), keras.layers.Dense(2)])
    model.quantize("int8")
    before = _keras_state()
    with pytest.raises(ModelError, match=r"layer 'hidden' \(Dense\) .*'int8_from_float32' is quantized") as err:
        wrap_model(model, "quantized.keras").with_dtype("float64")
    assert "\n" not in str(err.value) and str(err.value).startswith("quantized.keras: ")
    assert _keras_state() == before


class _NoConfig(keras.layers.Layer):
    """Takes an argument, but no ``**kwargs``, and has no ``get_config``: Keras cannot rebuild it."""

    def __init__(self, units):
        super().__init__(name="odd")
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)


def test_a_layer_without_a_config_is_a_model_error_and_the_policy_is_restored():
    x = keras.Input((4,))
    model = keras.Model(x, _NoConfig(3)(x))
    before = _keras_state()
    with pytest.raises(ModelError, match=r"layer 'odd' \(_NoConfig\) cannot be rebuilt from its config: "):
        wrap_model(model, "factory:m").with_dtype("float64")
    assert _keras_state() == before  # the error was raised while the float64 default was in force


def test_a_subclassed_model_is_a_model_error():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(np.ones((1, 4), np.float32))
    with pytest.raises(ModelError, match="Subclassed is not a Functional or Sequential model"):
        wrap_model(model, "factory:m").with_dtype("float64")
