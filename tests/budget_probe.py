"""Run by test_engine_memory: Jacobians of a 1000-output model on 224x224x3 inputs within 2 GiB.

Prints ``batch=... growth=... max_rel_error=...``: the engine's batch size, the peak resident memory
growth over the process's size before the engine was built, and the error of some rows against
per-row gradients.
"""

import os
import resource

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import seeded_weights, wrap_model
from jacobeam.transforms.spec import EngineOptions


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


model = keras.Sequential(
    [
        keras.Input((224, 224, 3)),
        keras.layers.Conv2D(4, 8, strides=8, activation="tanh"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(1000),
    ]
)
seeded_weights(model, seed=5)
x = np.random.default_rng(0).random((2, 224, 224, 3)).astype(np.float32)
before = peak()
engine = JacobianEngine(wrap_model(model, "big"), (224, 224, 3), EngineOptions(batch_size=16, memory_budget=2 * 2**30))
errors = []
for i in range(0, len(x), engine.batch_size):  # as the pipeline feeds it: engine.batch_size at a time
    sample = x[i : i + engine.batch_size]
    jacobian = engine(sample)["jacobian"]
    for row in (0, 517, 999):
        xt = tf.constant(sample)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = model(xt)[:, row]
        expected = tape.gradient(y, xt).numpy()
        errors.append(np.abs(jacobian[:, row] - expected).max() / np.abs(expected).max())
    del jacobian
print(f"batch={engine.batch_size} growth={peak() - before} max_rel_error={max(errors)}")
