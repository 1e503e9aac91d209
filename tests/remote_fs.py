"""A Beam ``FileSystem`` under the scheme ``fakegcs://`` that behaves like GCS where it matters to jacobeam.

Backed by a local folder (``$JACOBEAM_FAKEGCS_ROOT``, so worker processes see the same objects), but:

- write streams cannot seek or tell, and an object appears only when its stream is closed (an upload);
- rename is a copy and then a delete, as on GCS;
- there are no folders: listing is by name prefix, ``mkdirs`` does nothing;
- no stream exposes a local path (no ``name``, no ``fileno``): h5py can only get a file object.

Beam finds a file system by subclassing, so importing this module registers it; ``runner.run`` names it
in ``--beam_plugins`` for the workers.

Why it stays beside the real S3 of ``tests/test_s3.py`` (Beam's S3 file system against ``moto_server``):

- it is the other write path of ``transforms/output/storage.py``: every scheme but ``s3://`` writes each
  object, empty ones included, through Beam's write stream, which on S3 carries only objects of 5 MiB
  or more (smaller ones are one put there). GCS behaves as this file system does, and no GCS server
  runs here;
- it is a file system of a project's own, registered by importing its module: the only test of
  ``runner.with_filesystem_plugins`` handing it to worker processes in ``--beam_plugins`` (Beam's
  S3 file system is found without that);
- it needs no server and each call is a local file operation, so ``tests/test_remote.py`` runs its
  many whole jobs (every kill point, resume, foreign folders, ``.npz``/``.h5`` inputs, the portable job
  service) in seconds each, and a test can change stored bytes in place (``local_path``).
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from pathlib import Path

from apache_beam.io.filesystem import BeamIOError, CompressedFile, CompressionTypes, FileMetadata, FileSystem

SCHEME = "fakegcs"
ROOT_ENV = "JACOBEAM_FAKEGCS_ROOT"


def _root() -> Path:
    if ROOT_ENV not in os.environ:
        raise BeamIOError(f"{SCHEME}:// is a test file system: set {ROOT_ENV} to its backing folder")
    return Path(os.environ[ROOT_ENV])


def local_path(url: str) -> Path:
    """Where the object ``url`` is stored (for tests only; jacobeam never sees it)."""
    prefix = f"{SCHEME}://"
    if not url.startswith(prefix):
        raise ValueError(f"{url}: not a {prefix} URL")
    return _root() / url[len(prefix):]


class _Upload(io.RawIOBase):
    """A write-only, non-seekable stream; the object appears on close, as a finished upload."""

    def __init__(self, target: Path):
        self._target = target
        self._partial = target.parent / f".upload-{uuid.uuid4().hex}"
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._partial, "wb")

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data) -> int:
        return self._file.write(data)

    def tell(self) -> int:
        raise io.UnsupportedOperation("fakegcs write streams cannot tell")

    def seek(self, *args) -> int:
        raise io.UnsupportedOperation("fakegcs write streams cannot seek")

    def close(self) -> None:
        if not self.closed:
            self._file.close()
            os.replace(self._partial, self._target)
        super().close()


class _Download(io.RawIOBase):
    """A readable, seekable stream (as GCS downloads are) that hides the local file behind it."""

    def __init__(self, source: Path):
        self._file = open(source, "rb")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._file.readinto(buffer)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class FakeGcsFileSystem(FileSystem):
    @classmethod
    def scheme(cls) -> str:
        return SCHEME

    def join(self, basepath: str, *paths: str) -> str:
        return "/".join([basepath.rstrip("/"), *(p.strip("/") for p in paths)])

    def split(self, path: str) -> tuple[str, str]:
        head, _, tail = path.rstrip("/").rpartition("/")
        return head, tail

    def mkdirs(self, path: str) -> None:
        pass  # object stores have no folders

    def has_dirs(self) -> bool:
        return False

    def _list(self, dir_or_prefix: str):
        base = local_path(f"{SCHEME}://")
        for path in sorted(base.rglob("*")):
            url = f"{SCHEME}://{path.relative_to(base).as_posix()}"
            if path.is_file() and not path.name.startswith(".upload-") and url.startswith(dir_or_prefix):
                yield FileMetadata(url, path.stat().st_size, path.stat().st_mtime)

    def create(self, path, mime_type="application/octet-stream", compression_type=CompressionTypes.AUTO):
        stream = io.BufferedWriter(_Upload(local_path(path)))
        return self._compressed(stream, path, compression_type)

    def open(self, path, mime_type="application/octet-stream", compression_type=CompressionTypes.AUTO):
        if not local_path(path).is_file():
            raise BeamIOError(f"{path}: no such object", {path: FileNotFoundError(path)})
        return self._compressed(io.BufferedReader(_Download(local_path(path))), path, compression_type)

    @staticmethod
    def _compressed(stream, path: str, compression_type):
        if compression_type == CompressionTypes.AUTO:
            compression_type = CompressionTypes.detect_compression_type(path)
        if compression_type == CompressionTypes.UNCOMPRESSED:
            return stream
        return CompressedFile(stream, compression_type)

    def copy(self, source_file_names, destination_file_names) -> None:
        for source, target in zip(source_file_names, destination_file_names):
            with self.open(source, compression_type=CompressionTypes.UNCOMPRESSED) as src, self.create(
                target, compression_type=CompressionTypes.UNCOMPRESSED
            ) as dst:
                shutil.copyfileobj(src, dst)

    def rename(self, source_file_names, destination_file_names) -> None:
        self.copy(source_file_names, destination_file_names)  # as GCS does: copy, then delete
        self.delete(source_file_names)

    def exists(self, path: str) -> bool:
        return local_path(path).is_file()

    def size(self, path: str) -> int:
        return local_path(path).stat().st_size

    def last_updated(self, path: str) -> float:
        return local_path(path).stat().st_mtime

    def checksum(self, path: str) -> str:
        return str(self.size(path))

    def metadata(self, path: str) -> FileMetadata:
        return FileMetadata(path, self.size(path), self.last_updated(path))

    def delete(self, paths) -> None:
        errors = {}
        for path in paths:
            target = local_path(path)
            if target.is_file():
                target.unlink()
            else:
                errors[path] = FileNotFoundError(path)
        if errors:
            raise BeamIOError("Delete operation failed", errors)
