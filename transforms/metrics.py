"""Every Beam metric jacobeam reports, in one namespace and one place (as Beam's RunInference keeps its
own in one collector). Progress and the run summary read them by these names."""

from __future__ import annotations

import threading
from typing import Any

from apache_beam.metrics import Metrics

NAMESPACE = "jacobeam"


class ComputeMetrics:
    """What the compute step reports: samples and batches done, batch latency, and the engine's state."""

    def __init__(self):
        self._samples = Metrics.counter(NAMESPACE, "samples")
        self._batches = Metrics.counter(NAMESPACE, "batches")
        self._latency = Metrics.distribution(NAMESPACE, "batch_latency_ms")
        self._retraces = Metrics.gauge(NAMESPACE, "retraces_after_setup")
        self._fallbacks = Metrics.gauge(NAMESPACE, "pfor_fallbacks")
        self._oom_retries = Metrics.gauge(NAMESPACE, "oom_retries")
        self._peak_rss = Metrics.gauge(NAMESPACE, "peak_rss_mb")

    def batch_done(self, samples: int, seconds: float, engine: dict[str, Any]) -> None:
        """One engine call of ``samples`` samples, and ``engine`` (``JacobianEngine.describe()``) after it."""
        self._latency.update(int(1000 * seconds))
        self._batches.inc()
        self._samples.inc(samples)
        self._retraces.set(engine["retraces_after_setup"])
        self._fallbacks.set(len(engine["pfor_fallbacks"]))
        self._oom_retries.set(engine["oom_retries"])
        self._peak_rss.set(engine["peak_rss_bytes"] // 2**20)


class ShardMetrics:
    """What the write step reports: shards written, and complete shards kept from an earlier run."""

    def __init__(self):
        self.written = Metrics.counter(NAMESPACE, "shards_written")
        self.kept = Metrics.counter(NAMESPACE, "shards_skipped")


# Rows handed to the writers of shards not yet complete, by shard name, in this process: what a progress
# display in the same process (the in-process runners) counts between two complete shards, which would
# otherwise stand still for a whole shard (4,096 samples by default: minutes on a large model).
_rows_in_progress: dict[str, int] = {}
_rows_lock = threading.Lock()


def shard_rows(name: str, rows: int | None) -> None:
    """``rows`` of shard ``name`` written so far; None once it is complete or abandoned."""
    with _rows_lock:
        if rows is None:
            _rows_in_progress.pop(name, None)
        else:
            _rows_in_progress[name] = rows


def rows_in_progress() -> dict[str, int]:
    with _rows_lock:
        return dict(_rows_in_progress)
