"""The benchmark workloads W1-W4 (see ``/work/shared/benchmarks.md``): layer lists, seeded numpy
weights and inputs, and the Keras builders that jacobeam's pipeline loads through ``model.factory``.

Weights are numpy arrays made once from a fixed seed; every framework (TF/Keras here, JAX and torch in
``benchmarks.peers``) is built from the same arrays, so all rows of a run compute the same function.
Only the Keras builders import Keras (lazily), so that peer rows do not pay for TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

WEIGHT_SEED = 0  # jacobeam's builtins use seed 0 too: W1/W2 weights equal build_mlp()/build_cnn()'s
INPUT_SEED = 1


@dataclass(frozen=True)
class Dense:
    units: int
    activation: str | None  # "tanh", "relu" or None


@dataclass(frozen=True)
class Conv:
    """3x3 convolution, valid padding, stride 1, channels last."""

    filters: int
    activation: str


@dataclass(frozen=True)
class MaxPool:
    """2x2 max-pool, stride 2."""


@dataclass(frozen=True)
class Flatten:
    """Row-major over (height, width, channels), as Keras flattens channels-last images."""


@dataclass(frozen=True)
class Coupling:
    """Affine coupling on x[d]: with x1, x2 = x[:d/2], x[d/2:], the first half goes through Dense
    ``hidden`` tanh -> Dense d, split into scale s and shift t; y = [x1, x2 * exp(s) + t]."""

    hidden: int


@dataclass(frozen=True)
class Permute:
    """y = x[perm] with a fixed seeded permutation of the features."""


Layer = Dense | Conv | MaxPool | Flatten | Coupling | Permute


@dataclass(frozen=True)
class Workload:
    key: str  # "W1"
    name: str  # "mlp": the name on the command line
    input_shape: tuple[int, ...]
    layers: tuple[Layer, ...]
    samples: int  # how many samples a full run computes

    @property
    def factory(self) -> str:
        """The ``model.factory`` string that builds this workload's Keras model."""
        return f"benchmarks.workloads:{BUILDERS[self.name]}"

    @property
    def output_shape(self) -> tuple[int, ...]:
        return _shapes(self.input_shape, self.layers)[-1]


def _coupled(hidden: int, count: int) -> tuple[Layer, ...]:
    layers: list[Layer] = []
    for index in range(count):
        layers += [Coupling(hidden)] + ([Permute()] if index < count - 1 else [])
    return tuple(layers)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("W1", "mlp", (784,), (Dense(512, "tanh"), Dense(512, "tanh"), Dense(10, None)), 2048),
        Workload(
            "W2",
            "cnn",
            (28, 28, 1),
            (Conv(32, "relu"), Conv(64, "relu"), MaxPool(), Flatten(), Dense(128, "relu"), Dense(10, None)),
            1024,
        ),
        Workload("W3", "wide", (16,), (Dense(256, "tanh"), Dense(256, "tanh"), Dense(512, None)), 2048),
        Workload("W4", "flow", (64,), _coupled(hidden=128, count=4), 2048),
    )
}
BUILDERS = {"mlp": "w1_mlp", "cnn": "w2_cnn", "wide": "w3_wide", "flow": "w4_flow"}


