"""Feeding the engine: row slices regrouped into full batches, read ahead on a background thread.

Plain Python and numpy: a slice of a local ``.npy`` file is read in well under a millisecond, so
reading needs no framework, only to overlap with computing where storage is slow (a remote file, a
compressed ``.npz`` member). ``tf.data`` did the same job here before at a cost of tens of milliseconds
per shard (building and starting a dataset) and milliseconds per batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

import numpy as np

T = TypeVar("T")

_END = object()  # the producer's last item


def rebatch(slices: Iterable[tuple[np.ndarray, ...]], size: int) -> Iterator[tuple[np.ndarray, ...]]:
    """Regroup ``slices`` into batches of exactly ``size`` rows; only the last batch can be shorter.

    Each slice is a tuple of arrays of one length along their first axis (ids ``(r,)``, samples
    ``(r, *sample_shape)``, ...); each batch is a tuple of the same arrays with ``size`` rows, in order.
    A slice of exactly ``size`` rows that starts a batch is passed on as it is (no copy).
    """
    pending: list[tuple[np.ndarray, ...]] = []
    held = 0
    for piece in slices:
        while len(piece[0]):
            take = min(size - held, len(piece[0]))
            pending.append(tuple(part[:take] for part in piece))
            held += take
            piece = tuple(part[take:] for part in piece)
            if held == size:
                yield _joined(pending)
                pending, held = [], 0
    if held:
        yield _joined(pending)


def _joined(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(columns) for columns in zip(*parts))


class _Failed:
    """What the producer hands over instead of an item when producing raised."""

    def __init__(self, error: BaseException):
        self.error = error


def prefetch(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Iterate over ``items``, produced on a background thread at most ``depth`` items ahead.

    An exception raised while producing is raised here, as itself, where the failed item would have
    come. Stopping early (closing this generator, or an exception in the consumer) stops the producer
    after the item it is working on and closes ``items``; the thread is joined before this returns.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                ready.put(item)
                if stop.is_set():
                    return
            ready.put(_END)
        except BaseException as err:  # re-raised in the consumer's thread
            ready.put(_Failed(err))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:  # a generator: run its clean-up (open files) in this thread
                close()

    thread = threading.Thread(target=produce, name="prefetch", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # make room for a producer blocked on a full queue
            try:
                ready.get(timeout=0.01)
            except queue.Empty:
                pass
        thread.join()
