"""What a block differentiates: the output rows chosen per sample and the fixed matrices of products.

Every stored result is ``L J R`` for each sample's Jacobian ``J`` (``m`` outputs by ``d`` input entries,
both flattened), followed by a numpy reduction (``transforms.engine.reductions``):

- ``L`` (reverse mode only) is the identity, a per-sample choice of rows (``outputs: indices | argmax |
  top_k | label``, an int array ``index`` of shape ``(n, k)``) or a fixed matrix ``left`` ``(r, m)``
  (``reduce: vjp``, or a basis over outputs only);
- ``R`` (forward mode only) is the identity or a fixed matrix given by its columns as rows, ``right``
  ``(c, d)`` (``reduce: jvp | project``, or a basis over inputs);
- ``after`` ``(p, m)`` is applied to forward results when a basis has both sides: ``U^T (J V)``.

Numpy only: the matrices are checked against the model here, once, before anything is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from jacobeam.transforms.engine.reductions import SQUARE, projection_matrix
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import EngineOptions, OutputSelection

Kind = Literal["identity", "index", "matrix"]
# Reductions that apply to selected rows as well as to all of them.
_ROW_REDUCTIONS = ("none", "frobenius", "max_abs_over_outputs", "sum_abs_over_channels", "project")


@dataclasses.dataclass(frozen=True, eq=False)
class Operands:
    """The output selection and the fixed matrices of one engine (see the module docstring)."""

    selection: OutputSelection
    outputs: int  # m
    sizes: tuple[int, ...]  # d of each model input
    left: np.ndarray | None = None
    right: np.ndarray | None = None
    after: np.ndarray | None = None

    def kind(self, mode: str) -> Kind:
        """What a block of ``mode`` takes as its third argument."""
        if mode == "forward":
            return "identity" if self.right is None else "matrix"
        if self.left is not None:
            return "matrix"
        return "identity" if self.selection.rule == "all" else "index"

    def extent(self, mode: str, k: int) -> int:
        """Rows (reverse) or columns (forward) that the blocks of input ``k`` cover."""
        if mode == "forward":
            return self.sizes[k] if self.right is None else len(self.right)
        if self.left is not None:
            return len(self.left)
        return self.selection.count or self.outputs

    def columns(self, k: int) -> int:
        """``c``: the columns of ``J R`` for input ``k``."""
        return self.sizes[k] if self.right is None else len(self.right)

    @property
    def selects_by_output(self) -> bool:
        """Whether the rows chosen depend on the model's outputs (``argmax``, ``top_k``): only then does a
        selection need the outputs before the differentiated pass."""
        return self.selection.rule in ("argmax", "top_k")

    def select(self, n: int, y: np.ndarray | None, labels: np.ndarray | None) -> np.ndarray | None:
        """Per-sample flat output indices ``(n, k)`` of a batch of ``n`` samples; None for all. ``y``, the
        outputs ``(n, ...)``, is needed only where ``selects_by_output``."""
        selection = self.selection
        if selection.rule == "all":
            return None
        if selection.rule == "indices":
            return np.broadcast_to(np.asarray(selection.indices, np.int32), (n, len(selection.indices)))
        if selection.rule == "argmax":
            return np.argmax(y.reshape(n, -1), axis=1).astype(np.int32)[:, None]
        if selection.rule == "top_k":
            return np.argsort(-y.reshape(n, -1), axis=1, kind="stable")[:, : selection.k].astype(np.int32)
        if labels is None:
            raise ModelError("jacobian.outputs label: no labels were given with the samples")
        labels = np.asarray(labels)
        if labels.size != n:
            raise ModelError(f"jacobian.outputs label: {labels.size} labels for {n} samples; expected one per sample")
        labels = labels.reshape(n)
        bad = np.flatnonzero((labels < 0) | (labels >= self.outputs) | (labels != np.round(labels)))
        if len(bad):
            raise ModelError(f"label {labels[bad[0]]} of batch row {bad[0]} is not an output index 0..{self.outputs - 1}")
        return labels.astype(np.int32)[:, None]


def build_operands(
    options: EngineOptions,
    output_shape: tuple[int, ...],
    input_shapes: tuple[tuple[int, ...], ...],
    input_names: tuple[str, ...],
    source: str,
) -> Operands:
    """Check the output selection and reduction against the model and load their matrices."""
    selection, reduction = options.outputs, options.reduce
    kind = reduction.kind
    m = int(np.prod(output_shape, dtype=np.int64))
    sizes = tuple(int(np.prod(shape, dtype=np.int64)) for shape in input_shapes)
    refusal = options.one_input_only() if len(input_names) > 1 else None
    if refusal:
        raise ModelError(f"{refusal}; {source} takes inputs {list(input_names)}")
    if selection.rule == "indices" and not all(0 <= i < m for i in selection.indices):
        raise ModelError(f"jacobian.outputs: indices {list(selection.indices)} out of range 0..{m - 1} for {source}")
    if selection.rule == "top_k" and not 1 <= selection.k <= m:
        raise ModelError(f"jacobian.outputs: top_k {selection.k} out of range 1..{m} for {source}")
    if selection.rule != "all" and kind not in _ROW_REDUCTIONS:
        raise ModelError(f"jacobian.reduce {kind} cannot be combined with outputs {selection.rule!r}")
    d = sizes[0]
    if kind in SQUARE and m != d:
        raise ModelError(f"jacobian.reduce {kind}: needs a square Jacobian; {source} maps {d} input entries to {m} outputs")

    def matrix(path, key, shape, basis=False):
        return _load_matrix(path, key, shape, kind, options.compute_dtype, basis)

    left = right = after = None
    if kind == "vjp":
        left = matrix(reduction.vectors, "jacobian.vectors", output_shape)
    elif kind == "jvp":
        right = matrix(reduction.vectors, "jacobian.vectors", input_shapes[0])
    elif kind == "project":
        projection = projection_matrix(d, reduction.project_dim, reduction.project_kind, reduction.project_seed)
        right = projection.T.astype(options.compute_dtype)
    elif kind == "basis":
        inputs = matrix(reduction.basis_input, "jacobian.basis.input", (d,), basis=True)
        outputs = matrix(reduction.basis_output, "jacobian.basis.output", (m,), basis=True)
        if inputs is None and outputs is None:
            raise ModelError("jacobian.reduce basis: give jacobian.basis.input and/or jacobian.basis.output")
        if inputs is not None:
            right, after = inputs, outputs
        else:
            left = outputs
    return Operands(selection, m, sizes, left, right, after)


def _load_matrix(
    path: str | None, key: str, shape: tuple[int, ...], kind: str, dtype: str, basis: bool
) -> np.ndarray | None:
    """Vectors from a .npy file as rows ``(r, prod(shape))``. Vectors are ``(r, *shape)`` (or one of
    ``shape``); a basis is ``(prod(shape), r)``: its columns are the vectors."""
    if path is None:
        if basis:
            return None
        raise ModelError(f"{key}: reduce {kind} needs a .npy file of vectors")
    import tensorflow as tf  # for tf.io.gfile: the file may be remote

    try:
        with tf.io.gfile.GFile(path, "rb") as stream:
            array = np.load(stream)
    except (OSError, ValueError, tf.errors.OpError) as err:
        raise ModelError(f"{key} {path}: cannot read a .npy array: {err}") from err
    size = int(np.prod(shape, dtype=np.int64))
    if basis:
        if array.ndim != 2 or array.shape[0] != size:
            raise ModelError(f"{key} {path}: shape {array.shape}; expected ({size}, r): one column per basis vector")
        array = array.T
    elif array.shape == shape:
        array = array[None]
    elif array.shape[1:] != shape:
        raise ModelError(f"{key} {path}: shape {array.shape}; expected (r, {', '.join(map(str, shape))}) or {shape}")
    return np.ascontiguousarray(array.reshape(len(array), size), dtype=dtype)
