"""Progress of a local run, read from the output folder: a shard counts once its rename made it complete.

Watching the folder works the same for every local running mode (in-process or worker processes),
where Beam's own metrics only arrive when the run has finished. In-process runners also count, batch
by batch, the rows written into shards under way (``metrics.rows_in_progress``); worker processes'
progress shows shard by shard.

Before the first shard, the engine sets up (loads the model, traces, checks and times the ways to
differentiate): on a large model that takes many seconds. When the engine is built in this process
(the in-process runners) and its set-up has taken ``SETUP_NOTICE`` seconds, a line says so, and another
how long it took once it is ready; worker processes (``multi_processing``, remote runners) set up unseen.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from typing import TextIO

from jacobeam.transforms.compute import engine_setup
from jacobeam.transforms.metrics import rows_in_progress
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import SHARDS_DIR, shard_name
from jacobeam.transforms.spec import JobSpec

SETUP_NOTICE = 2.0  # seconds of engine set-up after which the display says what is going on
SETUP_LINE = "jacobeam: setting up the engine (loading model, choosing how to differentiate)..."
_POLL = 0.25  # seconds between looks at the engine's set-up


class ShardProgress:
    """Context manager showing ``done/total samples, samples/s, ETA`` while the run is going: a live
    bar (tqdm) when the stream is a terminal, a log line per change otherwise."""

    def __init__(self, spec: JobSpec, already_done: int, stream: TextIO | None = None, every: float = 2.0,
                 setup_notice: float = SETUP_NOTICE):
        self._sizes = {shard_name(r.start, r.stop): r.rows for r in spec.ranges() if r.rows}
        self._shards = storage.join(spec.output_dir, SHARDS_DIR)
        self._total = sum(self._sizes.values())
        self._baseline = already_done
        self._stream = stream if stream is not None else sys.stderr
        self._every = every
        self._setup_notice = setup_notice
        self._announced: tuple[float, int] | None = None  # the set-up shown: when it began, engines built before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jacobeam-progress", daemon=True)
        self._bar = None

    def done(self) -> int:
        """Samples in complete shards, and those already written into shards under way in this process."""
        complete = set(storage.listdir(self._shards))
        written = sum(rows for name, rows in rows_in_progress().items() if name in self._sizes and name not in complete)
        return sum(self._sizes.get(name, 0) for name in complete) + written

    def line(self, done: int, elapsed: float) -> str:
        rate = (done - self._baseline) / elapsed if elapsed > 0 else 0.0
        eta = datetime.timedelta(seconds=round((self._total - done) / rate)) if rate > 0 else "?"
        percent = 100.0 * done / self._total
        return f"jacobeam: {done:,}/{self._total:,} samples ({percent:.0f}%), {rate:,.0f} samples/s, ETA {eta}"

    def _say(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self._stream)  # above the bar
        else:
            print(line, file=self._stream, flush=True)

    def _watch_setup(self) -> None:
        """Say that the engine is setting up once it has taken ``setup_notice`` seconds, and when it is ready."""
        began, built = engine_setup()
        if self._announced is None:
            if began is not None and time.monotonic() - began >= self._setup_notice:
                self._announced = (began, built)
                self._say(SETUP_LINE)
            return
        announced_began, built_before = self._announced
        if began != announced_began:  # that build ended: ready, or failed (the run's error says why)
            if built > built_before:
                self._say(f"jacobeam: engine ready after {time.monotonic() - announced_began:.1f} s")
            self._announced = None

    def _watch(self) -> None:
        began, shown = time.monotonic(), self._baseline
        looked = began
        while not self._stop.wait(_POLL):
            self._watch_setup()
            now = time.monotonic()
            if now - looked < (0.5 if self._bar is not None else self._every):
                continue
            looked = now
            done = self.done()
            if self._bar is not None:
                self._bar.update(done - self._bar.n)
            elif done != shown:
                print(self.line(done, now - began), file=self._stream, flush=True)
                shown = done
        self._watch_setup()

    def __enter__(self) -> ShardProgress:
        if self._stream.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=self._total, initial=self._baseline, unit="sample", file=self._stream,
                             desc="jacobeam", dynamic_ncols=True)
            self._logs = logging_redirect_tqdm()  # log lines print above the bar, not through it
            self._logs.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            self._bar.update(self.done() - self._bar.n)
            self._bar.close()
            self._logs.__exit__(*exc_info)
