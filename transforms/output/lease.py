"""One writer per output folder: a lease file (``layout.LEASE``) created exclusively before anything is
touched, holding its holder's id, host, pid, start time and a heartbeat (JSON), removed when the run ends.

A second writer finds the file and is refused (``LeaseBusy``: the command exits 75, for schedulers to
retry), or waits (``wait=True``). A lease is taken over, with one warning, only on evidence that its holder
is gone:

- its process is gone, where the taker can know: the same host, boot (``/proc/sys/kernel/random/boot_id``)
  and PID namespace (``/proc/self/ns/pid``), and no process with that pid and start time;
- or its heartbeat, which the holder rewrites every ``HEARTBEAT_SECONDS``, has not changed for
  ``STALE_SECONDS`` as the taker watched it on its own monotonic clock (read, wait, read again). Two
  machines' wall clocks are never compared: a heartbeat that looks old by them is only a reason to watch.

Each change of the lease file is conditional on what its writer last saw, so that two runs can never
both hold it: locally the create is a hard link of the complete record (``os.link``, which fails where
the name exists), and a take-over, a heartbeat and every commit of the holder (``transforms.output.fence``)
hold the folder's lock (``flock`` of the folder itself), so a take-over waits for a commit under way and a
commit after a take-over sees it; on an object store each request is conditional, checked by the store:
on S3 ``If-None-Match: *`` to create, ``If-Match: <ETag>`` to refresh, take over or remove; on GCS
``ifGenerationMatch=0`` to create, ``ifGenerationMatch=<generation>`` for the rest. Other remote file
systems (HDFS, ...) take no lease: ``supported`` says which.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid

from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output.lease_files import lease_file
from jacobeam.transforms.output.lease_files import supported as supported  # where a lease can be held
from jacobeam.transforms.testing import faults

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


def _read_text(path: str) -> str | None:
    try:
        with open(path) as stream:
            return stream.read().strip()
    except OSError:
        return None


@functools.cache
def _machine() -> dict[str, str | None]:
    """This process's boot and PID namespace (None where the system does not say: not Linux)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_namespace": namespace}


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``): with the pid, it names
    one process, not a later one that reused the pid. None where it cannot be read."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22; the command name before ")" may hold spaces


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def gone_reason(record: dict) -> str | None:
    """Why the holder of lease ``record`` is known to be gone (None where this process cannot know): its
    process is not running, and it ran on this host, boot and PID namespace, where its pid means what it
    means here."""
    machine = _machine()
    if record.get("host") != socket.gethostname() or machine["boot_id"] is None or machine["pid_namespace"] is None:
        return None
    if record.get("boot_id") != machine["boot_id"] or record.get("pid_namespace") != machine["pid_namespace"]:
        return None
    pid = int(record.get("pid", 0))
    if pid <= 0:
        return None
    if not _alive(pid):
        return f"its process {pid} is gone"
    started = record.get("process_start")
    if started is not None and _process_start(pid) not in (None, started):
        return f"its process {pid} is gone (the pid is another process's now)"
    return None


def _now() -> float:
    return time.time() + faults.clock_offset()


def describe(record: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("started_at", 0))))
    return (f"run {record.get('holder')} ({record.get('host')}, pid {record.get('pid')}, since {started}, "
            f"heartbeat {_now() - float(record.get('heartbeat', 0)):.0f} s ago by this machine's clock)")


def parse(raw: bytes, modified: float | None = None) -> dict:
    """A lease record from its bytes; one that is not a lease jacobeam wrote whole (it writes complete
    files) stands for a holder that is judged by watching it."""
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        age = modified or 0.0
        return {"holder": "?", "host": "?", "pid": 0, "started_at": age, "heartbeat": age}
    return record


