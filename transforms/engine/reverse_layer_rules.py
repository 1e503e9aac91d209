"""Reverse mode by layer rules: cotangent rows pulled back through a chain of Keras layers.

pfor vectorises ``batch_jacobian``'s rows loop-first (transposes and a tiled TanhGrad beside every
matmul, benchmarks/README.md); here the rows ``(n or 1, c, *features)`` of every sample go back
through a Dense layer as one ``(n c, h) @ W^T`` matmul and through its activation as one product, as
``jax.vmap(vjp)`` does. Rows that are the same for every sample (the identity, a fixed matrix) stay
``(1, c, ...)`` until an activation's derivative mixes in a sample's values: the last Dense layer
pulls them back as its kernel's columns, without a matmul per sample.

The layers with a reverse rule are a subset of those with a forward rule, and share the forward rules'
checks and activation derivatives (``layer_rules``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from jacobeam.transforms.engine.layer_rules import DERIVATIVES, NoLayerRule, activation_name, is_model, operations, unsupported

_REVERSE_LAYERS = (keras.layers.Dense, keras.layers.Activation, keras.layers.Dropout, keras.layers.Flatten, keras.layers.Reshape)


def reverse_unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run reverse mode by layer rules (a layer without a reverse rule), or None."""
    reason = unsupported(model)
    if reason:
        return reason
    for op in operations(model):
        kind = type(op)
        if is_model(op):
            reason = reverse_unsupported(op)
            if reason:
                return f"{op.name}: {reason}"
        elif kind is not keras.layers.InputLayer and kind not in _REVERSE_LAYERS:
            return f"{op.name}: no reverse rule for {kind.__name__}"
    return None


def _chain(model: Any, x: tf.Tensor, pullbacks: list) -> tf.Tensor:
    """The model's output for ``x``, appending each layer's pullback (rows of ``d out / d in``) to
    ``pullbacks``; a functional model must be a chain (each layer takes the previous one's output)."""
    if isinstance(model, keras.Sequential):
        for layer in model.layers:
            if type(layer) is not keras.layers.InputLayer:
                x = _pulled(layer, x, pullbacks)
        return x
    last = [x]

    def operation_fn(op):
        def call(*args, **kwargs):
            if len(args) != 1 or args[0] is not last[0]:
                raise NoLayerRule(f"{op.name}: not a chain of layers (reverse rules need one)")
            last[0] = _pulled(op, args[0], pullbacks)
            return last[0]

        return call

    return model._run_through_graph([x], operation_fn=operation_fn)


def _scale(rows: tf.Tensor, factor: tf.Tensor | None) -> tf.Tensor:
    return rows if factor is None else rows * tf.expand_dims(factor, 1)  # (n, features) beside each row


def _pulled(op: Any, x: tf.Tensor, pullbacks: list) -> tf.Tensor:
    kind = type(op)
    if is_model(op):
        return _chain(op, x, pullbacks)
    if kind is keras.layers.Dropout:
        return x
    if kind in (keras.layers.Flatten, keras.layers.Reshape):
        y, features = op(x), tf.shape(x)[1:]
        pullbacks.append(lambda rows: tf.reshape(rows, tf.concat([tf.shape(rows)[:2], features], 0)))
        return y
    name = activation_name(op.activation)
    if kind is keras.layers.Activation:
        y = op.activation(x)
        derivative = DERIVATIVES[name](x, y)
        pullbacks.append(lambda rows: _scale(rows, derivative))
        return y
    if x.shape.rank != 2:
        raise NoLayerRule(f"{op.name}: Dense on inputs of rank {x.shape.rank} (2 has a rule)")
    kernel = op.kernel
    z = tf.matmul(x, kernel)
    if op.bias is not None:
        z = z + op.bias
    y = z if op.activation is None else op.activation(z)
    derivative = DERIVATIVES[name](z, y)

    def pullback(rows):  # (n or 1, c, out) -> (n or 1, c, in): one matmul for all samples and rows
        rows = _scale(rows, derivative)
        lead = tf.shape(rows)[:2]
        flat = tf.matmul(tf.reshape(rows, (-1, kernel.shape[1])), kernel, transpose_b=True)
        return tf.reshape(flat, tf.concat([lead, [kernel.shape[0]]], 0))

    pullbacks.append(pullback)
    return y


def build_reverse_block(
    model: Any,
    input_shape: tuple[int, ...],
    rows: int,
    total: int,
    dtype: tf.DType,
    jit_compile: bool,
    operand: str = "identity",
) -> Callable:
    """A compiled reverse block ``block(xs, start, operand) -> (y_flat (n, m), L J (n, rows, d))``, as
    ``blocks.build_block`` makes for pfor's ``batch_jacobian`` (same arguments and results)."""
    shape = tuple(input_shape)
    size = int(np.prod(shape, dtype=np.int64))
    operand_spec = tf.TensorSpec((None, None), tf.int32 if operand == "index" else dtype)
    signature = [[tf.TensorSpec((None, *shape), dtype)], tf.TensorSpec((), tf.int32), operand_spec]

    def block(xs, start, given):
        pullbacks: list = []
        out = _chain(model, xs[0], pullbacks)
        n = tf.shape(out)[0]
        y = tf.reshape(tf.cast(out, dtype), (n, -1))
        m = tf.shape(y)[1]
        if operand == "index":
            cotangent = tf.one_hot(given[:, start : start + rows], m, dtype=out.dtype)  # (n, c, m)
        elif operand == "matrix":
            cotangent = tf.cast(given[None, start : start + rows], out.dtype)  # (1, c, m)
        else:
            cotangent = tf.one_hot(start + tf.range(rows), m, dtype=out.dtype)[None]
        cotangent = tf.reshape(cotangent, tf.concat([tf.shape(cotangent)[:2], tf.shape(out)[1:]], 0))
        for pullback in reversed(pullbacks):
            cotangent = pullback(cotangent)
        block = tf.reshape(tf.cast(cotangent, dtype), (-1, rows, size))
        return y, tf.broadcast_to(block, (n, rows, size))  # (1, ...) where the output is linear in the input

    return tf.function(block, input_signature=signature, jit_compile=jit_compile, autograph=False)
