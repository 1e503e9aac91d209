"""Models and engine factories of tests/test_inspect_plot.py and tests/test_progress.py, usable as ``model.factory``
(``tests.first_hour_models:rgb_cnn``) when the tests run from the repository root. Kept apart from the
test module so that a worker or a ``jacobeam`` subprocess loading them imports no test machinery."""

from __future__ import annotations

import dataclasses
import time

import keras

from jacobeam.transforms.engine.models import seeded_weights
from jacobeam.transforms.testing.fake_engine import FakeEngineFactory
from tests import models

SLEEP = 5.0  # seconds slow_first_load sleeps


def rgb_cnn(dtype: str = "float32") -> keras.Model:
    """x[5, 5, 3] -> Conv 3x3x2 tanh -> Flatten -> Dense 3: a small model of 3-channel images."""
    model = keras.Sequential(
        [
            keras.Input((5, 5, 3), dtype=dtype),
            keras.layers.Conv2D(2, 3, activation="tanh", dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )
    seeded_weights(model, seed=12)
    return model


_loads = 0


def slow_first_load(dtype: str = "float32") -> keras.Model:
    """``tests.models.small_mlp``, whose first construction in a process sleeps ``SLEEP`` seconds: a large
    model's load, which ``jacobeam run`` does once while planning (its model check), before the pipeline."""
    global _loads
    _loads += 1
    if _loads == 1:
        time.sleep(SLEEP)
    return models.small_mlp(dtype)


@dataclasses.dataclass(frozen=True)
class SlowFakeEngineFactory(FakeEngineFactory):
    """``FakeEngineFactory`` whose engine takes ``sleep`` seconds to set up (as a large model's does)."""

    sleep: float = 3.0

    def __call__(self, model, input_shape, options, tf_threads=None):
        time.sleep(self.sleep)
        return super().__call__(model, input_shape, options, tf_threads)
