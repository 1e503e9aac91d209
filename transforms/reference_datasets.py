"""Every dataset a run stores, rebuilt from its definition in float64 numpy: the checker's own implementation.

The engine turns what its blocks compute into datasets with ``transforms.engine.operands``,
``transforms.engine.reductions`` and ``transforms.engine.assembly``. The self-check and ``jacobeam verify``
(``transforms.self_check``) rebuild each dataset from a reference Jacobian here instead, from the
definitions in docs/what-to-store.md and sharing no code with those modules: a bug in the engine's
post-processing (a max computed as a min, the rows of another output, a projection drawn from another
seed) is then not reproduced by the check that judges it. The vectors, bases and projection are loaded
or drawn again here, from the configuration, for the same reason.

Also here: how each dataset splits into rows (``split_rows``), so that each stored row is judged at its own
scale, and the scale a dataset is judged at where its largest entry is not it (``trace``, ``diagonal``,
``logabsdet``). The outputs of a model ending in a softmax or a sigmoid are probabilities, each computed to
its own relative precision (``log p_i`` is ``z_i - logsumexp(z)`` to float32's absolute precision), so
they are judged as their logs too: at the largest probability's scale alone, a class at 1e-6 zeroed, or
the 3rd largest class exchanged for one at 1e-25, would pass.

Numpy only; TensorFlow only to open a vectors file that may be remote.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jacobeam.transforms.output.layout import jacobian_dataset
from jacobeam.transforms.spec import EngineOptions

# Datasets judged as one row whatever their shape: scalars, and the diagonal (entries of different rows).
_ONE_ROW = ("output", "frobenius", "trace", "sign", "logabsdet", "diagonal")


def _vectors(path: str, key: str) -> np.ndarray:
    import tensorflow as tf  # tf.io.gfile: the file may be remote

    with tf.io.gfile.GFile(path, "rb") as stream:
        array = np.load(stream)
    if array.dtype.kind not in "fiu":
        raise ValueError(f"{key} {path}: dtype {array.dtype}; expected numbers")
    return np.asarray(array, np.float64)


def projection(d: int, dim: int, kind: str, seed: int) -> np.ndarray:
    """``P`` ``(d, dim)`` as docs/what-to-store.md defines it: ``numpy.random.default_rng(seed)``, Rademacher
    signs (``rng.choice([-1.0, 1.0], size=(d, dim))``) or standard normals, over ``sqrt(dim)``."""
    rng = np.random.default_rng(seed)
    draws = rng.choice([-1.0, 1.0], size=(d, dim)) if kind == "rademacher" else rng.standard_normal((d, dim))
    return draws / np.sqrt(dim)


def clipped_log(values: np.ndarray, log_floor: float) -> np.ndarray:
    """The logs of probabilities, each clipped at ``log_floor`` (NaN stays NaN)."""
    with np.errstate(invalid="ignore"):
        return np.log(np.maximum(np.asarray(values, np.float64), log_floor))


def probability_rows(values: np.ndarray, log_floor: float) -> np.ndarray:
    """Probabilities as the two rows they are judged as: themselves, and their logs (``clipped_log``)."""
    flat = np.asarray(values, np.float64).reshape(-1)
    return np.stack([flat, clipped_log(flat, log_floor)])


def least_scales(name: str, rows: int, log_floor: float | None) -> np.ndarray:
    """Per judged row of a dataset, the least scale it is judged at: 1 for the log of probabilities (an
    absolute error there is a relative one of the probability; ``log p`` near 0 has no precision of its
    own), 0 for the rest."""
    least = np.zeros(rows)
    if name == "output" and log_floor is not None:
        least[1] = 1.0
    return least


class ReferenceDatasets:
    """The datasets of one sample from its outputs and Jacobian (see the module docstring).

    ``output_shape``, ``input_shapes`` and ``input_names`` are the model's, ``wrt`` the positions of the
    inputs differentiated by. The matrices of a product are read when the object is made.
    """

    def __init__(self, options: EngineOptions, output_shape, input_shapes, input_names, wrt,
                 log_floor: float | None = None):
        self.kind = options.reduce.kind
        # Where the outputs are probabilities: they are judged as their logs too, each clipped at this
        # smallest normal number of the store dtype (below it a stored value has no relative precision).
        self.log_floor = log_floor
        self.output_shape = tuple(int(d) for d in output_shape)
        self.input_shapes = [tuple(int(d) for d in shape) for shape in input_shapes]
        self.input_names, self.wrt = list(input_names), list(wrt)
        self.m = int(np.prod(self.output_shape, dtype=np.int64))
        reduce = options.reduce
        first = self.input_shapes[self.wrt[0]]
        d = int(np.prod(first, dtype=np.int64))
        self.left = self.right = None  # U^T (p, m) on the output side; V^T (q, d) on the input side
        if self.kind == "vjp":
            self.left = _vectors(reduce.vectors, "jacobian.vectors").reshape(-1, self.m)
        elif self.kind == "jvp":
            self.right = _vectors(reduce.vectors, "jacobian.vectors").reshape(-1, d)
        elif self.kind == "project":
            self.right = projection(d, reduce.project_dim, reduce.project_kind, reduce.project_seed).T
        elif self.kind == "basis":
            if reduce.basis_output:
                self.left = _vectors(reduce.basis_output, "jacobian.basis.output").T  # columns are the vectors
            if reduce.basis_input:
                self.right = _vectors(reduce.basis_input, "jacobian.basis.input").T

    @property
    def directions(self) -> np.ndarray | None:
        """``(c, d)``: the input-side vectors a forward-mode reference differentiates along (``J v`` for
        each row ``v``), where the stored result is a product with them; None otherwise."""
        return self.right

    def datasets(
        self, y: np.ndarray, jacobians: Mapping[int, np.ndarray], index: np.ndarray | None,
        selected: bool = False, along: bool = False,
    ) -> dict[str, np.ndarray]:
        """The stored datasets of one sample, each ``(1, ...)`` in float64 (``output_index`` int64).

        ``y``: the outputs; ``jacobians[k]``: the Jacobian by input ``k`` as ``(rows, columns)``, its rows
        all ``m`` outputs, or only those of ``index`` where ``selected``; its columns the input's entries, or
        the ``directions``' where ``along`` (the reference ran its JVPs along them: ``J V^T``). ``index``:
        the flat output rows chosen for this sample, or None for all.
        """
        y = np.asarray(y, np.float64).reshape(-1)
        out: dict[str, np.ndarray] = {"output": y.reshape(1, *self.output_shape)}
        rows_shape = self.output_shape
        if index is not None:
            index = np.asarray(index, np.int64).reshape(-1)
            out["output_index"] = index.reshape(1, -1)
            rows_shape = (len(index),)

        def rows(k: int) -> np.ndarray:
            jacobian = np.asarray(jacobians[k], np.float64)
            return jacobian if index is None or selected else jacobian[index]

        kind = self.kind
        if kind == "none":
            several = len(self.input_names) > 1
            for k in self.wrt:
                name = jacobian_dataset(self.input_names[k], several)
                out[name] = rows(k).reshape(1, *rows_shape, *self.input_shapes[k])
            return out
        k = self.wrt[0]
        shape = self.input_shapes[k]
        if kind in ("jvp", "project", "basis") and self.right is not None and not along:
            product = rows(k) @ self.right.T  # J V: one column per input-side vector
        else:
            product = rows(k)
        if kind == "frobenius":
            out["frobenius"] = np.sqrt(np.sum(product**2)).reshape(1)
        elif kind == "diagonal":
            out["diagonal"] = np.diagonal(product).reshape(1, -1)
        elif kind == "trace":
            out["trace"] = np.array([np.trace(product)])
        elif kind == "slogdet":
            sign, logabsdet = np.linalg.slogdet(product)
            out["sign"], out["logabsdet"] = np.array([sign]), np.array([logabsdet])
        elif kind == "max_abs_over_outputs":
            out["saliency"] = np.max(np.abs(product), axis=0).reshape(1, *shape)
        elif kind == "sum_abs_over_channels":
            out["saliency"] = np.sum(np.abs(product.reshape(*rows_shape, *shape)), axis=-1)[None]
        elif kind == "vjp":  # u^T J for each vector u
            out["vjp"] = (self.left @ product).reshape(1, -1, *shape)
        elif kind == "jvp":  # J v for each vector v, the vector first
            out["jvp"] = product.T.reshape(1, -1, *self.output_shape)
        elif kind == "project":
            out["projection"] = product.reshape(1, *rows_shape, product.shape[-1])
        elif kind == "basis":
            out["basis_projection"] = (product if self.left is None else self.left @ product)[None]
        else:
            raise ValueError(f"jacobian.reduce {kind!r}: no reference definition")
        return out

    def scale(self, name: str, jacobians: Mapping[int, np.ndarray]) -> float | None:
        """The scale a dataset's error is measured against where it is not the dataset's own largest entry:
        ``logabsdet`` absolutely (1), ``trace`` the sum of the diagonal's absolute entries, ``diagonal`` the
        Jacobian's largest entry; None for the rest."""
        if name == "logabsdet":
            return 1.0
        if name not in ("trace", "diagonal"):
            return None
        jacobian = np.asarray(jacobians[self.wrt[0]], np.float64)
        finite = jacobian[np.isfinite(jacobian)]
        if name == "diagonal":
            return float(np.abs(finite).max()) if finite.size else 0.0
        return float(np.abs(np.diagonal(jacobian)).sum())

    def least_scales(self, name: str, rows: int) -> np.ndarray:
        """Per row of ``split_rows``, the least scale it is judged at (``least_scales``)."""
        return least_scales(name, rows, self.log_floor)

    def split_rows(self, name: str, values: np.ndarray, rows: int) -> np.ndarray:
        """One sample's dataset ``values`` ``(1, ...)`` as ``(rows, entries)`` float64: one row per output
        row (``rows`` of them: of the Jacobian, its selected rows, a row-wise reduction or projection) or per
        vector of a product (``vjp``, ``jvp``, ``basis_projection``); one row for the outputs and the scalars,
        and a second, their logs, for outputs that are probabilities (``log_floor``)."""
        values = np.asarray(values, np.float64)
        if name == "output" and self.log_floor is not None:
            return probability_rows(values, self.log_floor)
        if name in _ONE_ROW or self.kind == "max_abs_over_outputs":
            return values.reshape(1, -1)
        if self.kind in ("vjp", "jvp", "basis"):
            return values.reshape(values.shape[1], -1)
        return values.reshape(rows, -1)
