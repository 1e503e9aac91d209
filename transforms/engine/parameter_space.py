"""The parameter side's definitions, shared by the engine, its self-check and a user rebuilding what a run
stored: which weights are differentiated (``ParameterLayout``), the per-sample objective
(``objective_value``) and the seeded projection of the parameter axis (``projection_block``).

The projection ``P`` ``(p, dim)`` of ``jacobian.project`` on the parameter side is never formed whole (a
ResNet-18's would be 90 GB at dim 2,048): it is defined block by block. The rows of weight ``v`` (its
entries flattened in C order) are cut into blocks of ``BLOCK_ROWS``; block ``j`` of weight ``v`` is
``(BLOCK_ROWS, dim)`` random entries from the Philox stream of seed ``(seed, v * 2**32 + j)``, divided by
``sqrt(dim)``, the rows past the weight's end dropped. Rademacher signs are the bits of
``tf.random.stateless_uniform`` int32 words ``(BLOCK_ROWS, ceil(dim / 32))``: entry ``(i, c)`` is ``+1``
where bit ``c % 32`` of word ``(i, c // 32)`` is set, else ``-1``; gaussian entries are
``tf.random.stateless_normal``'s. TensorFlow documents these streams as identical on CPU and GPU for a
given seed and version; the manifest records the TensorFlow version with the seed.

``project.structure: kronecker`` (LoGra's projection) gives each weight of two or more axes, seen as a
matrix ``(i, o)`` (``o`` its last axis, ``i`` the others flattened in C order: a Dense kernel's inputs, a
Conv2D's ``(kh, kw, c_in)`` patch), the rows ``kron(A, B)``: ``A`` ``(i, k_in)`` and ``B`` ``(o, k_out)`` with
``k_in * k_out = dim`` (``kronecker_factors``), drawn as above from the Philox streams of seed ``(seed,
-(2v + 1))`` and ``(seed, -(2v + 2))`` and divided by ``sqrt(k_in)`` and ``sqrt(k_out)``. A gradient
``G`` ``(i, o)`` of the weight projects to ``A^T G B`` flattened in C order; where ``G`` is a sum of outer
products of a layer's inputs and output gradients, ``sum_p (A^T a_p)(B^T b_p)^T``, without forming ``G``
(the cost of a backward pass, not of ``p x dim``). Weights of one axis (biases, normalisation scales)
keep their dense blocks.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobeam.transforms.errors import ModelError

BLOCK_ROWS = 4096  # rows of P generated at a time (a weight's flat entries per block)
OBJECTIVES = ("outputs", "margin", "loss")
# Keras losses of a class label, by name: what the labels are turned into for each.
LOSSES = {"sparse_categorical_crossentropy": "index", "categorical_crossentropy": "one_hot"}
_OCTET_BITS = (np.arange(256)[:, None] >> np.arange(8)) & 1 == 1  # (256, 8): the bits of each octet value


@dataclasses.dataclass(frozen=True)
class Weight:
    """One differentiated weight: its position in the model's ``trainable_variables``, its name, its
    layer's name, its shape and where its entries begin on the parameter axis."""

    index: int
    name: str
    layer: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ParameterLayout:
    """The parameter axis: the chosen weights, in the model's order, flattened and concatenated."""

    weights: tuple[Weight, ...]

    @property
    def size(self) -> int:
        return sum(w.size for w in self.weights)

    @property
    def layers(self) -> tuple[str, ...]:
        """The layers owning the weights, in order of their first weight: the columns of
        ``frobenius_by_layer``."""
        return tuple(dict.fromkeys(w.layer for w in self.weights))

    def describe(self) -> dict[str, Any]:
        """For the manifest: enough to cut a stored gradient back into weights and rebuild ``P``."""
        return {
            "size": self.size,
            "projection_block_rows": BLOCK_ROWS,
            "layers": list(self.layers),
            "weights": [{"index": w.index, "name": w.name, "layer": w.layer, "shape": list(w.shape), "offset": w.offset}
                        for w in self.weights],
        }


