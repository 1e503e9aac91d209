"""Small seeded test models, each buildable in float32 and float64 with identical weights.

Usable as ``model.factory`` (``tests.models:small_cnn``) when the tests run from the repository root.
"""

from __future__ import annotations

import keras

from jacobeam.transforms.engine.models import seeded_weights


def small_mlp(dtype: str = "float32") -> keras.Model:
    """x[12] -> Dense 16 tanh -> Dense 5."""
    model = keras.Sequential(
        [
            keras.Input((12,), dtype=dtype),
            keras.layers.Dense(16, activation="tanh", dtype=dtype),
            keras.layers.Dense(5, dtype=dtype),
        ]
    )
    seeded_weights(model, seed=1)
    return model


def small_cnn(dtype: str = "float32") -> keras.Model:
    """x[8, 8, 1] -> Conv 3x3x4 relu -> MaxPool 2 -> Flatten -> Dense 3."""
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1), dtype=dtype),
            keras.layers.Conv2D(4, 3, activation="relu", dtype=dtype),
            keras.layers.MaxPooling2D(2, dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )
    seeded_weights(model, seed=2)
    return model


def grid_model(dtype: str = "float32") -> keras.Model:
    """x[4, 3] -> Flatten -> Dense 24 tanh -> Dense 6 -> y[2, 3]: multi-dimensional in and out."""
    model = keras.Sequential(
        [
            keras.Input((4, 3), dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(24, activation="tanh", dtype=dtype),
            keras.layers.Dense(6, dtype=dtype),
            keras.layers.Reshape((2, 3), dtype=dtype),
        ]
    )
    seeded_weights(model, seed=3)
    return model


def scalar_model(dtype: str = "float32") -> keras.Model:
    """x[5] -> Dense 8 tanh -> Dense 1 -> y[] (one scalar per sample)."""
    model = keras.Sequential(
        [
            keras.Input((5,), dtype=dtype),
            keras.layers.Dense(8, activation="tanh", dtype=dtype),
            keras.layers.Dense(1, dtype=dtype),
            keras.layers.Reshape((), dtype=dtype),
        ]
    )
    seeded_weights(model, seed=4)
    return model


def two_inputs(dtype: str = "float32") -> keras.Model:
    """image[4, 4, 1] and meta[3] -> y[5]: a model with two named inputs."""
    image = keras.Input((4, 4, 1), dtype=dtype, name="image")
    meta = keras.Input((3,), dtype=dtype, name="meta")
    flat = keras.layers.Flatten(dtype=dtype)(image)
    hidden = keras.layers.Dense(8, activation="tanh", dtype=dtype)(keras.layers.Concatenate(dtype=dtype)([flat, meta]))
    model = keras.Model([image, meta], keras.layers.Dense(5, dtype=dtype)(hidden))
    seeded_weights(model, seed=5)
    return model


def upsampler(dtype: str = "float32") -> keras.Model:
    """x[4, 4, 1] -> bilinear resize to 6x6 -> tanh -> y[36]. pfor cannot vectorise the resize's
    gradient (it falls back to a while_loop) and forward mode has no rule for it."""
    model = keras.Sequential(
        [
            keras.Input((4, 4, 1), dtype=dtype),
            keras.layers.Resizing(6, 6, interpolation="bilinear", dtype=dtype),
            keras.layers.Activation("tanh", dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
        ]
    )
    return model


class _HostConstant(keras.layers.Layer):
    """Scales by a constant computed in Python through ``tf.py_function``: XLA cannot compile it."""

    def call(self, x):
        import tensorflow as tf

        scale = tf.py_function(lambda: tf.constant(2.0, self.compute_dtype), [], self.compute_dtype)
        return x * scale

    def compute_output_shape(self, input_shape):
        return input_shape


def not_xla_compilable(dtype: str = "float32") -> keras.Model:
    """x[6] -> Dense 4 tanh -> times a host-computed constant 2 -> y[4]."""
    model = keras.Sequential(
        [keras.Input((6,), dtype=dtype), keras.layers.Dense(4, activation="tanh", dtype=dtype), _HostConstant(dtype=dtype)]
    )
    seeded_weights(model, seed=6)
    return model


def batch_coupled(dtype: str = "float32") -> keras.Model:
    """x[5] -> x - mean over the batch -> Dense 3: each output depends on the other samples."""
    model = keras.Sequential(
        [
            keras.Input((5,), dtype=dtype),
            keras.layers.Lambda(lambda x: x - keras.ops.mean(x, axis=0, keepdims=True), dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )
    seeded_weights(model, seed=7)
    return model


def coupling_flow(dtype: str = "float32") -> keras.Model:
    """x[8] -> two affine coupling layers (half of x through Dense 16 tanh -> scale, shift), the halves
    swapped between them -> y[8]: a square, invertible map with a non-trivial Jacobian."""
    x = keras.Input((8,), dtype=dtype)
    h = x
    for _ in range(2):
        first = keras.layers.Lambda(lambda v: v[:, :4], dtype=dtype)(h)
        second = keras.layers.Lambda(lambda v: v[:, 4:], dtype=dtype)(h)
        hidden = keras.layers.Dense(16, activation="tanh", dtype=dtype)(first)
        scale = keras.layers.Dense(4, activation="tanh", dtype=dtype)(hidden)
        shift = keras.layers.Dense(4, dtype=dtype)(hidden)
        moved = keras.layers.Lambda(lambda a: a[0] * keras.ops.exp(a[1]) + a[2], dtype=dtype)([second, scale, shift])
        h = keras.layers.Concatenate(dtype=dtype)([moved, first])  # swap halves for the next layer
    model = keras.Model(x, h)
    seeded_weights(model, seed=8)
    return model


def _inference_batch_norm(model: keras.Model, seed: int) -> None:
    """BatchNormalization statistics a trained network could have. ``seeded_weights`` draws every 1-D
    weight from N(0, 0.1), which would make moving variances negative (NaN outputs) and scales tiny;
    here gamma is 1 + that draw and the moving variance is seeded in [0.5, 1.5)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            gamma, beta, mean, _ = layer.get_weights()
            variance = rng.uniform(0.5, 1.5, gamma.shape)
            layer.set_weights([w.astype(model.dtype) for w in (1.0 + gamma, beta, mean, variance)])


def mobilenet_like(dtype: str = "float32") -> keras.Model:
    """x[6, 6, 3] -> bilinear resize to 8x8 -> Conv 3x3/2 (6) -> BN -> ReLU6 -> depthwise 3x3 -> BN ->
    ReLU6 -> Conv 1x1 (8) -> BN -> ReLU6 -> global average pool -> Dense 4: a MobileNet block in
    miniature, BatchNormalization in inference mode. Forward mode has no rule for the resize."""
    model = keras.Sequential(
        [
            keras.Input((6, 6, 3), dtype=dtype),
            keras.layers.Resizing(8, 8, interpolation="bilinear", dtype=dtype),
            keras.layers.Conv2D(6, 3, strides=2, padding="same", use_bias=False, dtype=dtype),
            keras.layers.BatchNormalization(dtype=dtype),
            keras.layers.ReLU(6.0, dtype=dtype),
            keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, dtype=dtype),
            keras.layers.BatchNormalization(dtype=dtype),
            keras.layers.ReLU(6.0, dtype=dtype),
            keras.layers.Conv2D(8, 1, use_bias=False, dtype=dtype),
            keras.layers.BatchNormalization(dtype=dtype),
            keras.layers.ReLU(6.0, dtype=dtype),
            keras.layers.GlobalAveragePooling2D(dtype=dtype),
            keras.layers.Dense(4, dtype=dtype),
        ]
    )
    seeded_weights(model, seed=9)
    _inference_batch_norm(model, seed=9)
    return model


def square_softplus(dtype: str = "float32") -> keras.Model:
    """x[6] -> x + Dense 6 (Dense 12 softplus (x)) -> y[6]: a smooth square map (identity plus a
    small residual, so well conditioned: slogdet, trace and diagonal have something to check)."""
    x = keras.Input((6,), dtype=dtype)
    hidden = keras.layers.Dense(12, activation="softplus", dtype=dtype)(x)
    y = keras.layers.Add(dtype=dtype)([x, keras.layers.Dense(6, dtype=dtype)(hidden)])
    model = keras.Model(x, y)
    seeded_weights(model, seed=10)
    return model


def softmax_mlp(dtype: str = "float32") -> keras.Model:
    """x[12] -> Dense 16 tanh -> Dense 3 softmax: a classifier whose logits ``model.logits`` takes."""
    model = keras.Sequential(
        [
            keras.Input((12,), dtype=dtype),
            keras.layers.Dense(16, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, activation="softmax", dtype=dtype),
        ]
    )
    seeded_weights(model, seed=11)
    return model


def softmax_layer_head(dtype: str = "float32") -> keras.Model:
    """x[6] -> Dense 8 tanh -> Dense 4 -> Softmax layer: a functional classifier with a separate softmax."""
    x = keras.Input((6,), dtype=dtype)
    hidden = keras.layers.Dense(8, activation="tanh", dtype=dtype)(x)
    model = keras.Model(x, keras.layers.Softmax(dtype=dtype)(keras.layers.Dense(4, dtype=dtype)(hidden)))
    seeded_weights(model, seed=12)
    return model


def bn_cnn(dtype: str = "float32") -> keras.Model:
    """x[6, 6, 2] -> Conv 3x3x4 tanh -> BatchNorm -> Dropout -> global average pool -> Dense 4 (logits): the
    layers per-sample gradients must run in inference mode, smooth (compared strictly)."""
    from jacobeam.transforms.engine.models import seeded_batchnorm

    inputs = keras.Input((6, 6, 2), dtype=dtype)
    x = keras.layers.Conv2D(4, 3, activation="tanh", dtype=dtype, name="conv")(inputs)
    x = keras.layers.BatchNormalization(dtype=dtype, name="bn")(x)
    x = keras.layers.Dropout(0.5, dtype=dtype, name="dropout")(x)
    x = keras.layers.GlobalAveragePooling2D(dtype=dtype, name="pool")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, dtype=dtype, name="head")(x))
    seeded_weights(model, seed=3)
    seeded_batchnorm(model, seed=4)
    return model



def sequence_mlp(dtype: str = "float32") -> keras.Model:
    """x[3, 8] -> Dense 16 tanh at each of the 3 positions -> Flatten -> Dense 4: a Dense layer with positions
    (its per-sample gradient sums over them; its norm by Gram matrices) and one without."""
    model = keras.Sequential(
        [
            keras.Input((3, 8), dtype=dtype),
            keras.layers.Dense(16, activation="tanh", dtype=dtype, name="per_position"),
            keras.layers.Flatten(dtype=dtype, name="flatten"),
            keras.layers.Dense(4, dtype=dtype, name="head"),
        ]
    )
    seeded_weights(model, seed=6)
    return model


TEXT_VOCABULARY = 11


def token_model(dtype: str = "float32") -> keras.Model:
    """ids[6] (token ids 0..10, as floats) -> Embedding 8 -> LayerNorm -> Dense 8 tanh at each position ->
    global average pool -> Dense 4: Embedding and LayerNormalization, the layers of a text model (ids
    repeat within a sample, so an embedding row's gradient adds positions)."""
    model = keras.Sequential(
        [
            keras.Input((6,), dtype=dtype),
            keras.layers.Embedding(TEXT_VOCABULARY, 8, dtype=dtype, name="embed"),
            keras.layers.LayerNormalization(dtype=dtype, name="norm"),
            keras.layers.Dense(8, activation="tanh", dtype=dtype, name="mix"),
            keras.layers.GlobalAveragePooling1D(dtype=dtype, name="pool"),
            keras.layers.Dense(4, dtype=dtype, name="head"),
        ]
    )
    seeded_weights(model, seed=8)
    return model


def conv_geometry(size: tuple[int, int], kernel: tuple[int, int], stride: int, dilation: int, padding: str,
                  channels: int, filters: int, dtype: str = "float32") -> keras.Model:
    """x[*size, channels] -> Conv2D tanh of the given geometry -> global average pool -> Dense 3 (logits)."""
    inputs = keras.Input((*size, channels), dtype=dtype)
    x = keras.layers.Conv2D(filters, kernel, strides=stride, dilation_rate=dilation, padding=padding,
                            activation="tanh", dtype=dtype, name="conv")(inputs)
    x = keras.layers.GlobalAveragePooling2D(dtype=dtype, name="pool")(x)
    model = keras.Model(inputs, keras.layers.Dense(3, dtype=dtype, name="head")(x))
    seeded_weights(model, seed=5)
    return model
