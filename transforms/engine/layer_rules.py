"""Forward mode by layer rules: ``J R`` pushed through a Keras model layer by layer (reverse mode: ``reverse_layer_rules``).

TensorFlow's ``ForwardAccumulator`` computes each JVP as the transpose of a VJP (``AddN``/``pfor``/``Tile``
beside every tangent matmul, benchmarks/README.md). For a model built only from layers and ops with a
rule here, the tangents instead go through as ``jax.vmap(jacfwd)`` pushes them: batched, ``T <- W^T T``
for a Dense layer and ``T <- T * act'(z)`` for its activation. Beside each activation ``(n, *features)``
its tangents are ``(*features, n, c)``, features first: the slices, concatenations and permutations of
features (coupling layers) then move whole contiguous rows, where on the last axis they would gather
single numbers (3x slower for a permutation, measured), and a Dense layer is one matmul over all samples
and columns. The input's tangents (the columns of ``R``) are the same for every sample, so they stay
``(*features, 1, c)`` until a rule mixes in a sample's values: the first Dense layer applied to the
identity basis is its kernel.

Rules (exact classes: a subclass may compute something else): Dense and Activation with the
activations in ``DERIVATIVES``, Dropout (inference), Flatten, Reshape, nested Sequential and
functional models, and the Keras ops ``x[...]`` (slicing the features), ``exp``, ``*``, ``+``, ``-``,
``concatenate`` and ``take`` (constant indices) along a feature axis. ``unsupported(model)`` says
why a model has no rules (the engine then never tries the path); an argument found only while
tracing (a slice of the samples, say) raises ``NoLayerRule``. The engine trusts this path only where
it agrees with the accumulator on the probe batch (``planner``), as it does double reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from jacobeam.transforms.errors import ModelError


class NoLayerRule(ModelError):
    """The model has a layer, op or argument without a forward-mode rule here."""


# activation name -> its derivative from the pre-activation z and the activation y. Relu's is 0 at
# z = 0 and for NaN z, as TensorFlow's ReluGrad.
DERIVATIVES: dict[str, Callable[[tf.Tensor, tf.Tensor], tf.Tensor | None]] = {
    "linear": lambda z, y: None,
    "tanh": lambda z, y: 1 - y * y,
    "sigmoid": lambda z, y: y * (1 - y),
    "relu": lambda z, y: tf.cast(z > 0, y.dtype),
    "softplus": lambda z, y: tf.sigmoid(z),
    "exponential": lambda z, y: y,
}

_OPS = "keras.src.ops.numpy"
_OP_NAMES = ("GetItem", "Exp", "Multiply", "Add", "Subtract", "Concatenate", "Take")


class Dual:
    """An activation ``(n, *features)`` and its tangents ``(*features, n or 1, c)`` (None: constant)."""

    __slots__ = ("primal", "tangent")

    def __init__(self, primal: tf.Tensor, tangent: tf.Tensor | None):
        if tangent is not None and tangent.shape[:-2] != primal.shape[1:]:  # broadcast in the primal
            tangent = tf.broadcast_to(tangent, tf.concat([tf.shape(primal)[1:], tf.shape(tangent)[-2:]], 0))
        self.primal, self.tangent = primal, tangent


def activation_name(fn: Any) -> str | None:
    """The name of a Keras activation function with a derivative here, or None."""
    if fn is None:
        return "linear"
    try:
        name = keras.activations.serialize(fn)
    except (ValueError, TypeError):
        return None
    if not isinstance(name, str) or name not in DERIVATIVES or keras.activations.get(name) is not fn:
        return None
    return name


def is_model(op: Any) -> bool:
    return isinstance(op, keras.Sequential) or (isinstance(op, keras.Model) and hasattr(op, "_run_through_graph"))


def operations(model: Any) -> list:
    if isinstance(model, keras.Sequential):
        return list(model.layers)
    return list(model.operations)


def unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run by layer rules (the first layer or op without one), or None where it can."""
    if not is_model(model):
        return "not a Keras Sequential or functional model"
    if len(model.inputs or []) != 1 or len(model.outputs or []) != 1:
        return "not one input and one output"
    for op in operations(model):
        kind = type(op)
        if kind is keras.layers.InputLayer or kind in (keras.layers.Dropout, keras.layers.Flatten, keras.layers.Reshape):
            continue
        if is_model(op):
            reason = unsupported(op)
            if reason:
                return f"{op.name}: {reason}"
        elif kind is keras.layers.Dense:
            if getattr(op, "quantization_mode", None) or getattr(op, "lora_enabled", False):
                return f"{op.name}: a quantized or LoRA Dense layer"
            if op.kernel.dtype != op.compute_dtype:
                return f"{op.name}: mixed precision"
            if activation_name(op.activation) is None:
                return f"{op.name}: activation {op.activation!r}"
        elif kind is keras.layers.Activation:
            if activation_name(op.activation) is None:
                return f"{op.name}: activation {op.activation!r}"
        elif not (kind.__module__ == _OPS and kind.__name__ in _OP_NAMES):
            return f"{op.name}: no rule for {kind.__name__}"
    return None