def layout(keras_model, names: Sequence[str] | None, source: str) -> tuple[ParameterLayout, list[tf.Variable]]:
    """The weights to differentiate: every trainable weight of ``keras_model``, or those of the layers or
    weights named in ``names`` (a layer's name takes all its trainable weights; a weight's full name
    ``layer/kernel`` or its path takes one). Refuses names the model does not have, naming them."""
    variables = list(keras_model.trainable_variables)
    if not variables:
        raise ModelError(f"jacobian.wrt: parameters: {source} has no trainable weights")
    owners = _owners(keras_model)
    wanted = set(names or ())
    chosen, found = [], set()
    for index, variable in enumerate(variables):
        layer = owners.get(id(variable), "")
        labels = {layer, getattr(variable, "path", variable.name), variable.name, f"{layer}/{variable.name}"}
        if names is None or labels & wanted:
            chosen.append((index, variable, layer))
            found |= labels & wanted
    missing = sorted(wanted - found)
    if missing:
        known = sorted({owner for owner in owners.values()})
        raise ModelError(f"jacobian.wrt: {source} has no trainable layer or weight {missing}; its trainable layers "
                         f"are {known}")
    weights, offset = [], 0
    for index, variable, layer in chosen:
        shape = tuple(int(d) for d in variable.shape)
        name = getattr(variable, "path", None) or f"{layer}/{variable.name}"
        weights.append(Weight(index, name, layer, shape, offset))
        offset += math.prod(shape)
    return ParameterLayout(tuple(weights)), [variable for _, variable, _ in chosen]


def _owners(keras_model) -> dict[int, str]:
    """The name of the innermost layer holding each trainable weight, by the weight's ``id``."""
    owners: dict[int, str] = {}
    for layer in keras_model._flatten_layers(include_self=False, recursive=True):
        for variable in layer.trainable_weights:
            owners[id(variable)] = layer.name  # deeper layers come later and win
    return owners


def projection_block(seed: int, kind: str, weight: int, block: int, dim: int, dtype, rows: int = BLOCK_ROWS) -> tf.Tensor:
    """Block ``block`` of weight position ``weight`` of ``P``: ``(BLOCK_ROWS, dim)`` (module docstring), or its
    first ``rows`` rows, drawn alone: Philox fills a shape in row-major counter order, so a shorter draw is
    the longer one's first rows (``tests/test_parameters.py`` checks it), and a weight of 16 entries need not
    draw 4,096 rows."""
    key = tf.stack([tf.cast(seed, tf.int64), tf.cast(weight, tf.int64) * 2**32 + tf.cast(block, tf.int64)])
    return _drawn(key, kind, rows, dim, dtype)


def kronecker_factors(dim: int) -> tuple[int, int]:
    """``(k_in, k_out)`` of ``project.structure: kronecker``: ``k_in`` the largest divisor of ``dim`` not
    above its square root (2,048: 32 x 64; a prime ``dim``: 1 x ``dim``)."""
    k_in = max(k for k in range(1, math.isqrt(dim) + 1) if dim % k == 0)
    return k_in, dim // k_in


def factored(weight: Weight) -> tuple[int, int] | None:
    """The matrix ``(i, o)`` a weight is seen as by the Kronecker projection; None for a weight of one axis."""
    if len(weight.shape) < 2:
        return None
    return weight.size // weight.shape[-1], weight.shape[-1]


def projection_factors(seed: int, kind: str, weight: int, matrix: tuple[int, int], dim: int,
                       dtype) -> tuple[tf.Tensor, tf.Tensor]:
    """``(A (i, k_in), B (o, k_out))`` of weight position ``weight`` seen as the matrix ``(i, o)`` (module
    docstring): its rows of ``P`` are ``kron(A, B)``."""
    found = []
    for f, (rows, k) in enumerate(zip(matrix, kronecker_factors(dim))):
        key = tf.stack([tf.cast(seed, tf.int64), -(2 * tf.cast(weight, tf.int64) + f + 1)])
        found.append(_drawn(key, kind, rows, k, dtype))
    return found[0], found[1]


