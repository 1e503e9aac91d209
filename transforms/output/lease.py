"""One writer per output folder: a lease file (``layout.LEASE``) created exclusively before anything is
touched, holding its holder's id, host, pid, start time and a heartbeat (JSON), removed when the run ends.

A second writer finds the file and is refused (``LeaseBusy``: the command exits 75, for schedulers to
retry), or waits (``wait=True``). A stale lease is taken over, with one warning: its process is gone on
this host (a ``kill -9`` leaves the file), or its heartbeat, refreshed by the holder on a thread every
``HEARTBEAT_SECONDS``, is older than ``STALE_SECONDS`` (a holder on another host that died).

Each change of the lease file is conditional on what its writer last saw, so that two runs can never
both hold it: locally the create is a hard link of the complete record (``os.link``, which fails where
the name exists) and a take-over moves the stale file aside first; on an object store each request is
conditional, checked by the store: on S3 ``If-None-Match: *`` to create, ``If-Match: <ETag>`` to refresh,
take over or remove; on GCS ``ifGenerationMatch=0`` to create, ``ifGenerationMatch=<generation>`` for the
rest. Other remote file systems (HDFS, ...) take no lease: ``supported`` says which.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from jacobeam.transforms.errors import MissingExtra, OutputError, first_line
from jacobeam.transforms.output import storage
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


class _LocalFile:
    """The lease file of a local folder. ``token``: the bytes last read or written (no versions locally)."""

    def __init__(self, folder: str, run_id: str):
        self.path, self._run_id, self._mine = os.path.join(folder, LEASE), run_id, b""
        os.makedirs(folder, exist_ok=True)

    def _complete(self, data: bytes) -> str:
        """``data`` in a file of its own, whole on disk: linked or renamed into place, so that a reader
        never sees a lease half written."""
        temp = f"{self.path}.{self._run_id}.new"
        with open(temp, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        return temp

    def create(self, data: bytes) -> bool:
        temp = self._complete(data)
        try:
            os.link(temp, self.path)  # exclusive, as O_CREAT | O_EXCL, but of a complete file
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)
        self._mine = data
        return True

    def read(self) -> tuple[bytes, Any] | None:
        try:
            with open(self.path, "rb") as stream:
                raw = stream.read()
        except FileNotFoundError:
            return None
        return raw, raw

    def modified(self) -> float | None:
        try:
            return os.path.getmtime(self.path)
        except FileNotFoundError:
            return None

    def take_over(self, token: Any) -> None:
        """Remove the lease, but only if it still holds ``token`` (the stale one): it is moved aside first,
        and put back if what moved is not those bytes (another taker's fresh lease, or a heartbeat)."""
        aside = f"{self.path}.stale-{self._run_id}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside, "rb") as stream:
            moved = stream.read()
        if moved != token:
            try:
                os.link(aside, self.path)  # no-replace: a lease created meanwhile stays
            except FileExistsError:
                pass
        os.unlink(aside)

    def refresh(self, data: bytes) -> bool:
        found = self.read()
        if found is None or found[0] != self._mine:
            return False
        os.replace(self._complete(data), self.path)
        self._mine = data
        return True

    def remove(self) -> None:
        found = self.read()
        if found is not None and found[0] == self._mine:
            os.unlink(self.path)


class _StoreObject:
    """The lease object of a folder on an object store. Every change is conditional on ``token``, the
    object's version as its writer last saw it, and the store checks the condition: a subclass says how
    (``_put``, ``take_over``)."""

    def __init__(self, folder: str):
        self.path = folder.rstrip("/") + "/" + LEASE
        self._token: Any = None

    def _put(self, data: bytes, token: Any) -> Any:
        """Write ``data`` if the object is absent (``token`` None) or still at ``token``; the new token,
        or None where the condition failed."""
        raise NotImplementedError

    def _write(self, data: bytes, token: Any) -> bool:
        written = self._put(data, token)
        if written is None:
            return False
        self._token = written
        return True

    def create(self, data: bytes) -> bool:
        return self._write(data, None)

    def modified(self) -> float | None:
        return None  # every lease on an object store is one jacobeam wrote whole (one request)

    def refresh(self, data: bytes) -> bool:
        return self._token is not None and self._write(data, self._token)

    def remove(self) -> None:
        if self._token is not None:
            self.take_over(self._token)


class _S3Object(_StoreObject):
    """The lease object of an S3 folder (``token``: the object's ETag)."""

    def __init__(self, folder: str):
        from apache_beam.io.aws import s3io

        super().__init__(folder)
        self._bucket, self._key = s3io.parse_s3_path(self.path)
        self._client = storage.s3_client(self.path)

    def _put(self, data: bytes, token: Any) -> Any:
        from botocore.exceptions import ClientError

        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            reply = self._client.put_object(Bucket=self._bucket, Key=self._key, Body=data,
                                            ContentType="application/json", **condition)
        except ClientError as err:
            # 412: the condition failed; 409: a concurrent conditional write to the key won.
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return None
            raise
        return reply["ETag"]

    def read(self) -> tuple[bytes, Any] | None:
        from botocore.exceptions import ClientError

        try:
            reply = self._client.get_object(Bucket=self._bucket, Key=self._key)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return reply["Body"].read(), reply["ETag"]

    def take_over(self, token: Any) -> None:
        from botocore.exceptions import ClientError

        try:
            self._client.delete_object(Bucket=self._bucket, Key=self._key, IfMatch=token)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "NoSuchKey", "404"):
                raise


