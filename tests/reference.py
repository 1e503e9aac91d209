"""Independent references for per-sample Jacobians: a per-sample tape loop, and finite differences."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def tape_loop(model, samples: np.ndarray) -> np.ndarray:
    """``tf.GradientTape().jacobian`` of one sample at a time: (n, *output_shape, *input_shape)."""
    spec = tf.TensorSpec((1, *samples.shape[1:]), tf.float32)

    @tf.function(input_signature=[spec])
    def one(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=False)[0]
        return tape.jacobian(y, x)  # (*output_shape, 1, *input_shape)

    rows = []
    for sample in samples:
        jac = one(sample[None].astype(np.float32)).numpy()
        rows.append(jac.reshape(*jac.shape[: jac.ndim - samples.ndim], *sample.shape))
    return np.stack(rows)


def central_differences(model64, samples: np.ndarray, step: float = 1e-6) -> np.ndarray:
    """Central finite differences of a float64 model: (n, *output_shape, *input_shape)."""
    rows = []
    for sample in samples.astype(np.float64):
        size = sample.size
        basis = np.eye(size).reshape(size, *sample.shape) * step
        ys = model64(np.concatenate([sample + basis, sample - basis]), training=False).numpy()
        diff = (ys[:size] - ys[size:]) / (2 * step)  # (size, *out)
        rows.append(np.moveaxis(diff, 0, -1).reshape(*diff.shape[1:], *sample.shape))
    return np.stack(rows)


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-5) -> None:
    """Equal within ``rtol`` of the reference's largest entry (Jacobians have many near-zero entries)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-12)
    error = float(np.abs(actual.astype(np.float64) - expected).max()) / scale
    assert error <= rtol, f"max relative error {error:.3g} > {rtol:.3g}"


def tape_loop_inputs(model64, samples: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tf.GradientTape().jacobian`` of one sample at a time of a several-input float64 model, by input:
    ``{input name: (n, *output_shape, *input_shape)}``, eagerly, with respect to every input."""
    names = [t.name for t in model64.inputs]
    rows: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for i in range(len(samples[names[0]])):
        xs = [tf.constant(samples[name][i : i + 1], tf.float64) for name in names]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = model64(xs, training=False)[0]
        for name, jac in zip(names, tape.jacobian(y, xs)):
            rows[name].append(jac.numpy().reshape(*y.shape, *samples[name].shape[1:]))
    return {name: np.stack(found) for name, found in rows.items()}