class Lease:
    """The lease of ``folder`` (local, or on S3 or GCS: ``supported``), held from ``acquire`` until
    ``release`` (or the ``with`` block's end). ``run_id``: the holder's id, a new one by default (a
    pipeline's ``JobSpec.run_id``, which its commits prove, ``transforms.output.fence``)."""

    def __init__(self, folder: str, stale_seconds: float | None = None, run_id: str = "",
                 busy_hint: str = "retry later or pass --wait"):
        heartbeat, stale = faults.lease_seconds() or (HEARTBEAT_SECONDS, STALE_SECONDS)
        self.folder = folder
        self._busy_hint = busy_hint  # what LeaseBusy tells to do: the command line's, or a pipeline's
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._file = lease_file(folder, self.run_id)
        self.path = self._file.path
        self._heartbeat_seconds = heartbeat
        self._stale_seconds = stale if stale_seconds is None else stale_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self.held = False

    def _record(self) -> bytes:
        pid = os.getpid()
        return json.dumps({"holder": self.run_id, "host": socket.gethostname(), "pid": pid,
                           "started_at": self._started, "heartbeat": _now(), **_machine(),
                           "process_start": _process_start(pid)}).encode()

    def acquire(self, wait: bool = False) -> Lease:
        """Create the lease; a holder found is waited for (``wait``) or refused (``LeaseBusy``) unless it
        is gone (``gone_reason``) or its record does not change while watched for the stale time. A
        record that looks stale by the clocks is watched before a refusal: it may be a dead holder's."""
        self._started = _now()
        seen: tuple[bytes, float] | None = None  # the record last read, and since when (monotonic) it has not changed
        said = False
        poll = min(WAIT_POLL_SECONDS, self._stale_seconds / 10)
        while not self._file.create(self._record()):
            found = self._file.read()
            if found is None:
                continue
            raw, token = found
            record, now = parse(raw, self._file.modified()), time.monotonic()
            if record.get("holder") == self.run_id:  # this run's own: a retried claim (``WriteShards``)
                self._file.adopt(raw, token)
                if self._file.refresh(self._record()):
                    break
                continue
            changed = seen is not None and seen[0] != raw
            if seen is None or changed:
                seen = (raw, now)
            reason = gone_reason(record)
            if reason is None and now - seen[1] >= self._stale_seconds:
                reason = f"its lease did not change for {now - seen[1]:.0f} s, watched from here"
            if reason is not None:
                if self._file.take_over(token):
                    log.warning("output folder %s: taking over the lease of %s: %s", self.folder, describe(record), reason)
                    continue
                seen = None  # a commit under way holds the folder: its holder is alive
                if not wait:
                    raise self._busy(record)
                continue
            looks_stale = _now() - float(record.get("heartbeat", 0)) > self._stale_seconds
            if not wait and (changed or not looks_stale):
                raise self._busy(record)
            if not said:
                doing = "waiting" if wait else (f"its heartbeat looks old by the clocks; watching it for "
                                                f"{self._stale_seconds:.0f} s")
                log.warning("output folder %s is being written by %s: %s", self.folder, describe(record), doing)
                said = True
            time.sleep(poll)
        self.held = True
        _held.add(self)
        self._thread = threading.Thread(target=self._beat, name="jacobeam lease heartbeat", daemon=True)
        self._thread.start()
        return self

    def _busy(self, record: dict) -> LeaseBusy:
        return LeaseBusy(f"output folder {self.folder} is being written by {describe(record)}; {self._busy_hint}")

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_seconds):
            if not self._file.refresh(self._record()):  # never write another's lease
                # None: freed by the run's own last step (``claim.release``). Another run's record is said
                # at this run's next commit, which stops it (``transforms.output.fence``).
                if self._file.read() is not None:
                    log.info("output folder %s: this run's lease was taken over by another run", self.folder)
                return

    def release(self) -> None:
        """Remove the lease if it is still this run's (never another run's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.held:
            self._file.remove()
        self.held = False
        _held.discard(self)

    def __enter__(self) -> Lease:
        return self if self.held else self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()
