"""The Jacobian engine: one compiled TensorFlow function per worker, built once and called per batch.

Pure TensorFlow, no Beam: usable and testable on its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from transforms.errors import ModelError
from transforms.models import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    batch_size: int = 256
    jit_compile: bool = False


class JacobianEngine:
    """Per-sample Jacobians ``d output_i / d input_i`` of a model, for whole batches at a time.

    ``engine(x)`` with ``x`` of shape ``(n, *input_shape)`` returns ``{"jacobian": (n, *output_shape,
    *input_shape), "output": (n, *output_shape)}`` as float32 numpy arrays. The function is traced
    once, with a ``None`` batch dimension, so a short last batch does not retrace; under XLA (which
    compiles per shape) short batches are padded to ``batch_size`` instead.
    """

    def __init__(self, model: LoadedModel, input_shape: tuple[int, ...], options: EngineOptions):
        self.model = model
        self.fingerprint = model.fingerprint()
        self.input_shape = tuple(input_shape)
        declared = model.input_shape
        if declared is not None and (
            len(declared) != len(self.input_shape)
            or any(d is not None and d != s for d, s in zip(declared, self.input_shape))
        ):
            raise ModelError(
                f"{model.source} expects samples of shape {tuple(declared)}; "
                f"the inputs hold samples of shape {self.input_shape}"
            )
        self.options = options
        spec = tf.TensorSpec((None, *self.input_shape), tf.float32, name="x")
        self._fn = tf.function(self._jacobian, input_signature=[spec], jit_compile=options.jit_compile)
        self.output_shape = self._warm_up()

    def _jacobian(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.cast(self.model.call(x), tf.float32)
            scalar = y.shape.rank == 1
            target = y[:, None] if scalar else y  # batch_jacobian needs an output axis
        jacobian = tape.batch_jacobian(target, x)
        return {"jacobian": jacobian[:, 0] if scalar else jacobian, "output": y}

    def _warm_up(self) -> tuple[int, ...]:
        batch = tf.zeros((self.options.batch_size, *self.input_shape), tf.float32)
        try:
            result = self._fn(batch)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
            raise ModelError(
                f"{self.model.source}: cannot compute Jacobians for samples of shape {self.input_shape}: {err}"
            ) from err
        output_shape = tuple(result["output"].shape[1:])
        log.info(
            "engine ready: %s, input %s -> output %s, batch %d, jit_compile=%s",
            self.model.source, self.input_shape, output_shape, self.options.batch_size, self.options.jit_compile,
        )
        return output_shape

    @property
    def traces(self) -> int:
        """How often the function was traced; stays 1 after warm-up."""
        return self._fn.experimental_get_tracing_count()

    def __call__(self, x: np.ndarray | tf.Tensor) -> dict[str, np.ndarray]:
        n = int(x.shape[0])
        x = tf.convert_to_tensor(x, tf.float32)
        if self.options.jit_compile and n < self.options.batch_size:
            x = tf.pad(x, [(0, self.options.batch_size - n)] + [(0, 0)] * len(self.input_shape))
        return {name: value.numpy()[:n] for name, value in self._fn(x).items()}
