"""Progress of a local run, read from the output folder: a shard counts once its rename made it complete.

Watching the folder works the same for every local running mode (in-process or worker processes),
where Beam's own metrics only arrive when the run has finished.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from typing import TextIO

from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import SHARDS_DIR, shard_name
from jacobeam.transforms.spec import JobSpec


class ShardProgress:
    """Context manager showing ``done/total samples, samples/s, ETA`` while the run is going: a live
    bar (tqdm) when the stream is a terminal, a log line per change otherwise."""

    def __init__(self, spec: JobSpec, already_done: int, stream: TextIO = sys.stderr, every: float = 2.0):
        self._sizes = {shard_name(r.start, r.stop): r.rows for r in spec.ranges() if r.rows}
        self._shards = storage.join(spec.output_dir, SHARDS_DIR)
        self._total = sum(self._sizes.values())
        self._baseline = already_done
        self._stream = stream
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jacobeam-progress", daemon=True)
        self._bar = None

    def done(self) -> int:
        return sum(self._sizes.get(name, 0) for name in storage.listdir(self._shards))

    def line(self, done: int, elapsed: float) -> str:
        rate = (done - self._baseline) / elapsed if elapsed > 0 else 0.0
        eta = datetime.timedelta(seconds=round((self._total - done) / rate)) if rate > 0 else "?"
        percent = 100.0 * done / self._total
        return f"jacobeam: {done:,}/{self._total:,} samples ({percent:.0f}%), {rate:,.0f} samples/s, ETA {eta}"

    def _watch(self) -> None:
        if self._bar is not None:
            while not self._stop.wait(0.5):
                self._bar.update(self.done() - self._bar.n)
            return
        began, shown = time.monotonic(), self._baseline
        while not self._stop.wait(self._every):
            done = self.done()
            if done != shown:
                print(self.line(done, time.monotonic() - began), file=self._stream, flush=True)
                shown = done


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
