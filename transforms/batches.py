"""Feeding the engine: row slices regrouped into full batches, read ahead on a background thread.

Plain Python and numpy: a slice of a local ``.npy`` file is read in well under a millisecond, so
reading needs no framework, only to overlap with computing where storage is slow (a remote file, a
compressed ``.npz`` member). ``tf.data`` did the same job here before at a cost of tens of milliseconds
per shard (building and starting a dataset) and milliseconds per batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

import numpy as np

T = TypeVar("T")

_END = object()  # the producer's last item


Part = np.ndarray | Mapping[str, np.ndarray]  # rows of one array, or of one array per model input


def rebatch(slices: Iterable[tuple[Part, ...]], size: int) -> Iterator[tuple[Part, ...]]:
    """Regroup ``slices`` into batches of exactly ``size`` rows; only the last batch can be shorter.

    Each slice is a tuple of parts of one length along their first axis (ids ``(r,)``, samples
    ``(r, *sample_shape)`` or a dict of them by input name, ...); each batch is a tuple of the same
    parts with ``size`` rows, in order. A slice of exactly ``size`` rows that starts a batch is passed
    on as it is (no copy).
    """
    pending: list[tuple[Part, ...]] = []
    held = 0
    for piece in slices:
        while (length := _length(piece[0])):
            take = min(size - held, length)
            pending.append(tuple(_rows(part, 0, take) for part in piece))
            held += take
            piece = tuple(_rows(part, take, length) for part in piece)
            if held == size:
                yield _joined(pending)
                pending, held = [], 0
    if held:
        yield _joined(pending)


def _length(part: Part) -> int:
    return len(next(iter(part.values()))) if isinstance(part, Mapping) else len(part)


def _rows(part: Part, lo: int, hi: int) -> Part:
    if isinstance(part, Mapping):
        return {name: values[lo:hi] for name, values in part.items()}
    return part[lo:hi]


def _joined(pieces: list[tuple[Part, ...]]) -> tuple[Part, ...]:
    if len(pieces) == 1:
        return pieces[0]
    return tuple(_concatenated(column) for column in zip(*pieces))


def _concatenated(parts: tuple[Part, ...]) -> Part:
    if isinstance(parts[0], Mapping):
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    return np.concatenate(parts)


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
