"""Sizing blocks against the memory budget: pure arithmetic, no TensorFlow.

A call of the engine is cut into sub-batches of ``batch`` samples, and each differentiated input's
rows (reverse mode) or columns (forward mode) into blocks of ``rows``. The estimated working set of
one block, in bytes, is the sub-batch's finished results (``result`` per sample) plus, for a block of
``c`` rows, ``c`` copies of the per-sample intermediates of the forward pass (``activations``) and of
the differentiated input (reverse: cotangents) or of input and output (forward: tangents).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Samples per sub-batch and rows per block of each differentiated input, fixed for a call."""

    batch: int
    rows: tuple[tuple[int, int], ...]  # (input index, rows per block)
    notes: tuple[str, ...] = ()

    def rows_of(self, k: int) -> int:
        return dict(self.rows)[k]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What sizing needs to know of a model and an engine configuration, per differentiated input."""

    batch_size: int  # the configured batch size: the most samples a sub-batch holds
    budget: int  # bytes
    itemsize: int  # bytes per element of the compute dtype
    outputs: int  # m
    activations: int  # elements of the forward pass's intermediates per sample
    sizes: Mapping[int, int]  # d per differentiated input
    extents: Mapping[int, int]  # rows (reverse) or columns (forward) to cover per differentiated input
    forward: bool
    names: Sequence[str] = ()  # input names, for the notes


def size_blocks(work: Workload) -> Sizes:
    """The largest sub-batch (up to ``batch_size``) whose finished results fit in half the budget, then
    the largest blocks whose working set fits in the rest."""
    item, m = work.itemsize, work.outputs
    # A block's finished result per sample: all outputs by the columns (forward), or the rows by all
    # input entries (reverse).
    result = sum(work.extents[k] * (m if work.forward else work.sizes[k]) for k in work.sizes) * item
    batch = int(min(work.batch_size, max(1, (work.budget // 2) // max(result, 1))))
    notes = []
    if batch < work.batch_size:
        notes.append(f"batch {work.batch_size} -> {batch}: one sample's Jacobian is {result:,} bytes")
    # A block of one row must fit too: an ImageNet-size forward pass (ResNet50: ~100 MB a sample) at 256
    # samples would hold 25 GB, where the budget allows a sub-batch of a few dozen.
    one_row = max((work.activations + work.sizes[k] + (m if work.forward else 0)) * item for k in work.sizes)
    fits = int(max(1, work.budget // max(result + one_row, 1)))
    if fits < batch:
        notes.append(f"batch {batch} -> {fits}: one sample's forward pass and result are {result + one_row:,} bytes")
        batch = fits
    rows = []
    for k in work.sizes:
        per_row = (work.activations + work.sizes[k] + (m if work.forward else 0)) * item * batch
        extent = work.extents[k]
        block = int(min(extent, max(1, (work.budget - batch * result) // max(per_row, 1))))
        rows.append((k, block))
        if block < extent:
            name = work.names[k] if k < len(work.names) else str(k)
            notes.append(f"{name}: blocks of {block} of {extent} {'inputs' if work.forward else 'outputs'}")
    return Sizes(batch, tuple(rows), tuple(notes))


def smaller(sizes: Sizes) -> Sizes | None:
    """The next sizes to try after running out of memory: blocks of half the rows while any block has
    more than one, then half the samples; None at one sample and one row."""
    if any(rows > 1 for _, rows in sizes.rows):
        return dataclasses.replace(sizes, rows=tuple((k, max(1, rows // 2)) for k, rows in sizes.rows))
    if sizes.batch > 1:
        return dataclasses.replace(sizes, batch=max(1, sizes.batch // 2))
    return None
