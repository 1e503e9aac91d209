"""Files of an output folder, local or remote (``gs://``, ``s3://``, ``hdfs://``, any Beam ``FileSystem``).

Local paths keep the fast, POSIX way: write under a temporary name beside the target, fsync, rename
(atomic). Remote paths go through Beam's ``FileSystems``. h5py needs a seekable file to write, and a
remote write stream (GCS, S3) is not seekable, so a remote file is written to a local temporary file,
stream-copied to a temporary remote name, and "renamed" into place: ``FileSystems.rename``, which on
GCS and S3 is a copy and a delete, not an atomic rename. An object store makes each object visible
only once its upload finished, but what a remote *folder* holds is complete only as far as its
manifest says (see ``transforms.output.shards`` for how a remote shard proves itself complete).

Input files are opened here too (``open_input``), always through ``FileSystems``; ``count_input_reads``
counts the bytes read from them (what ``jacobeam verify`` reports reading). The rest of the
code calls these helpers instead of branching on schemes. One scheme needs a branch of its own here: an
S3 object smaller than 5 MiB (an empty one among them) is written with one put, not Beam's multipart
write stream, which cannot write an empty object (``S3_PUT_BYTES``).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import io
import mmap
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from jacobeam.transforms.errors import CorruptInputError
from jacobeam.transforms.output import layout
from jacobeam.transforms.testing import faults

# A commit's guard: entered around the rename (``transforms.output.fence.Fence``).
Fence = Callable[[], contextlib.AbstractContextManager[None]]

_COPY_BYTES = 8 << 20


def is_local(path: str | os.PathLike) -> bool:
    return "://" not in str(path)


def absolute(path: str) -> str:
    """A local path (or glob) made absolute against the working directory, symbolic links kept; a remote
    URL as it is. Workers need not share the launcher's working directory."""
    return os.path.abspath(path) if is_local(path) else path


def normalize(path: str | os.PathLike) -> str:
    """An absolute local path, or the remote URL without a trailing slash."""
    text = str(path)
    return str(Path(text).resolve()) if is_local(text) else text.rstrip("/")


def join(root: str | os.PathLike, *parts: str) -> str:
    if is_local(root):
        return os.path.join(root, *parts)
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.join(str(root), *parts)


def name_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def exists(path: str | os.PathLike) -> bool:
    if is_local(path):
        return os.path.exists(path)
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.exists(str(path))


def is_file(path: str | os.PathLike) -> bool:
    return os.path.isfile(path) if is_local(path) else exists(path)


def is_folder(path: str | os.PathLike) -> bool:
    """A local folder, or a remote name prefix under which some object exists."""
    if is_local(path):
        return os.path.isdir(path)
    from apache_beam.io.filesystems import FileSystems

    (match,) = FileSystems.match([str(path).rstrip("/") + "/**"], limits=[1])
    return bool(match.metadata_list)


def listdir(folder: str | os.PathLike) -> list[str]:
    """Names of the files directly in ``folder`` (sorted; empty when there is none). On object stores a
    folder is a name prefix: it "exists" exactly when some object starts with it."""
    if is_local(folder):
        return sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    from apache_beam.io.filesystems import FileSystems

    prefix = str(folder).rstrip("/") + "/"
    (match,) = FileSystems.match([prefix + "*"])
    return sorted(m.path[len(prefix):] for m in match.metadata_list if "/" not in m.path[len(prefix):])


def open_read(path: str | os.PathLike) -> IO[bytes]:
    if is_local(path):
        return open(path, "rb")
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.open(str(path), compression_type=CompressionTypes.UNCOMPRESSED)


HEADER_BUFFER = 4096  # bytes a remote file opened for its headers reads at a time


