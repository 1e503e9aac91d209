"""Small seeded test models, each buildable in float32 and float64 with identical weights.

Usable as ``model.factory`` (``tests.models:small_cnn``) when the tests run from the repository root.
"""

from __future__ import annotations

import keras

from transforms.models import seeded_weights


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