def _drawn(key: tf.Tensor, kind: str, rows: int, dim: int, dtype) -> tf.Tensor:
    """``(rows, dim)`` entries of the Philox stream ``key`` (module docstring), divided by ``sqrt(dim)``."""
    if kind == "gaussian":
        values = tf.random.stateless_normal((rows, dim), key, dtype=tf.float32, alg="philox")
        return tf.cast(values, dtype) / tf.cast(math.sqrt(dim), dtype)
    # 32 signs from each random word (Philox's cost divided by 32), looked up an octet at a time: one gather
    # from a (256, 8) table writes the block, where shifting, masking, casting and scaling each entry made
    # four passes over it. The table holds the same quotients, so the entries are the same bits. The octets
    # are the words' bytes (a bitcast, not shifts and masks), least significant first.
    words = tf.random.stateless_uniform((rows, -(-dim // 32)), key, minval=None, maxval=None, dtype=tf.int32,
                                        alg="philox")
    octets = tf.bitcast(words, tf.uint8)  # (rows, words, 4): bit c of a row is bit c % 8 of octet c // 8
    if sys.byteorder == "big":
        octets = octets[..., ::-1]
    octets = tf.cast(octets, tf.int32)
    scale = tf.ones((), dtype) / tf.cast(math.sqrt(dim), dtype)
    signs = tf.where(_OCTET_BITS, scale, -scale)  # (256, 8): entry k of octet b is +scale where its bit k is set
    return tf.reshape(tf.gather(signs, octets), (rows, -1))[:, :dim]


def projection_blocks(seed: int, kind: str, weight: Weight, dim: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """The rows of ``P`` for one weight, block by block: ``(start, stop, rows)`` with ``rows`` ``(stop - start,
    dim)`` float64 for the weight's flat entries ``[start, stop)``."""
    for j in range(-(-weight.size // BLOCK_ROWS)):
        start, stop = j * BLOCK_ROWS, min((j + 1) * BLOCK_ROWS, weight.size)
        yield start, stop, np.asarray(projection_block(seed, kind, weight.index, j, dim, tf.float32, stop - start), np.float64)


def projection_rows(seed: int, kind: str, weight: Weight, dim: int, structure: str = "dense") -> np.ndarray:
    """The rows of ``P`` for one weight, ``(weight.size, dim)`` float64: what a user rebuilding a stored
    projection computes (``P = concatenate([projection_rows(...) for each weight])``, where it fits in
    memory; else ``projection_blocks``, or ``projection_factors`` for ``structure: kronecker``)."""
    matrix = factored(weight) if structure == "kronecker" else None
    if matrix is not None:
        a, b = projection_factors(seed, kind, weight.index, matrix, dim, tf.float32)
        return np.kron(np.asarray(a, np.float64), np.asarray(b, np.float64))
    return np.concatenate([rows for _, _, rows in projection_blocks(seed, kind, weight, dim)])


def rows_shape(side, selection, output_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The rows each sample's stored values have: ``()`` for an objective, the output shape for every
    output row, ``(k,)`` for a selection of ``k``."""
    if side.objective != "outputs":
        return ()
    return tuple(output_shape) if selection.count is None else (selection.count,)


def outputs_are_probabilities(keras_model) -> bool:
    """Whether the model's last layer ends in a softmax (its outputs are probabilities, not logits): then a
    margin or a loss is of its logits (``objective_model``)."""
    from jacobeam.transforms.engine.models import last_activation

    return last_activation(keras_model) == "softmax"


def objective_model(model, objective: str):
    """``(model to differentiate, softmax)``: a margin or a loss of a model ending in a softmax is taken from its
    logits (``softmax``: the stored outputs are their softmax), as Keras' losses do where they find them. From
    the probabilities float32 saturates: ``p_y`` rounds to 1 (a margin of inf, NaN gradients) or to 0 (a loss
    clipped at ``-log 1e-7`` with a vanishing gradient), where a float64 tape gives finite values."""
    if objective == "outputs" or not outputs_are_probabilities(model.keras_model):
        return model, False
    return model.with_logits(), True


def objective_values(kind: str, loss: str | None, y: tf.Tensor, labels: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """Each element's scalar objective ``(N,)`` from its flat outputs ``y`` ``(N, m)``: ``outputs``, its output
    ``rows``; ``margin``, TRAK's ``log p_y - log(1 - p_y)`` of its label ``y``, ``z_y - logsumexp(z_j, j != y)``
    of the logits ``y``; ``loss``, the Keras loss ``loss`` of its label, from the logits ``y`` (a model ending in a
    softmax is differentiated without it: ``objective_model``)."""
    if kind == "outputs":
        return tf.gather(y, tf.cast(rows, tf.int32), batch_dims=1)
    labels = tf.cast(labels, tf.int32)
    if kind == "margin":
        others = tf.where(tf.equal(tf.range(tf.shape(y)[1])[None], labels[:, None]), tf.cast(-np.inf, y.dtype), y)
        return tf.gather(y, labels, batch_dims=1) - tf.reduce_logsumexp(others, axis=1)
    import keras

    function = keras.losses.get(loss)
    target = labels if LOSSES[loss] == "index" else tf.one_hot(labels, tf.shape(y)[1], dtype=y.dtype)
    return tf.reshape(function(target, y, from_logits=True), (-1,))


def objective_value(kind: str, loss: str | None, y: tf.Tensor, label: tf.Tensor, row: tf.Tensor) -> tf.Tensor:
    """One element's objective from its flat outputs ``y`` ``(m,)`` (``objective_values`` of one)."""
    return objective_values(kind, loss, y[None], label[None], row[None])[0]
