"""The datasets an engine stores, assembled from its products: reductions, shapes, store dtype (numpy
only), for ``JacobianEngine``. The checks rebuild the same datasets with code of their own
(``transforms.reference_datasets``), so that a bug here is not repeated by what judges it."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jacobeam.transforms.engine.operands import Operands
from jacobeam.transforms.engine.reductions import FULL, reduce_full
from jacobeam.transforms.output.layout import JACOBIAN, jacobian_dataset
from jacobeam.transforms.spec import EngineOptions, store_dtype


class DatasetAssembly:
    """``assemble`` for an engine that has these attributes."""

    options: EngineOptions
    operands: Operands
    output_shape: tuple[int, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    input_names: tuple[str, ...]
    wrt: list[int]  # positions of the differentiated inputs

    def assemble(
        self, output: np.ndarray, products: Mapping[int, np.ndarray], index: np.ndarray | None
    ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """Datasets from the outputs ``(n, m)`` and ``L J R`` ``(n, r, c)``
        per differentiated input: reductions, shapes, store dtype."""
        n = len(output)
        store = store_dtype(self.options.store_dtype)
        datasets = {"output": output.reshape((n, *self.output_shape))}
        if index is not None:
            datasets["output_index"] = np.asarray(index).astype(np.int64)
        rows_shape = self.output_shape if index is None else (index.shape[1],)
        kind = self.options.reduce.kind
        full = None
        if kind in FULL:
            if self.options.aggregate:  # of the one input: refused for several (EngineOptions.one_input_only)
                full = products[self.wrt[0]].astype(store, copy=False)
            for k, product in products.items():
                reduced = reduce_full(kind, product, rows_shape, self.input_shapes[k])
                if JACOBIAN in reduced:
                    reduced = {jacobian_dataset(self.input_names[k], len(self.input_names) > 1): reduced.pop(JACOBIAN)}
                datasets.update(reduced)
        else:
            datasets.update(self._products(kind, products[0], rows_shape))
        stored = {
            name: value.astype(store, copy=False) if value.dtype.kind == "f" else value
            for name, value in datasets.items()
        }
        return stored, full

    def _products(self, kind: str, raw: np.ndarray, rows_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        n, input_shape = len(raw), self.input_shapes[0]
        if kind == "vjp":  # (n, r, d): u^T J for each vector u
            return {"vjp": raw.reshape((n, len(raw[0]), *input_shape))}
        if kind == "jvp":  # (n, m, r) -> (n, r, *output_shape): J v for each vector v
            return {"jvp": np.moveaxis(raw, 2, 1).reshape((n, raw.shape[2], *self.output_shape))}
        if kind == "project":  # (n, rows, dim): J P
            return {"projection": raw.reshape((n, *rows_shape, raw.shape[2]))}
        if self.operands.after is not None:  # basis, both sides: U^T (J V)
            return {"basis_projection": np.einsum("pm,nmq->npq", self.operands.after, raw)}
        return {"basis_projection": raw}  # U^T J (reverse), or J V (forward) with the other side identity