def open_input(path: str, headers: bool = False) -> IO[bytes]:
    """An input file opened for reading, through Beam's ``FileSystems`` (a local one as it does); one
    that cannot be opened is a ``CorruptInputError`` (reason ``unreadable: ...``). ``headers``: only
    headers will be read: a remote file is read in ranges of ``HEADER_BUFFER`` bytes (Beam's remote
    streams read 16 MiB ranges, the whole object where it is smaller)."""
    try:
        # open_read: a local file as Beam's local file system opens it, without its dispatch (most of describing a
        # small file's header: 100 s of planning a million files, benchmarks/README.md).
        stream = open_read(path)
    except Exception as err:  # Beam wraps every file-system failure in its own error types.
        raise CorruptInputError(f"{path}: cannot open: {err}", reason=f"unreadable: {err}") from err
    if headers and not is_local(path) and isinstance(stream, io.BufferedReader):
        stream = io.BufferedReader(stream.detach(), buffer_size=HEADER_BUFFER)  # nothing read yet: its raw stream
    counter = _input_reads.get()
    return stream if counter is None else _Counted(stream, counter)


class InputReads:
    """Bytes the readers took from input files opened by ``open_input`` (``count_input_reads``): what
    ``jacobeam verify`` reports reading, whatever the format."""

    def __init__(self):
        self.bytes = 0


_input_reads: contextvars.ContextVar[InputReads | None] = contextvars.ContextVar("input_reads", default=None)


@contextlib.contextmanager
def count_input_reads() -> Iterator[InputReads]:
    """Count the bytes read from input files opened in this context (a stream opened outside is not)."""
    counter = InputReads()
    token = _input_reads.set(counter)
    try:
        yield counter
    finally:
        _input_reads.reset(token)


class _Counted:
    """An input stream that adds the bytes it returns to a counter; the rest is the stream's own."""

    def __init__(self, stream: IO[bytes], counter: InputReads):
        self._stream, self._counter = stream, counter

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._counter.bytes += len(data)
        return data

    def read1(self, size: int = -1) -> bytes:
        data = self._stream.read1(size)
        self._counter.bytes += len(data)
        return data

    def readinto(self, buffer) -> int:
        count = self._stream.readinto(buffer)
        self._counter.bytes += count or 0
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc) -> None:
        self._stream.close()


def read_text(path: str | os.PathLike) -> str:
    with open_read(path) as stream:
        return stream.read().decode()


@contextlib.contextmanager
def open_h5(path: str | os.PathLike) -> Iterator[Any]:
    """An HDF5 file opened for reading; a remote one through a file object (h5py never sees a URL)."""
    import h5py

    if is_local(path):
        with h5py.File(path, "r") as h5:
            yield h5
        return
    with open_read(path) as stream, h5py.File(stream, "r") as h5:
        yield h5


def sha256(path: str | os.PathLike) -> str:
    if is_local(path):  # mapped, not read: hashing without a copy (benchmarks/README.md)
        with open(path, "rb") as stream:
            if os.fstat(stream.fileno()).st_size == 0:
                return hashlib.sha256().hexdigest()
            with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return hashlib.sha256(view).hexdigest()
    digest = hashlib.sha256()
    with open_read(path) as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


_CRC_READ_BYTES = 256 << 10  # google_crc32c takes bytes only (no memory map): read in cache-sized pieces


def crc32c(path: str | os.PathLike) -> str:
    """The CRC32C (Castagnoli) of a file's bytes, as 8 hex digits of the big-endian value: a shard's
    checksum (``sha256`` is that of shards written before it; about a fifth of its CPU, benchmarks/README.md)."""
    import google_crc32c

    value = 0
    with open(path, "rb", buffering=0) if is_local(path) else open_read(path) as stream:
        while block := stream.read(_CRC_READ_BYTES):
            value = google_crc32c.extend(value, block)
    return f"{value:08x}"