class _GCSObject(_StoreObject):
    """The lease object of a GCS folder (``token``: the object's generation, a new one for each write;
    0 in a condition stands for no object)."""

    def __init__(self, folder: str):
        try:
            from google.auth.exceptions import DefaultCredentialsError
            from google.cloud import storage as gcs
        except ImportError:
            raise MissingExtra(f"the lease of output folder {folder} needs google-cloud-storage: "
                               "pip install 'apache-beam[gcp]'") from None
        super().__init__(folder)
        bucket, _, self._key = self.path.removeprefix("gs://").partition("/")
        # Application default credentials and project, as Beam's gs:// file system takes them unless its
        # options say otherwise (they do not reach this client); STORAGE_EMULATOR_HOST: an emulator's.
        try:
            self._bucket = gcs.Client().bucket(bucket)
        except DefaultCredentialsError as err:
            raise OutputError(f"output folder {folder}: no Google Cloud credentials to take its lease: "
                              f"{first_line(err)}") from err

    def _put(self, data: bytes, token: Any) -> Any:
        from google.api_core.exceptions import PreconditionFailed

        blob = self._bucket.blob(self._key)
        try:
            blob.upload_from_string(data, content_type="application/json", if_generation_match=0 if token is None else token)
        except PreconditionFailed:
            return None
        return blob.generation

    def read(self) -> tuple[bytes, Any] | None:
        from google.api_core.exceptions import NotFound

        blob = self._bucket.blob(self._key)
        try:
            data = blob.download_as_bytes()  # sets the generation of the bytes read, from the reply's headers
        except NotFound:
            return None
        return data, blob.generation

    def take_over(self, token: Any) -> None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:
            self._bucket.blob(self._key).delete(if_generation_match=token)
        except (PreconditionFailed, NotFound):
            pass


_STORES = {"s3": _S3Object, "gs": _GCSObject}  # by scheme


def _scheme(folder: str) -> str:
    return folder.split("://", 1)[0]


def supported(folder: str) -> bool:
    """Whether a lease can be held on ``folder``: a local folder, or one on S3 or GCS."""
    return "://" not in folder or _scheme(folder) in _STORES


class Lease:
    """The lease of ``folder`` (local, or on S3 or GCS: ``supported``), held from ``acquire`` until
    ``release`` (or the ``with`` block's end)."""

    def __init__(self, folder: str, stale_seconds: float = STALE_SECONDS):
        self.folder = folder
        self.run_id = uuid.uuid4().hex[:12]
        self._file = _LocalFile(folder, self.run_id) if "://" not in folder else _STORES[_scheme(folder)](folder)
        self.path = self._file.path
        self._stale_seconds = stale_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self.held = False

    def _record(self) -> bytes:
        return json.dumps({"holder": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "started_at": self._started, "heartbeat": time.time()}).encode()

    def _read(self) -> tuple[dict, Any] | None:
        """The lease found (its record and the token a take-over needs), or None."""
        found = self._file.read()
        if found is None:
            return None
        raw, token = found
        try:
            return json.loads(raw), token
        except ValueError:  # not a lease jacobeam wrote whole (it writes complete files): judged by its age
            age = self._file.modified() or 0.0
            return {"holder": "?", "host": "?", "pid": 0, "started_at": age, "heartbeat": age}, token

    def acquire(self, wait: bool = False) -> Lease:
        self._started = time.time()
        waiting = False
        while not self._file.create(self._record()):
            found = self._read()
            if found is None:
                continue
            record, token = found
            reason = stale_reason(record, stale_seconds=self._stale_seconds)
            if reason is not None:
                log.warning("output folder %s: taking over the lease of %s: %s", self.folder, describe(record), reason)
                self._file.take_over(token)
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

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if not self._file.refresh(self._record()):  # taken over (this run was stale): never write another's
                log.warning("output folder %s: this run's lease was taken over by another run", self.folder)
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