# -- rules: each takes the op and its arguments (Duals, or constants) and returns a Dual -----------------


def _primal(value: Any) -> Any:
    return value.primal if isinstance(value, Dual) else value


def _beside(value: Any, rank: int, dtype: tf.DType) -> tf.Tensor:
    """A value broadcastable against activations ``(n, *features)`` of ``rank``, made broadcastable
    against their tangents ``(*features, n, c)`` of ``dtype``."""
    value = tf.cast(value, dtype)  # a Python number or array: the model's dtype, as Keras' ops promote it
    if value.shape.rank == rank:  # per sample (or of one sample): its samples' axis goes after the features
        value = tf.transpose(value, (*range(1, rank), 0))
        return tf.expand_dims(value, -1)
    return tf.reshape(value, tf.concat([tf.shape(value), [1, 1]], 0))


def _scaled(tangent: tf.Tensor, factor: tf.Tensor | None, rank: int) -> tf.Tensor:
    return tangent if factor is None else tangent * _beside(factor, rank, tangent.dtype)


def _through_activation(name: str, fn: Any, z: tf.Tensor, tangent: tf.Tensor | None) -> Dual:
    y = z if fn is None else fn(z)
    if tangent is None:
        return Dual(y, None)
    return Dual(y, _scaled(tangent, DERIVATIVES[name](z, y), z.shape.rank))


def _dense(layer: Any, x: Dual) -> Dual:
    if x.primal.shape.rank != 2:
        raise NoLayerRule(f"{layer.name}: Dense on inputs of rank {x.primal.shape.rank} (2 has a rule)")
    kernel = layer.kernel
    z = tf.matmul(x.primal, kernel)
    if layer.bias is not None:
        z = z + layer.bias
    tangent = None
    if x.tangent is not None:  # one matmul for all samples and columns
        t = x.tangent
        flat = tf.matmul(kernel, tf.reshape(t, (kernel.shape[0], -1)), transpose_a=True)
        tangent = tf.reshape(flat, tf.concat([[kernel.shape[1]], tf.shape(t)[1:]], 0))
    return _through_activation(activation_name(layer.activation), layer.activation, z, tangent)


def _reshaped(x: Dual, primal: tf.Tensor) -> Dual:
    if x.tangent is None:
        return Dual(primal, None)
    t = x.tangent
    return Dual(primal, tf.reshape(t, tf.concat([tf.shape(primal)[1:], tf.shape(t)[-2:]], 0)))


def _feature_axis(axis: int | None, rank: int, what: str) -> int:
    """``axis`` of an activation of ``rank`` as an axis of its tangents; the samples' axis has no rule."""
    if axis is None or not -rank <= axis < rank or axis % rank == 0:
        raise NoLayerRule(f"{what} along axis {axis} (not a feature axis)")
    return axis % rank - 1


def _get_item(op: Any, x: Dual, key: Any) -> Dual:
    primal = op(x.primal, key)
    if x.tangent is None:
        return Dual(primal, None)
    simple = isinstance(key, tuple) and key and all(isinstance(k, (slice, int)) and not isinstance(k, bool) for k in key)
    if not simple or key[0] != slice(None):
        raise NoLayerRule(f"x[{key!r}]: only slices and integers over the features")
    return Dual(primal, x.tangent[(*key[1:], Ellipsis)])


def _exp(op: Any, x: Dual) -> Dual:
    y = op(x.primal)
    return Dual(y, None if x.tangent is None else _scaled(x.tangent, y, y.shape.rank))


def _sum(op: Any, a: Any, b: Any, sign: float) -> Dual:
    primal = op(_primal(a), _primal(b))
    ta = a.tangent if isinstance(a, Dual) else None
    tb = b.tangent if isinstance(b, Dual) else None
    if tb is not None and sign < 0:
        tb = -tb
    tangent = tb if ta is None else ta if tb is None else ta + tb
    return Dual(primal, tangent)


def _multiply(op: Any, a: Any, b: Any) -> Dual:
    pa, pb = _primal(a), _primal(b)
    primal = op(pa, pb)
    rank = primal.shape.rank
    parts = []
    if isinstance(a, Dual) and a.tangent is not None:
        parts.append(a.tangent * _beside(pb, rank, a.tangent.dtype))
    if isinstance(b, Dual) and b.tangent is not None:
        parts.append(_beside(pa, rank, b.tangent.dtype) * b.tangent)
    return Dual(primal, None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1])


