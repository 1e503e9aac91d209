"""Where a folder's lease is kept, and how it is changed: the lease file of a local folder, the lease
object of an S3 or GCS folder (``transforms.output.lease`` decides when). Each change is conditional on
what its writer last saw: locally under the folder's lock (``flock`` of the folder), on a store by the
store's own conditions (S3 ``If-None-Match``/``If-Match``, GCS ``ifGenerationMatch``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from typing import Any

from jacobeam.transforms.errors import MissingExtra, OutputError, first_line
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import LEASE

LOCK_PATIENCE_SECONDS = 10.0  # a folder lock held longer: its holder is alive (a commit under way)


class _LocalFile:
    """The lease file of a local folder. ``token``: the bytes last read or written (no versions locally).
    ``locked()``: the folder's lock, held by a take-over, a heartbeat and each commit of the holder."""

    def __init__(self, folder: str, run_id: str):
        self.folder, self.path, self._run_id, self._mine = folder, os.path.join(folder, LEASE), run_id, b""
        os.makedirs(folder, exist_ok=True)

    @contextlib.contextmanager
    def locked(self, patience: float | None = None) -> Iterator[bool]:
        """Hold the folder's lock (``flock`` of the folder, released by the kernel when its holder dies);
        yields False where it was not had within ``patience`` seconds (None: wait as long as it takes)."""
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            deadline = None if patience is None else time.monotonic() + patience
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        yield False
                        return
                    time.sleep(0.05)
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

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

    def adopt(self, raw: bytes, token: Any) -> None:
        """Take the lease read (``raw``, ``token``) as this run's own: it names this run's id."""
        self._mine = raw

    def modified(self) -> float | None:
        try:
            return os.path.getmtime(self.path)
        except FileNotFoundError:
            return None

    def take_over(self, token: Any) -> bool:
        """Remove the lease, but only if it still holds ``token`` (the stale one), under the folder's lock:
        False where the lock stays held (a commit under way: its holder is alive)."""
        with self.locked(LOCK_PATIENCE_SECONDS) as had:
            if not had:
                return False
            found = self.read()
            if found is not None and found[0] == token:
                os.unlink(self.path)
            return True

    def refresh(self, data: bytes) -> bool:
        if not os.path.isdir(self.folder):  # removed with the lease in it (a staging folder moved in)
            return False
        with self.locked():
            found = self.read()
            if found is None or found[0] != self._mine:
                return False
            os.replace(self._complete(data), self.path)
            self._mine = data
            return True

    def remove(self) -> None:
        if not os.path.isdir(self.folder):  # removed with the lease in it (a staging folder moved in)
            return
        with self.locked():
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

    def adopt(self, raw: bytes, token: Any) -> None:
        """Take the lease read (``raw``, ``token``) as this run's own: it names this run's id."""
        self._token = token

    def modified(self) -> float | None:
        return None  # every lease on an object store is one jacobeam wrote whole (one request)

    @contextlib.contextmanager
    def locked(self, patience: float | None = None) -> Iterator[bool]:
        yield True  # no lock: each request is conditional, checked by the store

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
            # 412: the condition failed; 409: a concurrent conditional write to the key won; 404: If-Match on
            # a lease since removed.
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                             "NoSuchKey", "404"):
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

    def take_over(self, token: Any) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.delete_object(Bucket=self._bucket, Key=self._key, IfMatch=token)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "NoSuchKey", "404"):
                raise
        return True


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

    def take_over(self, token: Any) -> bool:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:
            self._bucket.blob(self._key).delete(if_generation_match=token)
        except (PreconditionFailed, NotFound):
            pass
        return True


_STORES = {"s3": _S3Object, "gs": _GCSObject}  # by scheme


def _scheme(folder: str) -> str:
    return folder.split("://", 1)[0]


def supported(folder: str) -> bool:
    """Whether a lease can be held on ``folder``: a local folder, or one on S3 or GCS."""
    return "://" not in folder or _scheme(folder) in _STORES


def lease_file(folder: str, run_id: str) -> _LocalFile | _StoreObject:
    """The lease file of ``folder`` (``supported``), as run ``run_id`` reads and changes it."""
    return _LocalFile(folder, run_id) if "://" not in folder else _STORES[_scheme(folder)](folder)
