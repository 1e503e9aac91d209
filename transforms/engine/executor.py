"""Executing one call of the engine with the sizes of a plan, fixed for the whole call.

Samples ``[start, n)`` are cut into sub-batches of ``plan.sizes.batch``; each differentiated input's
rows (reverse) or columns (forward) into blocks of ``rows``. A sub-batch is handed on only when every
block of it has run: its results are built from those blocks alone (concatenated, never filled into
an uninitialised array), so an error part-way (out of memory) can never leave a row unwritten. The
caller decides what to do about the error; nothing here changes a size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf

from jacobeam.transforms.engine.blocks import BlockCache, Path
from jacobeam.transforms.engine.budget import Sizes
from jacobeam.transforms.engine.operands import Operands
from jacobeam.transforms.errors import span


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the engine computes: a path, its sizes and the reasons for both. Never changed in place."""

    path: Path
    sizes: Sizes
    reasons: tuple[str, ...] = ()


# One sub-batch's results: {"output": (b, m), k: (b, r, c)} per differentiated input k.
Piece = dict


def execute(
    plan: Plan,
    blocks: BlockCache,
    operands: Operands,
    xs: Sequence[np.ndarray],
    index: np.ndarray | None,
    start: int = 0,
) -> Iterator[tuple[int, int, Piece]]:
    """``(lo, hi, piece)`` for each completed sub-batch of samples ``[start, n)``, in order.

    ``piece[k]`` is ``L J R`` of samples ``lo..hi`` for input ``k`` in compute dtype, ``(b, r, c)``:
    ``r`` the selected rows (``index``, or ``operands.left``) or all outputs, ``c`` the columns of
    ``operands.right`` or all input entries. Arrays may be read-only views of TensorFlow's buffers.
    """
    n, step = len(xs[0]), plan.sizes.batch
    mode, forward = plan.path.mode, plan.path.mode == "forward"
    kind = operands.kind(mode)
    dtype = xs[0].dtype
    fixed = tf.constant(operands.right if forward else operands.left) if kind == "matrix" else tf.zeros((0, 0), dtype)
    for lo in range(start, n, step):
        hi = min(lo + step, n)
        pad = step - (hi - lo) if plan.path.jit else 0  # XLA compiles per shape: pad, never recompile
        batch = [tf.constant(_padded(x[lo:hi], pad)) for x in xs]
        given = tf.constant(_padded(index[lo:hi], pad)) if kind == "index" else fixed
        piece: Piece = {}
        for k, rows in plan.sizes.rows:
            extent = operands.extent(mode, k)
            block_fn = blocks.get(plan.path, k, rows, extent, kind)
            parts, done = [], 0
            while done < extent:
                first = min(done, extent - rows)  # every block full-size (no retrace): the last overlaps
                y, block = block_fn(batch, first, given)
                block = np.asarray(block)[: hi - lo]  # read-only, no copy (.numpy() copies)
                skip = done - first  # rows the previous block already gave
                parts.append(block if not skip else (block[:, :, skip:] if forward else block[:, skip:]))
                done = first + rows
            piece[k] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2 if forward else 1)
            if forward and index is not None:  # forward blocks hold every output: keep the selected rows
                piece[k] = np.take_along_axis(piece[k], index[lo:hi, :, None], axis=1)
            elif not forward and operands.right is not None:
                # Input-side products in reverse mode (where forward mode has no rule for an op): the
                # blocks give L J; the product with R follows here.
                piece[k] = np.matmul(piece[k], operands.right.T)
        piece["output"] = np.asarray(y)[: hi - lo]
        yield lo, hi, piece


def _padded(x: np.ndarray, pad: int) -> np.ndarray:
    return np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x


def join(pieces: list[tuple[int, int, Piece]], n: int) -> Piece:
    """The results of samples ``0..n`` from consecutive pieces; refuses any gap (a sample never
    computed must never be returned)."""
    expected = 0
    for lo, hi, _ in pieces:
        if lo != expected:
            raise RuntimeError(f"engine bug: {span(expected, lo, 'sample')} never computed")
        expected = hi
    if expected != n:
        raise RuntimeError(f"engine bug: {span(expected, n, 'sample')} never computed")
    if len(pieces) == 1:
        return pieces[0][2]
    return {key: np.concatenate([piece[key] for _, _, piece in pieces]) for key in pieces[0][2]}