def durable(path: str | os.PathLike) -> None:
    """Flush a local file (or folder) to the disk. Before a rename, so that a machine that loses power
    (a preempted VM) cannot leave a complete-looking name with missing data; after it, for the rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Beam's S3 write stream (``FileSystems.create("s3://...")``) is always a multipart upload: it starts the
# upload when opened, sends a part whenever 5 MiB are buffered (S3's least size for every part but the
# last) and the rest when closed, then completes the upload with the parts it sent. An empty object has
# no part to send, and S3 refuses to complete an upload of no part (``MalformedXML`` from
# CompleteMultipartUpload: real S3 does, and so does moto), so an empty file (an empty
# ``rejected.jsonl``, the writability probe) cannot be written that way at all. Below this size an
# S3 object is therefore written with one PutObject request instead, which S3 accepts for any size up
# to 5 GiB, empty included; at this size or above Beam's stream sends at least one part of 5 MiB, which
# S3 accepts. (Below it, Beam's stream would send one part anyway: a put is the same upload in one
# request instead of three.) Other schemes need no such care (GCS uploads an empty object as it does
# any other), so they keep Beam's stream.
S3_PUT_BYTES = 5 << 20


def _put_whole_object(path: str, size: int) -> bool:
    """Whether ``path`` takes an object of ``size`` bytes in one request (``_s3_put``), not Beam's stream."""
    return size < S3_PUT_BYTES and path.startswith("s3://")


def s3_client(path: str):
    """The boto3 client Beam makes for the S3 ``path`` from the file systems' options
    (``--s3_endpoint_url``, ``--s3_access_key_id``, ``--s3_region_name``, ... as given to
    ``FileSystems.set_options``: by ``runner.run`` in the launcher, by Beam in each worker)."""
    from apache_beam.io.aws import s3io
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    # The options the S3FileSystem that Beam hands out for this path was made with (None when nothing
    # set them: then the defaults, as boto3 would take them from the environment).
    options = getattr(FileSystems.get_filesystem(path), "_options", None) or PipelineOptions([])
    return s3io.S3IO(options=options).client.client  # Beam's boto3_client.Client wraps a boto3 client


def _s3_put(path: str, data: bytes) -> None:
    """Write a whole S3 object in one PutObject request, through Beam's client (``s3_client``)."""
    from apache_beam.io.aws import s3io
    from apache_beam.io.filesystem import BeamIOError

    bucket, key = s3io.parse_s3_path(path)
    try:
        s3_client(path).put_object(Bucket=bucket, Key=key, Body=data, ContentType="application/octet-stream")
    except Exception as err:  # botocore's errors, as Beam's own S3 calls wrap them
        raise BeamIOError(f"writing {path} failed: {err}", {path: err}) from err


