"""What is kept of each sample's Jacobian: exact reductions of ``J`` and the fixed matrices that
products with ``J`` use. Numpy only.

Shapes: a batch's Jacobians arrive flattened as ``J`` of shape ``(n, r, d)`` (``r`` output rows, the
selected ones if any, ``d`` input entries); results are reshaped to the output and input shapes.
"""

from __future__ import annotations

import numpy as np

from jacobeam.transforms.errors import ModelError

# jacobian.reduce: the values, by how the engine computes them.
FULL = ("none", "frobenius", "diagonal", "trace", "slogdet", "max_abs_over_outputs", "sum_abs_over_channels")  # of J
PRODUCTS = ("vjp", "jvp", "project", "basis")  # products with J; J itself is never formed
SQUARE = ("diagonal", "trace", "slogdet")  # need as many outputs as inputs
# Reductions that need every row of the Jacobian, and so cannot follow a per-sample row selection.
NEEDS_ALL_ROWS = (*SQUARE, "vjp", "jvp", "basis")
# What each reduction keeps, in words (``inspect``, ``--plot``); the datasets are ``reduce_full``'s and
# the engine's ``assemble``'s.
DESCRIPTIONS = {
    "none": "the Jacobian J",
    "frobenius": "the Frobenius norm of J",
    "diagonal": "the diagonal of J",
    "trace": "the trace of J",
    "slogdet": "the sign and log |det J|",
    "max_abs_over_outputs": "max |J| over outputs",
    "sum_abs_over_channels": "|J| summed over channels, the last input axis",
    "vjp": "u^T J for each of the vectors u",
    "jvp": "J v for each of the vectors v",
    "project": "J P, for a seeded random projection P of the inputs",
    "basis": "U^T J V, in fixed bases U and V",
}
# The same on the parameter side (``jacobian.wrt: parameters``), where J is the per-sample gradient (or
# Jacobian) of the objective (or outputs) with respect to the weights.
PARAMETER_DESCRIPTIONS = {
    "none": "the per-sample gradient g of the weights",
    "frobenius": "the norm of the per-sample gradient g of the weights, in total and per layer",
    "project": "g P, the per-sample gradient of the weights times a seeded random projection P",
}


def projection_matrix(d: int, dim: int, kind: str, seed: int) -> np.ndarray:
    """The seeded input-side projection ``P`` of shape ``(d, dim)``, float64.

    ``numpy.random.default_rng(seed)``; rademacher: ``rng.choice([-1.0, 1.0], size=(d, dim))``,
    gaussian: ``rng.standard_normal((d, dim))``; both divided by ``sqrt(dim)`` so that
    ``E[P P^T] = I``. Stored results are ``J P``.
    """
    rng = np.random.default_rng(seed)
    if kind == "rademacher":
        matrix = rng.choice([-1.0, 1.0], size=(d, dim))
    elif kind == "gaussian":
        matrix = rng.standard_normal((d, dim))
    else:
        raise ModelError(f"jacobian.project.kind: expected rademacher or gaussian, got {kind!r}")
    return matrix / np.sqrt(dim)


def reduce_full(
    kind: str, jacobian: np.ndarray, rows_shape: tuple[int, ...], input_shape: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """Datasets for a reduction of full Jacobians ``(n, r, d)``; ``rows_shape`` is the shape of the
    ``r`` rows (the output shape, or ``(k,)`` for selected rows)."""
    n = len(jacobian)
    if kind == "none":
        return {"jacobian": jacobian.reshape((n, *rows_shape, *input_shape))}
    wide = jacobian.astype(np.float64)  # float64 sums and determinants: no overflow, stable
    if kind == "frobenius":
        # Scaled by the largest entry so that squaring can neither overflow nor underflow.
        scale = np.abs(wide).max(axis=(1, 2), keepdims=True)
        scale[scale == 0] = 1.0
        return {"frobenius": scale[:, 0, 0] * np.sqrt(np.sum((wide / scale) ** 2, axis=(1, 2)))}
    if kind == "diagonal":
        return {"diagonal": np.diagonal(jacobian, axis1=1, axis2=2).copy()}
    if kind == "trace":
        return {"trace": np.trace(wide, axis1=1, axis2=2)}
    if kind == "slogdet":
        sign, logabsdet = np.linalg.slogdet(wide)
        return {"sign": sign, "logabsdet": logabsdet}
    if kind == "max_abs_over_outputs":
        return {"saliency": np.abs(jacobian).max(axis=1).reshape((n, *input_shape))}
    if kind == "sum_abs_over_channels":
        shaped = np.abs(jacobian).reshape((n, *rows_shape, *input_shape))
        return {"saliency": shaped.sum(axis=-1, dtype=np.float64)}
    raise ModelError(f"jacobian.reduce: {kind!r} is not a reduction of the full Jacobian")