def _shapes(input_shape: tuple[int, ...], layers: tuple[Layer, ...]) -> list[tuple[int, ...]]:
    """The per-sample shape before each layer and after the last one."""
    shapes = [tuple(input_shape)]
    for layer in layers:
        shape = shapes[-1]
        if isinstance(layer, Dense):
            shape = (layer.units,)
        elif isinstance(layer, Conv):
            shape = (shape[0] - 2, shape[1] - 2, layer.filters)
        elif isinstance(layer, MaxPool):
            shape = (shape[0] // 2, shape[1] // 2, shape[2])
        elif isinstance(layer, Flatten):
            shape = (int(np.prod(shape)),)
        shapes.append(shape)
    return shapes


def _param_shapes(workload: Workload) -> list[list[tuple[int, ...]]]:
    """Per layer, the shapes of its weights in Keras' order (kernel, bias, ...)."""
    params = []
    for layer, shape in zip(workload.layers, _shapes(workload.input_shape, workload.layers)):
        if isinstance(layer, Dense):
            params.append([(shape[-1], layer.units), (layer.units,)])
        elif isinstance(layer, Conv):
            params.append([(3, 3, shape[-1], layer.filters), (layer.filters,)])
        elif isinstance(layer, Coupling):
            half = shape[0] // 2
            params.append([(half, layer.hidden), (layer.hidden,), (layer.hidden, shape[0]), (shape[0],)])
        else:
            params.append([])
    return params


def weights(workload: Workload, seed: int = WEIGHT_SEED) -> list[list[np.ndarray]]:
    """Per layer, its float32 weights (``Permute``: one int64 index array).

    Draws as ``transforms.engine.models.seeded_weights`` does (biases N(0, 0.1), kernels N(0, 1/fan_in)), in
    the same order, so W1 and W2 get exactly the weights of jacobeam's builtins ``mlp`` and ``cnn``.
    """
    rng = np.random.default_rng(seed)
    layers = []
    for shapes in _param_shapes(workload):
        drawn = []
        for shape in shapes:
            scale = 0.1 if len(shape) == 1 else 1.0 / np.sqrt(np.prod(shape[:-1]))
            drawn.append(rng.normal(0.0, scale, shape).astype(np.float32))
        layers.append(drawn)
    # Permutations from their own generator, so that adding one does not shift the weights' draws.
    perms = np.random.default_rng([seed, 1])
    for index, layer in enumerate(workload.layers):
        if isinstance(layer, Permute):
            layers[index] = [perms.permutation(workload.input_shape[0])]
    return layers


def inputs(workload: Workload, count: int, seed: int = INPUT_SEED) -> np.ndarray:
    """Standard-normal float32 samples: (count, *input_shape); the first k are the same for any count."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((count, *workload.input_shape), dtype=np.float32)


def flops_per_jacobian(workload: Workload) -> float | None:
    """Floating-point operations per sample (forward pass + Jacobian) in the cheapest contraction
    order, for a chain of Dense layers; ``None`` for other workloads.

    With layer widths d0..dL the forward pass costs sum(d_i d_{i+1}) multiply-adds. The Jacobian
    W_L D_{L-1} ... D_1 W_1 costs d_L * sum_{i<L-1} d_i d_{i+1} from the output side (the last
    kernel is the first factor, no product) or d_0 * sum_{i>0} d_i d_{i+1} from the input side.
    """
    if not all(isinstance(layer, Dense) for layer in workload.layers):
        return None
    widths = [workload.input_shape[0]] + [layer.units for layer in workload.layers]
    products = [a * b for a, b in zip(widths, widths[1:])]
    reverse = widths[-1] * sum(products[:-1])
    forward = widths[0] * sum(products[1:])
    return 2.0 * (sum(products) + min(reverse, forward))


def keras_model(workload: Workload, params: list[list[np.ndarray]] | None = None) -> Any:
    """The workload as a Keras functional model (float32) carrying ``params`` (default: ``weights``)."""
    import keras
    from keras import ops

    params = weights(workload) if params is None else params
    x = inputs_ = keras.Input(workload.input_shape, dtype="float32")
    for layer, arrays in zip(workload.layers, params):
        if isinstance(layer, Dense):
            dense = keras.layers.Dense(layer.units, activation=layer.activation)
            x = dense(x)
            dense.set_weights(arrays)
        elif isinstance(layer, Conv):
            conv = keras.layers.Conv2D(layer.filters, 3, activation=layer.activation)
            x = conv(x)
            conv.set_weights(arrays)
        elif isinstance(layer, MaxPool):
            x = keras.layers.MaxPooling2D(2)(x)
        elif isinstance(layer, Flatten):
            x = keras.layers.Flatten()(x)
        elif isinstance(layer, Coupling):
            half = x.shape[-1] // 2
            hidden = keras.layers.Dense(layer.hidden, activation="tanh")
            scale_shift = keras.layers.Dense(2 * half)
            st = scale_shift(hidden(x[:, :half]))
            hidden.set_weights(arrays[:2])
            scale_shift.set_weights(arrays[2:])
            x = ops.concatenate([x[:, :half], x[:, half:] * ops.exp(st[:, :half]) + st[:, half:]], axis=-1)
        elif isinstance(layer, Permute):
            x = ops.take(x, arrays[0], axis=1)
    return keras.Model(inputs_, x, name=f"bench_{workload.name}")


# The Keras builders, usable as ``model.factory: "benchmarks.workloads:w3_wide"``.


def w1_mlp() -> Any:
    """W1: x[784] -> Dense 512 tanh -> Dense 512 tanh -> Dense 10; Jacobian [10, 784]."""
    return keras_model(WORKLOADS["mlp"])


def w2_cnn() -> Any:
    """W2: x[28, 28, 1] -> Conv 3x3x32 relu -> Conv 3x3x64 relu -> MaxPool 2 -> Flatten -> Dense 128
    relu -> Dense 10; Jacobian [10, 28, 28, 1]."""
    return keras_model(WORKLOADS["cnn"])


def w3_wide() -> Any:
    """W3: x[16] -> Dense 256 tanh -> Dense 256 tanh -> Dense 512; Jacobian [512, 16]."""
    return keras_model(WORKLOADS["wide"])


def w4_flow() -> Any:
    """W4: x[64] -> 4 affine couplings (Dense 128 tanh -> Dense 64), permutations between; Jacobian [64, 64]."""
    return keras_model(WORKLOADS["flow"])


def quickstart() -> Any:
    """The README quickstart's CNN, with seeded weights rather than trained ones (the same cost): x[28, 28, 1]
    -> Conv 3x3x16 relu (no bias) -> MaxPool 2 -> Flatten -> Dense 10; Jacobian [10, 28, 28, 1]."""
    import keras

    from jacobeam.transforms.engine.models import seeded_weights

    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu", use_bias=False),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ], name="quickstart")
    seeded_weights(model, 0)
    return model


def bars(count: int, seed: int) -> np.ndarray:
    """The README quickstart's images: an 8x3 bar of ones at a random place on 28x28 zeros."""
    rng = np.random.default_rng(seed)
    images = np.zeros((count, 28, 28, 1), np.float32)
    for image, row, col in zip(images, rng.integers(2, 20, count), rng.integers(0, 20, count), strict=True):
        image[row : row + 8, col : col + 3] = 1.0
    return images


# Keras applications with seeded random weights (nothing downloaded), for per-label saliency:
# ``model.factory: "benchmarks.workloads:resnet50"``. Every call builds the same weights.


def resnet50() -> Any:
    """W5: ``keras.applications.ResNet50`` (224x224x3 -> 1000 classes), weights from Keras seed 0."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.applications.ResNet50(weights=None)


def mobilenet_v2() -> Any:
    """``keras.applications.MobileNetV2`` (224x224x3 -> 1000 classes), weights from Keras seed 0."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.applications.MobileNetV2(weights=None)


def efficientnet_b0() -> Any:
    """``keras.applications.EfficientNetB0`` (224x224x3 -> 1000 classes), weights from Keras seed 0."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.applications.EfficientNetB0(weights=None)


APPLICATIONS = {"resnet50": resnet50, "mobilenet_v2": mobilenet_v2, "efficientnet_b0": efficientnet_b0}
