"""The ways to compute one block of a batch's Jacobians, each as one compiled TensorFlow function.

A *block* is a slice of the Jacobian ``J[i] = d y_i / d x_i`` of every sample ``i`` in a batch, with
the output flattened to ``m`` entries and input ``k`` flattened to ``d`` entries:

- ``reverse``: ``tape.batch_jacobian`` (pfor-vectorised reverse mode) of output rows
  ``[start, start + c)``: ``(n, c, d)``. Cost grows with the number of outputs.
- ``reverse_loop``: the same rows through a graph-mode loop of batched gradients, one per output row
  (``batch_jacobian`` without pfor). Slower where pfor vectorises well, faster where its vectorised
  kernels are poor (max-pooling CNNs on CPU, see shared/benchmarks.md).
- ``forward``: ``tf.autodiff.ForwardAccumulator`` over a vectorised batch of basis tangents for input
  columns ``[start, start + c)``: ``(n, m, c)``. Cost grows with the number of inputs.

The block size ``c`` is fixed per function, so a function traces once; ``start`` is a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from transforms.errors import ModelError

MODES = ("reverse", "reverse_loop", "forward")

Call = Callable[[list[tf.Tensor]], tf.Tensor]


class ForwardModeUnsupported(ModelError):
    """Forward mode dropped the tangent: an op on the path has no forward-mode rule."""


def _flat_output(call: Call, xs: list[tf.Tensor], dtype: tf.DType) -> tf.Tensor:
    y = tf.cast(call(xs), dtype)
    return tf.reshape(y, (tf.shape(y)[0], -1))


def build_block(
    mode: str,
    call: Call,
    input_shapes: Sequence[tuple[int, ...]],
    wrt: int,
    rows: int,
    total: int,
    dtype: tf.DType,
    jit_compile: bool,
) -> Callable:
    """A compiled ``block(xs, start) -> (y_flat (n, m), block)`` for model input number ``wrt``.

    ``rows`` is the block size ``c`` and ``total`` the full extent being blocked (``m`` outputs for
    the reverse modes, ``d`` input entries for forward). ``start`` must satisfy
    ``0 <= start <= total - rows``. With ``rows == total`` the reverse modes differentiate the whole
    output without slicing it (slicing would add a scatter of one-hot cotangents per row).
    """
    shape = tuple(input_shapes[wrt])
    size = int(np.prod(shape, dtype=np.int64))
    signature = [[tf.TensorSpec((None, *s), dtype) for s in input_shapes], tf.TensorSpec((), tf.int32)]

    def reverse(xs, start):
        xs = list(xs)
        with tf.GradientTape() as tape:
            tape.watch(xs[wrt])
            y = _flat_output(call, xs, dtype)
            target = y if rows == total else y[:, start : start + rows]
        use_pfor = mode == "reverse"
        block = tape.batch_jacobian(target, xs[wrt], experimental_use_pfor=use_pfor)
        return y, tf.reshape(block, (tf.shape(y)[0], rows, size))

    def forward(xs, start):
        xs = list(xs)
        n = tf.shape(xs[wrt])[0]
        basis = tf.one_hot(start + tf.range(rows), size, dtype=dtype)  # (c, d)
        tangents = tf.broadcast_to(tf.reshape(basis, (rows, 1, *shape)), tf.concat([[rows, n], shape], 0))

        def jvp(tangent):
            with tf.autodiff.ForwardAccumulator(xs[wrt], tangent) as accumulator:
                y = _flat_output(call, xs, dtype)
            column = accumulator.jvp(y)
            if column is None:
                raise ForwardModeUnsupported(
                    "forward mode dropped the tangent: an op between input and output has no "
                    "forward-mode rule (image resizing is one); use mode reverse"
                )
            return column

        y = _flat_output(call, xs, dtype)
        columns = tf.vectorized_map(jvp, tangents)  # (c, n, m)
        return y, tf.transpose(columns, (1, 2, 0))

    body = forward if mode == "forward" else reverse
    # No autograph: the bodies have no tensor-dependent Python control flow, and errors raised while
    # tracing (ForwardModeUnsupported) must reach the engine as themselves.
    return tf.function(body, input_signature=signature, jit_compile=jit_compile, autograph=False)
