"""Per-sample weight gradients by layer rules: one batched backward pass, then each layer's per-sample
gradients from its input and the gradient at its output, as Opacus and BackPACK do.

Elements (a sample, or a sample's output row) do not interact in a batch, so the gradient of the
elements' summed objective at a layer's pre-activation ``z`` is, row by row, each element's own. A
``Dense`` layer's per-sample kernel gradient is then ``x^T dz`` of the element (summed over any positions
before its last axis), a ``Conv2D``'s the contraction of its input patches (in the kernel's ``(kh, kw,
c_in)`` order; ``_patches``) with ``dz`` over the output positions, and an inference-mode
``BatchNormalization``'s or a ``LayerNormalization``'s ``gamma`` and ``beta`` gradients ``dz * x_hat`` and
``dz`` summed over positions, and an ``Embedding``'s the rows of ``dz`` added into the rows of the ids the
element looked up. pfor, by contrast, runs a ``Conv2DBackpropFilter`` per sample in a ``while_loop``.

The model runs layer by layer (``Sequential`` in order, a functional model through its graph), with the
differentiated layers called by the rules' own forward code (the layer's ``kernel``, ``bias`` and
activation, computed the way its ``call`` does) so that ``z`` is a tensor of the tape; every other layer
as itself, in inference mode. A model with a differentiated weight in any other layer, or a nested model,
is left to ``vectorized_map`` (``unsupported``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

_NORMALIZATIONS = (keras.layers.BatchNormalization, keras.layers.LayerNormalization)
_RULED = (keras.layers.Dense, keras.layers.Conv2D, keras.layers.Embedding, *_NORMALIZATIONS)
FEW_SQUARES = 1024  # entries a sum of squares adds up in the compute dtype (``_squared_norms``)


def unsupported(keras_model: Any, variables: Sequence[tf.Variable]) -> str | None:
    """Why the weights ``variables`` of ``keras_model`` have no layer rule, or None."""
    if not (isinstance(keras_model, keras.Sequential) or hasattr(keras_model, "_run_through_graph")):
        return f"{type(keras_model).__name__} is not a Sequential or functional model"
    owners = {id(v): layer for layer in keras_model.layers for v in layer.trainable_weights}
    for layer in keras_model.layers:
        if isinstance(layer, keras.Model):
            return f"{layer.name}: a nested model"
    for variable in variables:
        layer = owners.get(id(variable))
        if layer is None:
            return f"{variable.name}: not a weight of a top-level layer"
        if type(layer) not in _RULED:
            return f"{layer.name}: no per-sample rule for {type(layer).__name__}"
        if isinstance(layer, keras.layers.Conv2D) and (layer.groups != 1 or layer.data_format != "channels_last"):
            return f"{layer.name}: a grouped or channels-first Conv2D"
        last = len(layer.input.shape) - 1
        if isinstance(layer, keras.layers.BatchNormalization) and layer.axis not in (-1, last):
            return f"{layer.name}: BatchNormalization over an axis other than the last"
        if isinstance(layer, keras.layers.LayerNormalization) and (
                layer.rms_scaling or [a % (last + 1) for a in _axes(layer.axis)] != [last]):
            return f"{layer.name}: LayerNormalization over axes other than the last, or with rms_scaling"
        if isinstance(layer, keras.layers.Embedding) and (layer.mask_zero or layer.lora_enabled or layer.quantization_mode):
            return f"{layer.name}: an Embedding with mask_zero, LoRA or quantization"
    return None


def gradients(keras_model: Any, variables: Sequence[tf.Variable], xs: list[tf.Tensor],
              objective: Callable[[tf.Tensor], tf.Tensor], squares: bool = False,
              reduce: Callable[[int, tf.Tensor], tf.Tensor] | None = None,
              factors: Callable[[int], tuple[tf.Tensor, tf.Tensor] | None] | None = None,
              ) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """``(values (N,), [per-element gradient (N, *shape) of each of variables])``: ``objective`` maps the
    model's outputs ``(N, *out)`` to each element's scalar. ``squares``: each gradient's squared norm
    ``(N,)`` instead, a kernel's without forming it where its positions are fewer than its entries
    (``_kernel_squares``). ``reduce(position in variables, gradient)``: applied to each gradient as it is
    formed; layer by layer, each layer's gradients formed only once the previous layer's are reduced, so
    that one layer's are held at a time (``largest_transient``), not all of them. ``factors(position)``:
    ``(A, B)`` for a Dense or Conv2D kernel given in place of ``reduce``, its ``A^T G B`` ``(N, k_in * k_out)``
    from ``sum_p (A^T a_p)(B^T b_p)^T`` without forming ``G`` (``parameter_space``'s Kronecker projection)."""
    wanted = {id(v) for v in variables}
    saved: dict[int, tuple[Any, tf.Tensor, tf.Tensor]] = {}  # id(variable) -> (layer, input, z)
    with tf.GradientTape() as tape:
        y = _run(keras_model, xs, wanted, lambda layer, x: _forward(layer, x, wanted, saved))
        values = objective(y)
        total = tf.reduce_sum(values)
    layers = {id(layer): (layer, x, z) for layer, x, z in saved.values()}
    zs = [z for _, _, z in layers.values()]
    dzs = dict(zip(layers, tape.gradient(total, zs, unconnected_gradients=tf.UnconnectedGradients.ZERO)))
    position = {id(v): i for i, v in enumerate(variables)}
    found: dict[int, tf.Tensor] = {}
    previous: list[tf.Tensor] = []

    def factors_of(variable) -> tuple[tf.Tensor, tf.Tensor] | None:
        return None if factors is None or id(variable) not in position else factors(position[id(variable)])

    for key, (layer, x, _) in layers.items():
        with tf.control_dependencies(previous):  # in turn only where a layer's share is large (``reduce``)
            made, done = _per_sample(layer, x, dzs[key], wanted, squares, factors_of)
            if reduce is not None:
                made = {vid: value if vid in done else reduce(position[vid], value) for vid, value in made.items()}
        found.update(made)
        previous = list(made.values()) if reduce is not None else []
    return values, [found[id(v)] for v in variables]


def largest_transient(keras_model: Any, variables: Sequence[tf.Variable]) -> int:
    """Entries per element of the largest layer's share of ``gradients`` with ``reduce``: its input patches
    (or input) and its weights' gradients, the most held at once beyond the forward and backward passes."""
    wanted = {id(v) for v in variables}
    largest = 0
    for layer in keras_model.layers:
        if type(layer) not in _RULED or not any(id(v) in wanted for v in layer.trainable_weights):
            continue
        size = sum(_entries(v.shape) for v in layer.trainable_weights)
        inputs, outputs = _entries(layer.input.shape[1:]), _entries(layer.output.shape[1:])
        if isinstance(layer, keras.layers.Conv2D):
            kh, kw = layer.kernel_size
            inputs = outputs // layer.filters * kh * kw * layer.input.shape[-1]  # patches: positions x receptive field
        largest = max(largest, size + inputs + outputs)
    return largest


def _by_position(x: tf.Tensor, n: tf.Tensor) -> tf.Tensor:
    """``x`` ``(N, *positions, channels)`` as ``(N, P, channels)``, ``P`` static where the positions are (the
    ghost norms choose their way by it)."""
    positions = x.shape[1:-1]
    if positions.is_fully_defined():  # a constant shape: no ops to build it in every call
        return tf.reshape(x, (-1, _entries(positions), x.shape[-1]))
    return tf.reshape(x, (n, -1, x.shape[-1]))


def _patches(layer: Any, x: tf.Tensor, n: tf.Tensor) -> list[tf.Tensor]:
    """A ``Conv2D``'s input patches ``(N, P, kh * kw * c_in)`` as groups of their columns: with a stride of one,
    one ``(N, P, c_in)`` slice of the padded input per kernel offset, in the kernel's ``(kh, kw)`` order;
    else the patches whole (``tf.image.extract_patches``), which are slower than slices at a stride of one
    and faster than strided slices (``benchmarks/README.md``, "Convolution patches")."""
    kh, kw = layer.kernel_size
    sh, sw = layer.strides
    dh, dw = layer.dilation_rate
    height, width = x.shape[1], x.shape[2]
    if (sh, sw) != (1, 1) or height is None or width is None:
        patches = tf.image.extract_patches(x, [1, kh, kw, 1], [1, sh, sw, 1], [1, dh, dw, 1], layer.padding.upper())
        return [_by_position(patches, n)]
    if layer.padding == "same":  # TensorFlow's: the odd row or column of padding after
        ph, pw = (kh - 1) * dh, (kw - 1) * dw
        x = tf.pad(x, [[0, 0], [ph // 2, ph - ph // 2], [pw // 2, pw - pw // 2], [0, 0]])
    else:
        height, width = height - (kh - 1) * dh, width - (kw - 1) * dw
    return [_by_position(x[:, i * dh: i * dh + height, j * dw: j * dw + width], n) for i in range(kh) for j in range(kw)]


def _axes(axis) -> list[int]:
    return [axis] if isinstance(axis, int) else list(axis)


def _entries(shape) -> int:
    return math.prod(int(dim) for dim in shape)


def _run(model: Any, xs: list[tf.Tensor], wanted: set[int], ruled: Callable[[Any, tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """The model's outputs for ``xs``: the layers holding a differentiated weight (by ``id`` in ``wanted``)
    called by ``ruled``, every other one as itself (its own ``call``, masks and all), in inference mode."""
    def call(op):
        def apply(*args, **kwargs):
            if type(op) in _RULED and any(id(v) in wanted for v in op.trainable_weights):
                return ruled(op, args[0])
            if getattr(op, "_call_has_training_arg", False):
                kwargs["training"] = False
            return op(*args, **kwargs)

        return apply

    if isinstance(model, keras.Sequential):
        x = xs[0]
        for layer in model.layers:
            if type(layer) is not keras.layers.InputLayer:
                x = call(layer)(x)
        return x
    return model._run_through_graph(xs, operation_fn=call)


def _forward(layer: Any, x: tf.Tensor, wanted: set[int], saved: dict) -> tf.Tensor:
    """The layer's output for ``x``, its differentiated pre-activation ``z`` kept with its input."""
    if isinstance(layer, keras.layers.BatchNormalization):
        mean, variance = tf.cast(layer.moving_mean, x.dtype), tf.cast(layer.moving_variance, x.dtype)
        x_hat = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
        z = x_hat * layer.gamma if layer.scale else x_hat
        z = z + layer.beta if layer.center else z
        keep = x_hat
    elif isinstance(layer, keras.layers.LayerNormalization):
        x_hat = keras.ops.layer_normalization(x, None, None, -1, layer.epsilon)
        z = x_hat * layer.gamma if layer.scale else x_hat
        z = z + layer.beta if layer.center else z
        keep = x_hat
    elif isinstance(layer, keras.layers.Embedding):
        ids = x if x.dtype in (tf.int32, tf.int64) else tf.cast(x, tf.int32)  # as the layer's call casts them
        keep = tf.where(ids < 0, ids + layer.input_dim, ids)  # and as keras.ops.take wraps negative ids
        z = tf.gather(layer.embeddings, keep)
    else:
        if isinstance(layer, keras.layers.Dense):
            z = tf.matmul(x, layer.kernel) if x.shape.rank == 2 else tf.tensordot(x, layer.kernel, [[x.shape.rank - 1], [0]])
        else:
            z = layer.convolution_op(x, layer.kernel)
        if layer.use_bias:
            z = z + layer.bias
        keep = x
    for variable in layer.trainable_weights:
        if id(variable) in wanted:
            saved[id(variable)] = (layer, keep, z)
    activation = getattr(layer, "activation", None)
    return activation(z) if activation is not None else z


def _per_sample(layer: Any, x: tf.Tensor, dz: tf.Tensor, wanted: set[int], squares: bool,
                factors_of: Callable[[Any], tuple[tf.Tensor, tf.Tensor] | None],
                ) -> tuple[dict[int, tf.Tensor], set[int]]:
    """Each differentiated weight's per-element gradient (or its squared norm) from the layer's input
    (``x_hat`` for BatchNormalization) and ``dz``, or a kernel's Kronecker projection where ``factors_of``
    gives its factors; and the weights (by ``id``) so projected."""
    n = tf.shape(dz)[0]
    out: dict[int, tf.Tensor] = {}
    squared: set[str] = set()  # the weights whose squared norms are computed without their gradients
    done: set[int] = set()
    positions = list(range(1, dz.shape.rank - 1))  # axes summed over: all but the element's and the channels'
    if isinstance(layer, _NORMALIZATIONS):
        grads = {"gamma": tf.reduce_sum(dz * x, positions), "beta": tf.reduce_sum(dz, positions)}
    elif isinstance(layer, keras.layers.Embedding):
        ids, rows = _by_position(x[..., None], n)[..., 0], _by_position(dz, n)
        count = ids.shape[1]
        if squares and count is not None and count**2 <= layer.input_dim * layer.output_dim:
            grads, squared = {"embeddings": _embedding_squares(ids, rows)}, {"embeddings"}
        else:
            grads = {"embeddings": _embedding_gradient(ids, rows, layer)}
    elif squares and isinstance(layer, keras.layers.Dense) and x.shape.rank == 2:
        # One position: the kernel's gradient is the outer product of x and dz, the bias's is dz.
        dz_squares = _squared_norms(dz)
        grads = {"kernel": _squared_norms(x) * dz_squares}
        if layer.use_bias:
            grads["bias"] = dz_squares
        squared = set(grads)
    else:
        parts = [_by_position(x, n)] if isinstance(layer, keras.layers.Dense) else _patches(layer, x, n)
        outputs = _by_position(dz, n)
        pair = None if squares else factors_of(layer.kernel)
        if squares:
            grads, squared = {"kernel": _kernel_squares(parts, outputs)}, {"kernel"}
        elif pair is not None:
            a, b = pair
            rows = tf.split(a, [part.shape[-1] for part in parts]) if len(parts) > 1 else [a]
            projected = tf.add_n([tf.einsum("npi,ik->npk", part, a_rows) for part, a_rows in zip(parts, rows)])
            kept = tf.matmul(projected, tf.einsum("npo,ol->npl", outputs, b), transpose_a=True)
            grads, done = {"kernel": tf.reshape(kept, (n, a.shape[1] * b.shape[1]))}, {id(layer.kernel)}
        else:
            formed = tf.concat([tf.matmul(part, outputs, transpose_a=True) for part in parts], axis=1)
            grads = {"kernel": tf.reshape(formed, (n, *layer.kernel.shape))}
        if layer.use_bias:
            grads["bias"] = tf.reduce_sum(dz, positions)
    if squares:
        grads = {name: value if name in squared else _squared_norms(value) for name, value in grads.items()}
    for name, value in grads.items():
        variable = getattr(layer, name, None)
        if variable is not None and id(variable) in wanted:
            out[id(variable)] = value
    return out, done


def kernel_norm_way(positions: int | None, width: int, height: int) -> str:
    """How ``_kernel_squares`` computes a kernel's norm: ``outer`` (one position), ``gram`` (the Gram
    matrices are smaller than the gradient) or ``formed``."""
    if positions == 1:
        return "outer"
    if positions is not None and positions * positions * (width + height) < positions * width * height:
        return "gram"
    return "formed"


def _kernel_squares(parts: list[tf.Tensor], outputs: tf.Tensor) -> tf.Tensor:
    """``||sum_p a_p b_p^T||^2`` per element (float64) for inputs ``a`` ``(N, P, i)``, given as groups of its
    columns ``parts`` (``_patches``), and ``outputs`` ``b`` ``(N, P, o)``: without forming the ``(i, o)``
    gradient where the ``P x P`` Gram matrices are smaller (``sum_pq (a_p . a_q)(b_p . b_q)``, TF Privacy's
    and Opacus' ghost norm; with one position, ``|a|^2 |b|^2``), else from the gradient formed."""
    way = kernel_norm_way(parts[0].shape[1], sum(part.shape[2] for part in parts), outputs.shape[2])
    if way == "outer":
        return _squared_norms(tf.concat([part[:, 0] for part in parts], axis=1)) * _squared_norms(outputs[:, 0])
    if way == "gram":  # the terms can cancel: summed in float64
        a = tf.add_n([tf.matmul(part, part, transpose_b=True) for part in (tf.cast(p, tf.float64) for p in parts)])
        b = tf.cast(outputs, tf.float64)
        return tf.reduce_sum(a * tf.matmul(b, b, transpose_b=True), axis=(1, 2))
    return tf.add_n([tf.reduce_sum(tf.square(tf.cast(tf.matmul(part, outputs, transpose_a=True), tf.float64)), axis=(1, 2))
                     for part in parts])


def _squared_norms(x: tf.Tensor) -> tf.Tensor:
    """Each element's sum of squares ``(N,)``, float64. A sum of squares cannot cancel: over at most
    ``FEW_SQUARES`` entries it is summed in the compute dtype (float32: at most 1,024 x its epsilon off, 6e-5,
    under the paths' agreement), without casting a layer's inputs and output gradients; over more, in
    float64."""
    entries = x.shape[1:].num_elements()
    flat = x if x.shape.rank == 2 else tf.reshape(x, (-1, entries) if entries is not None else (tf.shape(x)[0], -1))
    if entries is None or entries > FEW_SQUARES:
        flat = tf.cast(flat, tf.float64)
    return tf.cast(tf.reduce_sum(tf.square(flat), axis=1), tf.float64)


def _embedding_gradient(ids: tf.Tensor, rows: tf.Tensor, layer: Any) -> tf.Tensor:
    """Each element's ``(vocabulary, width)`` gradient: its rows of ``dz`` ``(N, P, width)`` added into the
    rows of its ids ``(N, P)`` (an id looked up twice gets both)."""
    n, vocabulary = tf.shape(ids)[0], layer.input_dim
    segments = tf.cast(ids, tf.int64) + tf.cast(vocabulary, tf.int64) * tf.range(tf.cast(n, tf.int64))[:, None]
    summed = tf.math.unsorted_segment_sum(tf.reshape(rows, (-1, rows.shape[-1])), tf.reshape(segments, (-1,)),
                                          tf.cast(n, tf.int64) * vocabulary)
    return tf.reshape(summed, (n, vocabulary, rows.shape[-1]))


def _embedding_squares(ids: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """An embedding gradient's squared norm per element (float64) without forming it: ``sum_pq [id_p = id_q]
    (dz_p . dz_q)`` (TF Privacy's embedding rule, by a masked Gram matrix of the element's positions)."""
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), tf.float64)
    b = tf.cast(rows, tf.float64)
    return tf.reduce_sum(same * tf.matmul(b, b, transpose_b=True), axis=(1, 2))
