"""Streaming aggregates over every sample's Jacobian: mean, mean absolute value and ``sum J^T J``.

Each shard contributes one partial sum (float64, summed in sample order), stored in the shard's file.
``Finalize`` combines them (``combine_shards``) with ``AggregateFn`` along a fixed binary tree over the
shards, so the result is the same bit for bit however the work was split across workers and bundles,
and whether a shard was computed in this run or kept from an earlier one. Read from the shards, the
partials never travel through the pipeline: no collection of them, no side input.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np

from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output import fence, storage
from jacobeam.transforms.output.layout import AGGREGATES
from jacobeam.transforms.output.shards import ShardRecord, read_attrs, shard_path
from jacobeam.transforms.spec import JobSpec

PARTIALS = "partial_aggregates"  # the group in each shard that keeps its partial sums
Partial = dict[str, np.ndarray]


def partial(jacobians: np.ndarray, kinds: Sequence[str]) -> Partial:
    """Sums over a batch of Jacobians ``(n, rows, d)``: ``sum`` and ``sum_abs`` ``(rows, d)``,
    ``jtj`` ``(d, d)``, and ``count``."""
    wide = jacobians.astype(np.float64)
    sums: Partial = {"count": np.array(len(wide), np.int64)}
    if "mean" in kinds:
        sums["sum"] = wide.sum(axis=0)
    if "mean_abs" in kinds:
        sums["sum_abs"] = np.abs(wide).sum(axis=0)
    if "jtj" in kinds:
        sums["jtj"] = np.einsum("nrd,nre->de", wide, wide)
    return sums


def read_partial(path: str | os.PathLike) -> Partial:
    with storage.open_h5(path) as h5:
        if PARTIALS not in h5:
            raise OutputError(f"{path}: holds no partial aggregates (written by a run without aggregate)")
        return {name: dataset[()] for name, dataset in h5[PARTIALS].items()}


def add(left: Partial | None, right: Partial | None) -> Partial | None:
    if left is None or right is None:
        return left if right is None else right
    return {name: left[name] + right[name] for name in left}


class AggregateFn(beam.CombineFn):
    """``(shard position, Partial) -> Partial`` summed along a fixed tree over ``num_shards`` leaves.

    The accumulator maps ``(level, index)`` to the sum of leaves ``[index * 2**level, (index + 1) *
    2**level)``; two sibling nodes are replaced by their parent as soon as both are present, so it
    holds O(log n) nodes when shards arrive in order.
    """

    def __init__(self, num_shards: int):
        self._leaves = num_shards

    def create_accumulator(self) -> dict[tuple[int, int], Partial]:
        return {}

    def _insert(self, nodes: dict, level: int, index: int, value: Partial) -> None:
        if (level, index) in nodes:
            raise OutputError(f"aggregates: shard partial {index} at level {level} arrived twice")
        sibling = (level, index ^ 1)
        if sibling in nodes:
            other = nodes.pop(sibling)
            left, right = (value, other) if index % 2 == 0 else (other, value)
            self._insert(nodes, level + 1, index // 2, add(left, right))
        else:
            nodes[(level, index)] = value

    def add_input(self, nodes, element):
        position, value = element
        self._insert(nodes, 0, position, value)
        return nodes

    def merge_accumulators(self, accumulators: Iterable[dict]):
        merged: dict = {}
        for nodes in accumulators:
            for (level, index), value in nodes.items():
                self._insert(merged, level, index, value)
        return merged

    def extract_output(self, nodes) -> Partial | None:
        """The total, or None when no shard sent partial sums (a job without aggregates)."""
        if not nodes:
            return None

        def value(level: int, index: int) -> Partial | None:
            if index * 2**level >= self._leaves:
                return None
            if (level, index) in nodes:
                return nodes[(level, index)]
            if level == 0:
                raise OutputError(f"aggregates: no partial sums for shard {index}")
            return add(value(level - 1, 2 * index), value(level - 1, 2 * index + 1))

        return value(max(0, (self._leaves - 1).bit_length()), 0)


def combine_shards(spec: JobSpec, records: Sequence[ShardRecord]) -> Partial | None:
    """The partial sums of every shard that holds rows (``records`` in id order), read from its file and
    combined along ``AggregateFn``'s tree (O(log n) of them in memory); None for a job without
    aggregates. A shard whose samples were all rejected adds nothing."""
    if not spec.engine.aggregate:
        return None
    stored = [record for record in records if record.num_samples]
    fn = AggregateFn(len(stored))
    nodes = fn.create_accumulator()
    for position, record in enumerate(stored):
        fn.add_input(nodes, (position, read_partial(shard_path(spec.output_dir, record.start, record.stop))))
    return fn.extract_output(nodes)


def write_aggregates(sums: Partial | None, spec: JobSpec, records: Sequence[ShardRecord] = ()) -> dict[str, Any]:
    """Write ``aggregates.h5`` (``mean``, ``mean_abs`` ``(*rows, *input_shape)`` where rows are the
    output shape or the ``k`` selected rows, ``jtj`` ``(d, d)``, ``count``) atomically; returns what
    the manifest records about it."""
    import h5py

    if sums is None:
        return {}
    first = next(record for record in records if record.num_samples)
    output_shape = tuple(int(d) for d in read_attrs(shard_path(spec.output_dir, first.start, first.stop))["output_shape"])
    rows_shape = output_shape if spec.engine.outputs.count is None else (spec.engine.outputs.count,)
    output_dir, input_shape = spec.output_dir, spec.sample_shape
    count = int(sums["count"])
    shape = (*rows_shape, *input_shape)

    def write(temp: Path) -> None:
        with h5py.File(temp, "w") as h5:
            h5["count"] = count
            if "sum" in sums:
                h5["mean"] = (sums["sum"] / count).reshape(shape)
            if "sum_abs" in sums:
                h5["mean_abs"] = (sums["sum_abs"] / count).reshape(shape)
            if "jtj" in sums:
                h5["jtj"] = sums["jtj"]

    storage.write_atomically(storage.join(output_dir, AGGREGATES), write, fence=fence.of(spec))
    return {"file": AGGREGATES, "count": count, "datasets": sorted(k for k in ("mean", "mean_abs", "jtj") if k in _names(sums))}


def _names(sums: Partial) -> set[str]:
    return {{"sum": "mean", "sum_abs": "mean_abs", "jtj": "jtj"}.get(name, name) for name in sums}
