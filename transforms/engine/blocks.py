"""The ways to compute one block of a batch's Jacobians, each as one compiled TensorFlow function.

A *block* is a slice of ``L J_i R`` for every sample ``i`` of a batch, where ``J_i = d y_i / d x_i``
has the output flattened to ``m`` entries and input ``k`` flattened to ``d`` entries:

- ``reverse``: ``tape.batch_jacobian`` (pfor-vectorised reverse mode) of rows ``[start, start + c)``
  of ``L y``: ``(n, c, d)``. Cost grows with the number of rows.
- ``reverse_loop``: the same rows through a graph-mode loop of batched gradients, one per row
  (``batch_jacobian`` without pfor). Slower where pfor vectorises well, faster where its kernels are
  poor (max-pooling CNNs on CPU, see shared/benchmarks.md).
- ``forward``: ``tf.autodiff.ForwardAccumulator`` over a vectorised batch of tangents, the columns
  ``[start, start + c)`` of ``R``: ``(n, m, c)``. Cost grows with the number of columns. Or
  (``double_reverse``) the same block as the batch Jacobian of ``u^T J R`` with respect to the
  cotangent ``u``: one primal and one backward pass for all columns, where the accumulator makes each
  JVP the transpose of a VJP of its own (faster in the plain graph, not under XLA: benchmarks/README.md). It is
  not always right: through image resizing it silently gives zeros where the accumulator reports a
  dropped tangent, so the engine uses it only where it agrees with the accumulator.

``L`` (reverse only) is the identity, a per-sample choice of rows (``left="index"``: an int tensor
``(n, k)``) or a fixed matrix (``left="matrix"``: ``(r, m)``, vector-Jacobian products). ``R``
(forward only) is the identity or a fixed matrix given by its columns as rows (``right="matrix"``:
``(r, d)``, Jacobian-vector products and projections). Neither ever forms the full Jacobian.

The block size ``c`` is fixed per function, so a function traces once; ``start`` is a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np
import tensorflow as tf

from jacobeam.transforms.engine import layer_rules, reverse_layer_rules
from jacobeam.transforms.errors import ModelError

MODES = ("reverse", "reverse_loop", "forward")

Call = Callable[[list[tf.Tensor]], tf.Tensor]


class ForwardModeUnsupported(ModelError):
    """Forward mode dropped the tangent: an op on the path has no forward-mode rule."""


DROPPED_TANGENT = (
    "forward mode dropped the tangent: an op between input and output has no forward-mode rule "
    "(image resizing is one); use mode reverse"
)


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
    operand: Literal["identity", "index", "matrix"] = "identity",
    double_reverse: bool = False,
    eager: bool = False,
) -> Callable:
    """A compiled ``block(xs, start, operand) -> (y_flat (n, m), block)`` for model input ``wrt``.

    ``rows`` is the block size ``c`` and ``total`` the full extent being blocked (rows of ``L y`` for
    the reverse modes, columns of ``R`` for forward). ``start`` must satisfy
    ``0 <= start <= total - rows``. ``operand`` says what the third argument is (see the module
    docstring); with ``"identity"`` pass an empty ``(0, 0)`` tensor. With ``rows == total`` and the
    identity, reverse modes differentiate the whole output without slicing it (a slice adds a scatter
    of one-hot cotangents per row). ``eager``: not compiled, the reference the other paths are checked
    against (``forward_eagerly``, ``reverse_eagerly``).
    """
    shape = tuple(input_shapes[wrt])
    size = int(np.prod(shape, dtype=np.int64))
    operand_spec = tf.TensorSpec((None, None), tf.int32 if operand == "index" else dtype)
    signature = [
        [tf.TensorSpec((None, *s), dtype) for s in input_shapes],
        tf.TensorSpec((), tf.int32),
        operand_spec,
    ]

    def tangent_directions(start, given):
        """Forward mode's block of directions ``(c, d)``: rows of ``R``, or input entries."""
        if operand == "matrix":
            return given[start : start + rows]
        return tf.one_hot(start + tf.range(rows), size, dtype=dtype)

    def selected(y, given):
        """``L y``: every row the blocks are taken from."""
        if operand == "index":
            return tf.gather(y, given, batch_dims=1)
        if operand == "matrix":
            return tf.matmul(y, given, transpose_b=True)
        return y

    def targets(y, start, given):
        y = selected(y, given)
        return y if rows == total else y[:, start : start + rows]

    def reverse(xs, start, given):
        xs = list(xs)
        with tf.GradientTape() as tape:
            tape.watch(xs[wrt])
            y = _flat_output(call, xs, dtype)
            target = targets(y, start, given)
        if rows == 1:
            # One row per sample: the gradient of the row summed over the batch is every sample's row,
            # samples being independent (checked at set-up): one backward pass, no pfor, whose kernels
            # for some ops (depthwise convolutions) fall back to a loop.
            block = tape.gradient(
                target, xs[wrt], output_gradients=tf.ones_like(target), unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
        else:
            block = tape.batch_jacobian(target, xs[wrt], experimental_use_pfor=mode == "reverse")
        return y, tf.reshape(block, (tf.shape(y)[0], rows, size))

    def forward(xs, start, given):
        xs = list(xs)
        n, directions = tf.shape(xs[wrt])[0], tangent_directions(start, given)
        tangents = tf.broadcast_to(tf.reshape(directions, (rows, 1, *shape)), tf.concat([[rows, n], shape], 0))

        def jvp(tangent):
            with tf.autodiff.ForwardAccumulator(xs[wrt], tangent) as accumulator:
                y = _flat_output(call, xs, dtype)
            column = accumulator.jvp(y)
            if column is None:
                raise ForwardModeUnsupported(DROPPED_TANGENT)
            return column

        y = _flat_output(call, xs, dtype)
        columns = tf.vectorized_map(jvp, tangents)  # (c, n, m)
        return y, tf.transpose(columns, (1, 2, 0))

    def forward_by_double_reverse(xs, start, given):
        xs = list(xs)
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(xs[wrt])
                y = _flat_output(call, xs, dtype)
            cotangent = tf.zeros_like(y)
            outer.watch(cotangent)
            row = inner.gradient(y, xs[wrt], output_gradients=cotangent)  # u^T J: linear in u
            if row is None:
                raise ForwardModeUnsupported("the output does not depend on the input")
            row = tf.reshape(row, (tf.shape(y)[0], size))
            if operand == "matrix":
                row = tf.matmul(row, given[start : start + rows], transpose_b=True)  # u^T J R
            elif rows != total:
                row = row[:, start : start + rows]
        columns = outer.batch_jacobian(row, cotangent)  # (n, c, m): (J R)^T
        return y, tf.transpose(columns, (0, 2, 1))

    def tiled(xs):
        """``c`` copies of the batch, one after the other: the eager references' one pass for a block."""
        return [tf.tile(x, [rows, *[1] * (len(x.shape) - 1)]) for x in xs]

    def forward_eagerly(xs, start, given):
        """The accumulator's block as one eager pass over ``c`` copies of the batch, copy ``j`` carrying
        tangent ``j`` (samples being independent, checked at set-up): run once on the probe batch, it
        costs no tracing, no graph optimisation and no pfor, which take seconds on a deep model."""
        xs = [tf.convert_to_tensor(x, dtype) for x in xs]
        n, directions = tf.shape(xs[wrt])[0], tangent_directions(start, given)
        tangent = tf.reshape(tf.repeat(directions, n, axis=0), (-1, *shape))  # (c n, *shape), column-major
        copies = tiled(xs)
        with tf.autodiff.ForwardAccumulator(copies[wrt], tangent) as accumulator:
            y = _flat_output(call, copies, dtype)
        columns = accumulator.jvp(y)
        if columns is None:
            raise ForwardModeUnsupported(DROPPED_TANGENT)
        return y[:n], tf.transpose(tf.reshape(columns, (rows, n, -1)), (1, 2, 0))

    def reverse_eagerly(xs, start, given):
        """The reverse block as one eager pass over ``c`` copies of the batch, copy ``j`` pulling back the
        one-hot cotangent of row ``start + j`` (samples being independent, checked at set-up): as
        ``forward_eagerly``, a reference that costs no tracing and no pfor."""
        xs = [tf.convert_to_tensor(x, dtype) for x in xs]
        n = tf.shape(xs[wrt])[0]
        copies = tiled(xs)  # copy j: rows j n to (j + 1) n
        chosen = tf.tile(given, [rows, 1]) if operand == "index" else given
        with tf.GradientTape() as tape:
            tape.watch(copies[wrt])
            y = _flat_output(call, copies, dtype)
            target = selected(y, chosen)
        cotangent = tf.repeat(tf.one_hot(start + tf.range(rows), tf.shape(target)[1], dtype=dtype), n, axis=0)
        block = tape.gradient(target, copies[wrt], output_gradients=cotangent,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return y[:n], tf.transpose(tf.reshape(block, (rows, n, size)), (1, 0, 2))

    if eager:
        return forward_eagerly if mode == "forward" else reverse_eagerly
    if mode == "forward":
        body = forward_by_double_reverse if double_reverse else forward
    else:
        body = reverse
    # No autograph: the bodies have no tensor-dependent Python control flow, and errors raised while
    # tracing (ForwardModeUnsupported) must reach the engine as themselves.
    return tf.function(body, input_signature=signature, jit_compile=jit_compile, autograph=False)


class Path(NamedTuple):
    """One way to compute blocks: a mode, under XLA or not, and by layer rules (``layer_rules`` in forward
    mode, ``reverse_layer_rules`` in reverse mode), (forward mode) by double reverse, or run eagerly
    (``eager``: only ever the reference the others are checked against, never used to compute a run)."""

    mode: str
    jit: bool = False
    double_reverse: bool = False
    layer_rules: bool = False
    eager: bool = False

    @property
    def label(self) -> str:
        by = (
            " by double reverse" if self.double_reverse
            else " by layer rules" if self.layer_rules
            else ", eagerly" if self.eager
            else ""
        )
        return f"{self.mode}{by}{' + XLA' if self.jit else ''}"


class BlockCache:
    """Compiled blocks of one model, built on first use and kept: a block function traces once per
    path and size. ``wrap`` (a test seam) is applied to every block built, e.g. to inject failures.
    ``model`` (the Keras model behind ``call``) is what paths by layer rules run through."""

    def __init__(
        self,
        call: Call,
        input_shapes: Sequence[tuple[int, ...]],
        dtype: tf.DType,
        wrap: Callable[[Callable], Callable] | None = None,
        model: object | None = None,
    ):
        self._call, self._shapes, self._dtype, self._wrap, self._model = call, input_shapes, dtype, wrap, model
        self._built: dict[tuple, Callable] = {}
        self._compiled: list[Callable] = []

    def get(self, path: Path, wrt: int, rows: int, total: int, operand: str) -> Callable:
        key = (path, wrt, rows, total, operand)
        if key not in self._built:
            if path.layer_rules:
                build = layer_rules.build_block if path.mode == "forward" else reverse_layer_rules.build_reverse_block
                fn = build(self._model, self._shapes[wrt], rows, total, self._dtype, path.jit, operand)
            else:
                fn = build_block(
                    path.mode, self._call, self._shapes, wrt, rows, total, self._dtype, path.jit,
                    operand=operand, double_reverse=path.double_reverse, eager=path.eager,
                )
            if not path.eager:  # an eager reference never traces
                self._compiled.append(fn)
            self._built[key] = fn if self._wrap is None else self._wrap(fn)
        return self._built[key]

    def trace(self, path: Path, wrt: int, rows: int, total: int, operand: str) -> None:
        """Build a block and trace it without running it (set-up decisions taken from an earlier engine)."""
        before = len(self._compiled)
        self.get(path, wrt, rows, total, operand)
        if len(self._compiled) > before:
            self._compiled[-1].get_concrete_function()

    @property
    def traces(self) -> int:
        """How many times the blocks built so far have traced."""
        return sum(fn.experimental_get_tracing_count() for fn in self._compiled)
