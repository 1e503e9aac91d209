"""What the engine measures and compares: agreement between paths, pfor's fallbacks, the size of a
model's forward pass, and whose error an exception is."""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np

AGREEMENT = {"float32": 1e-4, "float64": 1e-9}  # max |a - b| / max |b| for two paths to agree
# Compared per sample, a sample's scale is at least this fraction of the batch's largest entry, so an error under
# AGREEMENT x SAMPLE_FLOOR of that entry never counts (float32: 1e-6, ~8 ulps, the round-off of 1 - tanh^2 of a
# saturated unit).
SAMPLE_FLOOR = 1e-2

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # transforms/: jacobeam's own engine code


def relative_error(actual: np.ndarray, expected: np.ndarray, floor: float = 0.0, scale: float | None = None) -> float:
    """Largest difference over the largest reference entry (at least ``floor``; or a fixed ``scale``),
    both over the finite entries; inf where the two disagree on which entries are finite (a NaN
    anywhere would otherwise pass every comparison)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(actual)):
        return float("inf")
    if not finite.any():
        return 0.0
    if scale is None:
        scale = max(float(np.max(np.abs(expected[finite]))), floor, np.finfo(np.float32).tiny)
    return float(np.max(np.abs(actual[finite] - expected[finite]))) / scale


def per_sample_relative_error(actual: np.ndarray, expected: np.ndarray, floor: float = SAMPLE_FLOOR) -> float:
    """The largest over samples (axis 0) of each sample's ``relative_error``: judged per sample, a
    sample whose entries are small against the batch's cannot hide a wrong derivative behind the
    batch's largest entry. Each sample's scale is at least ``floor`` of the batch's largest finite
    reference entry; inf where the shapes differ or a sample's entries disagree on being finite."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    finite = np.isfinite(expected)
    batch = float(np.max(np.abs(expected[finite]))) if finite.any() else 0.0
    return max((relative_error(a, b, floor=floor * batch) for a, b in zip(actual, expected)), default=0.0)


def raised_by_jacobeam(err: BaseException) -> bool:
    """Whether ``err`` was raised by jacobeam's own code rather than by TensorFlow, Keras or the model.

    Falling back to another path is right when TensorFlow cannot run one (no XLA kernel, no pfor
    rule); an exception thrown by jacobeam's own code is a bug, and a fallback would hide it behind a
    warning and a slower path. Decided by the innermost frame, so TensorFlow's and Keras's traceback filtering (which drops
    their own frames) must be off while the error is raised: see ``full_tracebacks``.
    """
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE_ROOT)


@contextlib.contextmanager
def full_tracebacks() -> Iterator[None]:
    """TensorFlow's and Keras's traceback filtering off for the ``with`` body, so that an error raised
    inside them keeps their frames (``raised_by_jacobeam``)."""
    import keras
    import tensorflow as tf

    tf_filtering, keras_filtering = tf.debugging.is_traceback_filtering_enabled(), keras.config.is_traceback_filtering_enabled()
    tf.debugging.disable_traceback_filtering()
    keras.config.disable_traceback_filtering()
    try:
        yield
    finally:
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()
        if keras_filtering:
            keras.config.enable_traceback_filtering()


class _FallbackLog(logging.Handler):
    """Collects pfor's "Using a while_loop for converting <op>" messages while a function traces."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.ops: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Using a while_loop for converting"):
            self.ops.append(message.split()[5])


@contextlib.contextmanager
def capture_pfor_fallbacks() -> Iterator[_FallbackLog]:
    """The ops pfor could not vectorise while the ``with`` body traced (each then runs in a loop)."""
    logger = logging.getLogger("tensorflow")
    handler, level = _FallbackLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def activation_size(graph) -> int:
    """Elements per sample of every intermediate tensor of the forward pass (``graph``: the traced
    forward pass, batch dimension unknown): what backpropagation keeps per output row. Found from the
    graph, so it needs no knowledge of the layers."""
    total = 0
    for op in graph.get_operations():
        for out in op.outputs:
            dims = out.shape.as_list() if out.shape.rank else None
            if dims and dims[0] is None and out.dtype.is_floating and None not in dims[1:]:
                total += int(np.prod(dims[1:], dtype=np.int64))
    return total