def _concatenate(op: Any, xs: Sequence[Any]) -> Dual:
    primal = op([_primal(x) for x in xs])
    axis = _feature_axis(op.axis, primal.shape.rank, "concatenate")
    tangents = [x.tangent if isinstance(x, Dual) else None for x in xs]
    given = [t for t in tangents if t is not None]
    if not given:
        return Dual(primal, None)
    n, c = tf.shape(primal)[0], tf.shape(given[0])[-1]
    per_sample = any(t.shape[-2] != 1 for t in given)
    parts = []
    for x, t in zip(xs, tangents):
        features = tf.shape(_primal(x))[1:]
        if t is None:
            t = tf.zeros(tf.concat([features, [n if per_sample else 1, c]], 0), primal.dtype)
        elif per_sample and t.shape[-2] == 1:
            t = tf.broadcast_to(t, tf.concat([features, [n, c]], 0))
        parts.append(t)
    return Dual(primal, tf.concat(parts, axis))


def _take(op: Any, x: Dual, indices: Any) -> Dual:
    if isinstance(indices, Dual) or tf.is_tensor(indices):
        raise NoLayerRule("take with indices computed by the model")
    primal = op(x.primal, indices)
    if x.tangent is None:
        return Dual(primal, None)
    rank = x.primal.shape.rank
    axis = _feature_axis(op.axis, rank, "take")
    indices = np.asarray(indices)
    if not np.issubdtype(indices.dtype, np.integer):
        raise NoLayerRule(f"take with {indices.dtype} indices")
    indices = np.where(indices < 0, indices + x.primal.shape[axis + 1], indices)  # as Keras' take
    return Dual(primal, tf.gather(x.tangent, indices, axis=axis))


def _apply(op: Any, *args: Any, **kwargs: Any) -> Dual:
    """One op of the model on Duals."""
    kind = type(op)
    if is_model(op):
        return run(op, args[0])
    if kind is keras.layers.Dense:
        return _dense(op, args[0])
    if kind is keras.layers.Activation:
        x = args[0]
        return _through_activation(activation_name(op.activation), op.activation, x.primal, x.tangent)
    if kind is keras.layers.Dropout:
        return args[0]
    if kind in (keras.layers.Flatten, keras.layers.Reshape):
        return _reshaped(args[0], op(args[0].primal))
    name = kind.__name__ if kind.__module__ == _OPS else None
    if name == "GetItem":
        return _get_item(op, *args)
    if name == "Exp":
        return _exp(op, *args)
    if name in ("Add", "Subtract"):
        return _sum(op, *args, sign=-1.0 if name == "Subtract" else 1.0)
    if name == "Multiply":
        return _multiply(op, *args)
    if name == "Concatenate":
        return _concatenate(op, *args)
    if name == "Take":
        return _take(op, *args)
    raise NoLayerRule(f"no rule for {kind.__name__}")


def run(model: Any, x: Dual) -> Dual:
    """The model's output and its tangents for one input ``x``."""
    if isinstance(model, keras.Sequential):
        for layer in model.layers:
            if type(layer) is not keras.layers.InputLayer:
                x = _apply(layer, x)
        return x
    return model._run_through_graph([x], operation_fn=lambda op: lambda *args, **kwargs: _apply(op, *args, **kwargs))


def build_block(
    model: Any,
    input_shape: tuple[int, ...],
    rows: int,
    total: int,
    dtype: tf.DType,
    jit_compile: bool,
    operand: str = "identity",
) -> Callable:
    """A compiled forward block ``block(xs, start, operand) -> (y_flat (n, m), J R (n, m, rows))``, as
    ``blocks.build_block`` makes for the accumulator (same arguments and results)."""
    shape = tuple(input_shape)
    size = int(np.prod(shape, dtype=np.int64))
    signature = [[tf.TensorSpec((None, *shape), dtype)], tf.TensorSpec((), tf.int32), tf.TensorSpec((None, None), dtype)]

    def block(xs, start, given):
        x = xs[0]
        if operand == "matrix":
            directions = given[start : start + rows]
        elif rows == total:
            directions = tf.eye(size, dtype=dtype)
        else:
            directions = tf.one_hot(start + tf.range(rows), size, dtype=dtype)
        out = run(model, Dual(x, tf.reshape(tf.transpose(directions), (*shape, 1, rows))))
        y = tf.cast(out.primal, dtype)
        n = tf.shape(y)[0]
        y = tf.reshape(y, (n, -1))
        if out.tangent is None:  # the output does not depend on the input
            return y, tf.zeros((n, tf.shape(y)[1], rows), dtype)
        tangent = tf.cast(tf.broadcast_to(out.tangent, tf.concat([tf.shape(out.primal)[1:], [n, rows]], 0)), dtype)
        return y, tf.transpose(tf.reshape(tangent, (-1, n, rows)), (1, 0, 2))

    return tf.function(block, input_signature=signature, jit_compile=jit_compile, autograph=False)
