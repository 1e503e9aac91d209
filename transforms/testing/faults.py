"""Test-only fault injection, switched on by environment variables (never set in normal use).

jacobeam promises that a run killed at any moment, or a bundle that fails and is retried, leaves
nothing that a rerun could mistake for valid output. The fault-injection tests prove it by making the
process die, or a shard fail, at named points:

``JACOBEAM_TEST_KILL_AT=POINT[:N]``
    SIGKILL this process the N-th time (default 1st) it reaches ``POINT``. Points: ``plan`` (checks
    passed, before the pipeline), ``setup`` (a worker loading the model), ``shard_write`` (part of a
    shard written to its temporary file), ``shard_commit`` (shard complete in its temporary file, not
    yet renamed), ``shard_renamed`` (remote folder only: renamed, its checksum sidecar not yet written),
    ``shard_done`` (renamed, not yet reported), ``view_write`` (inside ``jacobians.h5``'s
    temporary file), ``view``, ``rejected``, ``manifest`` (that file's temporary file written, not yet
    renamed into place), ``overwrite_move`` (an ``--overwrite``'s result committed in its staging folder:
    one more of its files moved in, ``pipeline.overwrite``), ``overwrite_moved`` (its manifest written at
    the top, the staged one not yet removed).
``JACOBEAM_TEST_DELAY_AT=POINT:SECONDS``
    Sleep SECONDS each time this process reaches ``POINT``: slows a run down (at ``shard_commit``, say,
    with a shard complete in its temporary file) so that a test can kill a worker or the launcher while
    shards are under way.
``JACOBEAM_TEST_HOLD_AT=POINT:PATH``
    Wait at ``POINT`` until the file ``PATH`` exists (at most ``HOLD_LIMIT`` seconds): holds a run where
    a test wants it (the lease taken, say) for exactly as long as the test needs, no sleep to guess. The
    process creates ``PATH.held`` when it begins to wait, so that the test knows it is there.
``JACOBEAM_TEST_FAIL_SHARD_ONCE=ID``
    Raise ``TransientFailure`` after part of the shard whose first id is ``ID`` has been written, once:
    the first process to fail creates the marker file ``JACOBEAM_TEST_FAIL_MARKER`` (default: a name in
    the temp folder), and later attempts (Beam's retries, or a rerun) find it and go on.

``JACOBEAM_TEST_LEASE_SECONDS=HEARTBEAT:STALE``
    The lease's heartbeat interval and stale time (``transforms.output.lease``), short for a test.
``JACOBEAM_TEST_CLOCK_OFFSET=SECONDS``
    Add SECONDS to this process's wall clock as the lease writes and reads it: a machine whose clock is off.

Reading the environment costs nothing measurable next to writing a shard.
"""

from __future__ import annotations

import collections
import os
import signal
import tempfile
import time

KILL_AT = "JACOBEAM_TEST_KILL_AT"
DELAY_AT = "JACOBEAM_TEST_DELAY_AT"
HOLD_AT = "JACOBEAM_TEST_HOLD_AT"
HOLD_LIMIT = 300.0
FAIL_SHARD_ONCE = "JACOBEAM_TEST_FAIL_SHARD_ONCE"
FAIL_MARKER = "JACOBEAM_TEST_FAIL_MARKER"
LEASE_SECONDS = "JACOBEAM_TEST_LEASE_SECONDS"
CLOCK_OFFSET = "JACOBEAM_TEST_CLOCK_OFFSET"

_reached: collections.Counter[str] = collections.Counter()


class TransientFailure(RuntimeError):
    """The injected failure: stands for a preempted worker, a flaky disk, an out-of-memory kill."""


def reached(point: str, shard: int | None = None) -> None:
    """The one hook production code calls: die here (SIGKILL, no clean-up of any kind) if
    ``JACOBEAM_TEST_KILL_AT`` names this point, sleep if ``JACOBEAM_TEST_DELAY_AT`` does, wait for a file
    if ``JACOBEAM_TEST_HOLD_AT`` does; then, while writing the shard whose first id is ``shard``, fail
    once if ``JACOBEAM_TEST_FAIL_SHARD_ONCE`` names it."""
    delay = os.environ.get(DELAY_AT)
    if delay:
        name, _, seconds = delay.partition(":")
        if name == point:
            time.sleep(float(seconds))
    hold = os.environ.get(HOLD_AT)
    if hold:
        name, _, path = hold.partition(":")
        deadline = time.monotonic() + HOLD_LIMIT
        if name == point and not os.path.exists(path):
            open(f"{path}.held", "w").close()
        while name == point and not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
    wanted = os.environ.get(KILL_AT)
    if wanted:
        name, _, nth = wanted.partition(":")
        if name == point:
            _reached[point] += 1
            if _reached[point] == int(nth or 1):
                os.kill(os.getpid(), signal.SIGKILL)
    if shard is not None:
        _fail_shard_once(shard)


def marker_path() -> str:
    return os.environ.get(FAIL_MARKER) or os.path.join(tempfile.gettempdir(), "jacobeam-test-fail-shard-once")


def _fail_shard_once(first_id: int) -> None:
    """Raise once, across processes and retries, while writing the shard starting at ``first_id``."""
    wanted = os.environ.get(FAIL_SHARD_ONCE)
    if wanted is None or int(wanted) != first_id:
        return
    try:
        os.close(os.open(marker_path(), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # failed once already
    raise TransientFailure(f"injected transient failure while writing the shard starting at id {first_id}")


def lease_seconds() -> tuple[float, float] | None:
    """``(heartbeat, stale)`` seconds of the lease where ``JACOBEAM_TEST_LEASE_SECONDS`` sets them."""
    found = os.environ.get(LEASE_SECONDS)
    if not found:
        return None
    heartbeat, _, stale = found.partition(":")
    return float(heartbeat), float(stale)


def clock_offset() -> float:
    """Seconds added to the wall clock the lease reads (``JACOBEAM_TEST_CLOCK_OFFSET``; 0 in normal use)."""
    return float(os.environ.get(CLOCK_OFFSET) or 0.0)
