"""One writer per output folder: a lease file (``layout.LEASE``) created exclusively before anything is
touched, holding its holder's id, host, pid, start time and a heartbeat (JSON), removed when the run ends.

A second writer finds the file and is refused (``LeaseBusy``: the command exits 75, for schedulers to
retry), or waits (``wait=True``). A stale lease is taken over, with one warning: its process is gone on
this host (a ``kill -9`` leaves the file), or its heartbeat, refreshed by the holder on a thread every
``HEARTBEAT_SECONDS``, is older than ``STALE_SECONDS`` (a holder on another host that died).

Local folders only in this version: the exclusive create is a hard link of the complete record
(``os.link``, which fails where the name exists). (Remote folders, S3's
``IfNoneMatch='*'`` and GCS's ``ifGenerationMatch=0``, are not implemented yet: ``acquire`` returns a
lease that holds nothing there.)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output.layout import LEASE

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0  # ten missed heartbeats
WAIT_POLL_SECONDS = 2.0

_held: set[Lease] = set()  # the leases this process holds (``release_held``)


def release_held() -> None:
    """Release every lease this process holds: for an exit without clean-up (the command's Ctrl-C,
    which ends with ``os._exit``)."""
    for held in list(_held):
        held.release()


class LeaseBusy(OutputError):
    """Another live run holds the folder's lease (the command's exit status 75)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def stale_reason(record: dict, now: float | None = None, stale_seconds: float = STALE_SECONDS) -> str | None:
    """Why a lease ``record`` no longer holds (None while it does)."""
    now = time.time() if now is None else now
    if record.get("host") == socket.gethostname() and not _alive(int(record.get("pid", 0))):
        return f"its process {record.get('pid')} is gone"
    age = now - float(record.get("heartbeat", 0))
    if age > stale_seconds:
        return f"no heartbeat for {age:.0f} s"
    return None


def describe(record: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("started_at", 0))))
    return (f"run {record.get('holder')} ({record.get('host')}, pid {record.get('pid')}, since {started}, "
            f"heartbeat {time.time() - float(record.get('heartbeat', 0)):.0f} s ago)")


class Lease:
    """The lease of ``folder`` (local), held from ``acquire`` until ``release`` (or the ``with`` block's end)."""

    def __init__(self, folder: str, stale_seconds: float = STALE_SECONDS):
        self.folder, self.path = folder, os.path.join(folder, LEASE)
        self.run_id = uuid.uuid4().hex[:12]
        self._stale_seconds = stale_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _record(self) -> dict:
        return {"holder": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                "started_at": self._started, "heartbeat": time.time()}

    def _read(self) -> tuple[bytes, dict] | None:
        try:
            with open(self.path, "rb") as stream:
                raw = stream.read()
        except FileNotFoundError:
            return None
        try:
            return raw, json.loads(raw)
        except ValueError:  # not a lease jacobeam wrote whole (it links complete files): judged by its age
            try:
                age_heartbeat = os.path.getmtime(self.path)
            except FileNotFoundError:
                return None
            return raw, {"holder": "?", "host": "?", "pid": 0, "started_at": age_heartbeat, "heartbeat": age_heartbeat}

    def _written(self) -> str:
        """This run's record in a file of its own, whole on disk: linked or renamed into place, so that a
        reader never sees a lease half written."""
        temp = f"{self.path}.{self.run_id}.new"
        with open(temp, "w") as stream:
            json.dump(self._record(), stream)
            stream.flush()
            os.fsync(stream.fileno())
        return temp

    def _create(self) -> bool:
        temp = self._written()
        try:
            os.link(temp, self.path)  # exclusive, as O_CREAT | O_EXCL, but of a complete file
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)

    def _take_over(self, raw: bytes) -> None:
        """Remove a stale lease, but only the one judged stale: it is moved aside first, and put back if
        what moved is not those bytes (another taker's fresh lease, or a heartbeat in between)."""
        aside = f"{self.path}.stale-{self.run_id}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside, "rb") as stream:
            moved = stream.read()
        if moved != raw:
            try:
                os.link(aside, self.path)  # no-replace: a lease created meanwhile stays
            except FileExistsError:
                pass
        os.unlink(aside)

    def acquire(self, wait: bool = False) -> Lease:
        os.makedirs(self.folder, exist_ok=True)
        self._started = time.time()
        waiting = False
        while not self._create():
            found = self._read()
            if found is None:
                continue
            raw, record = found
            reason = stale_reason(record, stale_seconds=self._stale_seconds)
            if reason is not None:
                log.warning("output folder %s: taking over the lease of %s: %s", self.folder, describe(record), reason)
                self._take_over(raw)
                continue
            if not wait:
                raise LeaseBusy(f"output folder {self.folder} is being written by {describe(record)}; "
                                "retry later or pass --wait")
            if not waiting:
                log.warning("output folder %s is being written by %s: waiting", self.folder, describe(record))
                waiting = True
            time.sleep(WAIT_POLL_SECONDS)
        self.held = True
        _held.add(self)
        self._thread = threading.Thread(target=self._beat, name="jacobeam lease heartbeat", daemon=True)
        self._thread.start()
        return self

    def _ours(self) -> bool:
        found = self._read()
        return found is not None and found[1].get("holder") == self.run_id

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if not self._ours():  # taken over (this run was stale): never write another run's lease
                log.warning("output folder %s: this run's lease was taken over by another run", self.folder)
                return
            os.replace(self._written(), self.path)

    def release(self) -> None:
        """Remove the lease if it is still this run's (never another run's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.held and self._ours():
            os.unlink(self.path)
        self.held = False
        _held.discard(self)

    def __enter__(self) -> Lease:
        return self if self.held else self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()