def copy_from_local(local: str | os.PathLike, remote: str) -> None:
    """Stream a local file to ``remote`` (the write stream need not seek); a small S3 object in one put."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    if _put_whole_object(remote, os.path.getsize(local)):
        _s3_put(remote, Path(local).read_bytes())
        return
    with open(local, "rb") as source, FileSystems.create(remote, compression_type=CompressionTypes.UNCOMPRESSED) as target:
        shutil.copyfileobj(source, target, _COPY_BYTES)


def write_bytes(path: str, data: bytes) -> None:
    """Write a small file directly (no temporary name): for files whose content proves itself. Empty
    ``data`` is fine on every scheme (on S3 through one put, see ``S3_PUT_BYTES``)."""
    if is_local(path):
        Path(path).write_bytes(data)
        return
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    if _put_whole_object(path, len(data)):
        _s3_put(path, data)
        return
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as stream:
        stream.write(data)


def rename(source: str, target: str) -> None:
    """Move ``source`` to ``target``, replacing it. Atomic locally; a copy and a delete on GCS and S3."""
    if is_local(source):
        os.replace(source, target)
        return
    from apache_beam.io.filesystem import BeamIOError
    from apache_beam.io.filesystems import FileSystems

    try:
        FileSystems.rename([source], [target])  # GCS and S3 copy over an existing target: no gap
    except BeamIOError:  # how Beam's file systems report a failed rename
        # HDFS refuses to rename onto an existing file: there (only), the target is briefly absent.
        if not (target.startswith("hdfs://") and FileSystems.exists(target)):
            raise
        FileSystems.delete([target])
        FileSystems.rename([source], [target])


def delete(*paths: str | os.PathLike) -> None:
    """Remove files that exist; a missing one is no error."""
    for path in paths:
        if is_local(path):
            Path(path).unlink(missing_ok=True)
            continue
        from apache_beam.io.filesystems import FileSystems

        if FileSystems.exists(str(path)):
            FileSystems.delete([str(path)])


class TargetExists(FileExistsError):
    """A commit that would replace a complete file (``IncompleteFile(..., replace=False)``)."""


class IncompleteFile:
    """A file that appears under its name whole or not at all (as TFDS's ``incomplete_files``).

    Write the file at ``local`` (a local path); ``commit()`` gives it its final name: locally ``local`` is
    a temporary name beside ``path`` (``layout.temp_name``), flushed to the disk and renamed (atomic);
    remotely it is a private scratch file, copied to the temporary name in the remote folder and then
    renamed there. ``discard()`` (and leaving the ``with`` block without a commit) removes every
    temporary file, so a failed attempt leaves nothing that a retry or a later run could see; a killed
    one leaves a temporary name, which never counts and which the next run removes.

    ``with IncompleteFile(path) as temp: fill(temp.local)`` commits when the block ends without an
    error. ``point`` is the fault-injection point reached just before the rename. ``run_id``: the
    writing run's, carried by the temporary name. ``replace=False``: the commit never replaces a
    complete file at ``path`` (``TargetExists`` instead; locally a hard link, which fails where the name
    exists; remotely ``complete(path)`` just before the rename, which narrows the race but cannot close
    it without a conditional write). ``fence``: entered around the rename, the run's proof that it still
    holds the folder's lease (``transforms.output.fence``).
    """

    def __init__(self, path: str, point: str | None = None, run_id: str = "", replace: bool = True,
                 complete: Callable[[str], bool] = exists, fence: Fence | None = None):
        self.path, self._point, self._replace, self._complete = path, point, replace, complete
        self._fence = fence or contextlib.nullcontext
        folder, name = (os.path.dirname(path), os.path.basename(path)) if is_local(path) else path.rsplit("/", 1)
        self._folder = folder
        self._temp = join(folder, layout.temp_name(name, uuid.uuid4().hex[:12], run_id))
        self._scratch: Path | None = None
        if is_local(path):
            self.local = Path(self._temp)
        else:
            self._scratch = Path(tempfile.mkdtemp(prefix="jacobeam-"))
            self.local = self._scratch / name
        self.committed = self._discarded = False

    def commit(self) -> None:
        with self.explained():
            self._commit()

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """A temporary file gone before its commit: removed by a run that took this run's folder over (the
        fence then says so, ``LostLeaseError``), or by hand (the error as it is)."""
        try:
            yield
        except FileNotFoundError:
            with self._fence():
                pass
            raise

    def _commit(self) -> None:
        if is_local(self.path):
            durable(self.local)
            if self._point:
                faults.reached(self._point)
            with self._fence():
                if self._replace:
                    os.replace(self.local, self.path)
                else:
                    self._link()
            durable(self._folder or ".")
        else:
            copy_from_local(self.local, self._temp)
            if self._point:
                faults.reached(self._point)
            with self._fence():
                if not self._replace and self._complete(self.path):
                    raise TargetExists(self.path)
                rename(self._temp, self.path)
        self.committed = True
        self.discard()

    def _link(self) -> None:
        """Give the local temporary file its name unless that name exists (then ``TargetExists``)."""
        try:
            os.link(self.local, self.path)
        except FileExistsError:
            raise TargetExists(self.path) from None
        except OSError as err:  # a file system without hard links (some FUSE and SMB mounts): check, then rename
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if os.path.exists(self.path):
                raise TargetExists(self.path) from None
            os.replace(self.local, self.path)
            return
        self.local.unlink()

    def discard(self) -> None:
        """Remove the temporary files (not the committed file)."""
        if self._discarded:
            return
        self._discarded = True
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            delete(self._temp)
        elif not self.committed:
            self.local.unlink(missing_ok=True)

    def __enter__(self) -> IncompleteFile:
        return self

    def __exit__(self, exc_type, *rest) -> None:
        try:
            if exc_type is None and not self.committed:
                self.commit()
        finally:
            self.discard()


def write_atomically(path: str, write: Callable[[Path], None], point: str | None = None,
                     fence: Fence | None = None) -> None:
    """Write ``path`` whole or not at all: ``write(local_file)`` fills a local file (``IncompleteFile``)."""
    with IncompleteFile(path, point, fence=fence) as temp:
        write(temp.local)
