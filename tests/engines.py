"""Engines for the engine tests: one model, its own input shape, ``batch_size`` 8 unless given; seeded
samples for it."""

import numpy as np

from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.spec import EngineOptions


def engine(model, wrap_block=None, **options) -> JacobianEngine:
    options.setdefault("batch_size", 8)
    return JacobianEngine(wrap_model(model, model.name), model.input_shape[1:], EngineOptions(**options), wrap_block=wrap_block)


def samples(model, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, *model.input_shape[1:])).astype(np.float32)
