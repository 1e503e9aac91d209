"""Timing one in-memory row: first call, then the median of timed repeats, within a time budget."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.rows import Built


@dataclass(frozen=True)
class Budget:
    repeats: int = 3  # timed repeats after warm-up; the median counts
    seconds: float = 1.0  # aim for one timed repeat to take about this long (at least one call)
    batch: int = 256  # the batch of the batched rows
    max_call_seconds: float = 10.0  # a row whose `batch` would take longer runs on a smaller one
    probe: int = 16  # the smallest batch (and the eager loop's); also how many samples are verified


@dataclass(frozen=True)
class Timing:
    samples_per_second: float  # median over the repeats
    repeat_seconds: list[float]
    batch: int  # samples per call
    timed_samples: int  # samples per timed repeat
    first_call_seconds: float  # from building the function to the first batch's Jacobians

    def to_dict(self) -> dict:
        return asdict(self)


def seconds(call: Callable[[], object]) -> float:
    """Wall seconds of one ``call()``."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def interleaved(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Each call's results over ``repeats`` rounds, every round running every call once, in order: load
    from other work on a shared machine falls on every call alike."""
    found: dict[str, list[Any]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            found[name].append(call())
    return found


def time_row(build: Callable[[], Built], x: np.ndarray, budget: Budget) -> tuple[Timing, np.ndarray]:
    """Time a row on ``x[n, *input_shape]``; returns the timing and the Jacobians of ``x[:budget.probe]``.

    A row is first called on ``probe`` samples (or on its own fixed batch), then moves to ``batch``
    samples, or to ``batch / 4``, ``batch / 16``, ... where one call would take longer than
    ``max_call_seconds``: a very slow row (forward mode through a CNN) is timed on a smaller batch
    instead of stalling the run. Each repeat calls the function on the same consecutive batches of
    ``x``, as many as fit ``budget.seconds``.
    """
    start = time.perf_counter()
    built = build()
    batch = min(built.batch or budget.probe, len(x))
    built.jacobians(x[:batch])
    first_call = time.perf_counter() - start

    def warm_call() -> tuple[float, np.ndarray]:
        began = time.perf_counter()
        found = np.asarray(built.jacobians(x[:batch]))
        return time.perf_counter() - began, found

    warm, checked = warm_call()
    full = min(budget.batch, len(x))
    while built.batch is None and not built.per_sample and batch < full:
        # Jump to the largest batch that the time per sample measured so far allows. That time
        # over-estimates a larger batch's (per-call overhead), so jump again once measured there;
        # a fast row gets to `batch` in one jump, i.e. one more compile.
        target = full
        while target > batch and warm / batch * target > budget.max_call_seconds:
            target //= 4
        if target <= batch:
            break
        batch = target
        built.jacobians(x[:batch])  # compiles for this shape where the framework specialises on it
        warm, checked = warm_call()
    calls = int(min(max(1, round(budget.seconds / max(warm, 1e-9))), max(1, len(x) // batch)))

    repeats = []
    for _ in range(budget.repeats):
        repeats.append(seconds(lambda: [built.jacobians(x[i * batch : (i + 1) * batch]) for i in range(calls)]))
    timing = Timing(
        samples_per_second=calls * batch / statistics.median(repeats),
        repeat_seconds=repeats,
        batch=1 if built.per_sample else batch,
        timed_samples=calls * batch,
        first_call_seconds=first_call,
    )
    return timing, checked[: budget.probe]
