"""``ShardWriter``: one shard's rows written to its HDF5 file on a background thread, then committed.

The rows reach the file on the writer's thread, so that writing one batch overlaps computing the next,
and so can the commit (checksum, flush to disk, rename: ``commit_later``); the caller sees a failed write
at its next call or in the commit's future, and never a half shard. How a shard counts as complete, and
the record a worker reports of it: ``shards``.

Besides the engine's arrays, every shard holds a ``nonfinite`` mask over its rows: True where a
sample's results (Jacobian, output, ...) hold NaN or Inf although its input was finite.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import CRC32C_SUFFIX, NONFINITE, SAMPLE_ID, VIEW, shard_name
from jacobeam.transforms.output.shards import proven_checksum, read_attrs, shard_path
from jacobeam.transforms.testing import faults

_CHUNK_BYTES = 1 << 20


def _proven(path: str) -> bool:
    """Whether a remote shard at ``path`` is complete (``proven_checksum``; reads it only if it exists):
    one that is not, a copy cut short or one whose sidecar disagrees, is computed again and replaced."""
    return storage.exists(path) and proven_checksum(path) is not None


def nonfinite_rows(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Per row: does any float array (all but ``sample_id``) hold NaN or Inf there?"""
    mask = None
    for name, values in arrays.items():
        if values.dtype.name == "bfloat16":  # ml_dtypes' type: not a numpy floating subtype
            values = values.astype(np.float32)
        if name == SAMPLE_ID or not np.issubdtype(values.dtype, np.floating):
            continue
        bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
        mask = bad if mask is None else mask | bad
    return np.zeros(len(next(iter(arrays.values()))), bool) if mask is None else mask


def _lower_priority() -> None:
    """Schedule the calling thread as a batch thread (Linux, where a thread is a task of its own).

    Where the engine keeps every core busy, a writer thread at the normal policy slowed the pipeline
    down (likely because on waking up it preempts one of TensorFlow's threads mid-operation, and the
    operation waits for its slowest thread). ``SCHED_BATCH`` keeps the thread's fair share of the CPU
    but never preempts on waking: it writes when a core is free or its turn comes. A lower priority
    (nice) starved the writer under load from other processes. Measurements: benchmarks/README.md.
    """
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # a refusal only costs the overlap
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))


class ShardWriter:
    """Write one shard of the samples with ids in ``[start, stop)``, batch by batch, then commit it atomically.

    The shard holds at most ``rows`` samples (default ``stop - start``), in id order: the commit says how
    many (fewer when the reading rejected some; none when it rejected all). Datasets are created at the
    first ``write`` from the arrays' shapes: ``(rows, *rest)``, chunked along samples, and cut to the
    rows written at the commit. Leaving the ``with`` block without ``commit()`` deletes the temporary file, so a failed
    attempt leaves nothing behind that a retry or rerun could see (a killed one leaves a temporary name,
    which never counts and which the next run removes).

    ``write`` and ``attach`` only check their arguments and queue the work: one thread of the writer's own
    does the HDF5 writes, in order, at most ``pending`` batches behind the caller (the caller waits when
    that many are queued, which bounds the memory held to ``pending`` batches). The arrays passed must not
    be changed afterwards. A failed write is raised, as an ``OutputError`` naming the shard, by the next
    ``write``, ``attach`` or ``commit``; ``commit`` waits for every queued write.

    The commit never replaces a complete shard under the shard's name (``_kept_existing``), except with
    ``replace``: a stale shard (computed from an input file changed since, ``JobSpec.stale``), which stays
    and reads as it did until this one takes its name in one rename.
    """

    def __init__(
        self,
        output_dir: str,
        start: int,
        stop: int,
        attrs: dict[str, Any],
        compression: str = "none",
        rows: int | None = None,
        pending: int = 2,
        run_id: str = "",
        fence: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        replace: bool = False,
    ):
        self.name = shard_name(start, stop)
        self.final_path = shard_path(output_dir, start, stop)
        self._remote = not storage.is_local(output_dir)
        self._output_dir = output_dir
        self._file: storage.IncompleteFile | None = None  # made by __enter__
        self.start, self.stop = start, stop
        self.rows = stop - start if rows is None else rows
        self.nonfinite = 0  # rows flagged in the nonfinite mask so far (complete after commit)
        self._queued = 0  # rows handed to write() so far
        self._next_id = start
        self._attrs = attrs
        self._run_id = run_id
        self._replace = replace
        self._fence = fence or contextlib.nullcontext  # the run's proof that it still holds the folder's lease
        self._compression = None if compression == "none" else compression
        self._h5 = None
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=pending)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._cancelled = False
        self._committed: concurrent.futures.Future[str] | None = None  # set by commit_later
        self._checksum: str | None = None
        self._datasets: dict[str, Any] = {}  # h5py's datasets by name, once created
        self._rows: dict[str, _Rows] = {}  # the datasets written chunk by chunk (without compression)

    def __enter__(self) -> ShardWriter:
        import h5py

        if not self._remote:
            os.makedirs(os.path.dirname(self.final_path), exist_ok=True)
        self._file = storage.IncompleteFile(
            self.final_path, point="shard_commit", run_id=self._run_id, replace=self._replace, complete=_proven,
            fence=self._fence,
        )
        self._h5 = h5py.File(self._file.local, "w")
        self._h5.attrs.update(self._attrs)
        self._h5.attrs.update(id_start=self.start, id_stop=self.stop)
        self._thread = threading.Thread(target=self._run, name=f"write {self.name}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._cancelled = True  # an abandoned shard: queued writes are dropped, not done
        self._drain()
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None
        self._file.discard()

    # -- the writer thread --------------------------------------------------------------------------

    def _run(self) -> None:
        """Do the queued jobs in order until the ``None`` that ends them; after a failure (or once the
        shard is abandoned) only take jobs off the queue, so that the caller never waits forever. Then
        settle the commit's future, if a commit was queued."""
        _lower_priority()
        while (job := self._jobs.get()) is not None:
            if self._failure is None and not self._cancelled:
                try:
                    job()
                except BaseException as err:  # handed to the caller's thread, which raises it
                    self._failure = err
        if self._committed is not None:
            if self._failure is not None:
                self._committed.set_exception(self._error())
            elif self._checksum is None:
                self._committed.set_exception(OutputError(f"{self.name}: abandoned before its commit"))
            else:
                self._committed.set_result(self._checksum)

    def _submit(self, job: Callable[[], None]) -> None:
        self._raise_failure()
        if self._committed is not None:
            raise OutputError(f"{self.name}: already committed")
        self._jobs.put(job)

    def _drain(self) -> None:
        """Wait until every queued job is done and the thread has ended."""
        if self._thread is not None:
            if self._committed is None:  # a queued commit already ended the queue
                self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _error(self) -> OutputError:
        error = OutputError(f"{self.name}: writing the shard failed: {self._failure}")
        error.__cause__ = self._failure
        return error

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._error()

    # -- writing ------------------------------------------------------------------------------------

    def _dataset(self, name: str, like: np.ndarray):
        if name not in self._datasets:  # kept: h5py looks a name up in the file at each call
            rows = self.rows
            row_bytes = max(1, like[0].nbytes if len(like) else like.itemsize)
            chunk_rows = max(1, min(rows, _CHUNK_BYTES // row_bytes))
            if self._compression is None and chunk_rows < rows:
                # A power of two, so that batches of a power-of-two size fill whole chunks: those go from
                # the batch into the file without a copy (_Rows)
                chunk_rows = 1 << (chunk_rows.bit_length() - 1)
            dcpl = None
            if self._compression is None:
                import h5py

                # Every chunk's place in the file fixed when the dataset is made, so that the file's bytes
                # do not depend on how rows were batched (WriteShards, a resumed run): chunks written
                # directly would otherwise lie in the order they came.
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dataset = self._h5.create_dataset(
                name,
                shape=(rows, *like.shape[1:]),
                maxshape=(rows, *like.shape[1:]),
                dtype=self._h5_dtype(like.dtype),
                chunks=(chunk_rows, *like.shape[1:]),
                compression=self._compression,
                dcpl=dcpl,
                fill_time="never" if dcpl is not None else None,
            )
            if self._compression is None:
                self._rows[name] = _Rows(dataset, like.dtype)
            self._datasets[name] = dataset
        return self._datasets[name]

    def _h5_dtype(self, dtype: np.dtype):
        """bfloat16 has no numpy-native HDF5 type: store it as an HDF5 float of bfloat16's layout
        (2 bytes on disk; h5py and other HDF5 readers read it back as float32)."""
        if dtype.name != "bfloat16":
            return dtype
        if "bfloat16" not in self._h5:
            import h5py

            bfloat16 = h5py.h5t.IEEE_F32LE.copy()
            bfloat16.set_fields(15, 7, 8, 0, 7)  # sign bit, exponent at 7 (8 bits), mantissa 7 bits
            bfloat16.set_precision(16)
            bfloat16.set_size(2)
            bfloat16.set_ebias(127)
            bfloat16.commit(self._h5.id, b"bfloat16")  # a named type: self-describing in the file
        return self._h5["bfloat16"]

    @property
    def rows_written(self) -> int:
        """Rows handed to ``write`` so far (``commit`` waits until they are in the file)."""
        return self._queued

    def write(self, first_id: int, arrays: dict[str, np.ndarray]) -> None:
        """Append the next rows (every array in ``arrays``, all of one length); ``first_id`` is the sample
        id of their first row. Ids must increase from call to call (rejected ids are simply left out).
        Returns once the rows are queued (see the class docstring)."""
        if not self.start <= self._next_id <= first_id < self.stop:
            raise OutputError(f"{self.name}: rows for id {first_id} arrive out of order or out of range")
        count = len(next(iter(arrays.values())))
        if self._queued + count > self.rows:
            raise OutputError(f"{self.name}: more than the planned {self.rows} rows")
        offset = self._queued
        self._queued += count
        self._next_id = first_id + count
        self._submit(lambda: self._store(offset, count, arrays))

    def _store(self, offset: int, count: int, arrays: dict[str, np.ndarray]) -> None:
        """Rows ``[offset, offset + count)`` of every dataset, and their ``nonfinite`` flags (writer thread)."""
        mask = nonfinite_rows(arrays)
        for name, values in {**arrays, NONFINITE: mask}.items():
            dataset = self._dataset(name, values)
            if name in self._rows:
                self._rows[name].write(offset, values)
                continue
            if values.dtype.name == "bfloat16":  # exact: HDF5 converts float32 holding bfloat16 values
                values = values.astype(np.float32)
            dataset[offset : offset + count] = values
        self.nonfinite += int(mask.sum())
        faults.reached("shard_write", shard=self.start)

    def attach(self, group: str, arrays: dict[str, np.ndarray]) -> None:
        """Store per-shard side data (not per-sample datasets) in a group of its own."""

        def store() -> None:
            target = self._h5.require_group(group)
            for name, values in arrays.items():
                target[name] = values

        self._submit(store)

    def set_attrs(self, attrs: dict[str, Any]) -> None:
        """Set attributes of the shard (after the ones it was opened with), in order with the writes."""

        def store() -> None:
            self._h5.attrs.update(attrs)

        self._submit(store)

    def commit(self, rows: int | None = None) -> str:
        """Wait for the queued writes; close, checksum, rename into place; the shard's CRC32C (``storage.crc32c``)."""
        return self.commit_later(rows).result()

    def commit_later(self, rows: int | None = None) -> concurrent.futures.Future[str]:
        """Queue the commit (close, checksum, flush, rename) behind the queued writes and return at once:
        the future gives the CRC32C of the complete shard, or raises an ``OutputError`` naming it. Once
        the writer's thread has done it, the shard is complete on disk; nothing more may be written.
        ``rows``: the shard's rows, all written (at most, and by default, those it was opened for)."""
        self._raise_failure()
        if self._committed is not None:
            raise OutputError(f"{self.name}: already committed")
        if self._queued != (rows := self.rows if rows is None else rows):
            raise OutputError(f"{self.name}: {self._queued} rows written, {rows} planned")
        self._committed = concurrent.futures.Future()
        self._jobs.put(lambda: self._finish(rows))
        self._jobs.put(None)  # the commit is the thread's last job
        return self._committed

    def _finish(self, count: int) -> None:
        """The commit, on the writer's thread: in the file before the rename makes it count."""
        for rows in self._rows.values():
            rows.close(count)
        for dataset in self._datasets.values() if count < self.rows else ():
            dataset.resize(count, axis=0)
        self._h5.attrs.update(num_rows=count, nonfinite_count=self.nonfinite)
        self._h5.close()
        self._h5 = None
        if self._replace:
            self._retire_view()
        try:
            with self._file.explained():
                checksum = storage.crc32c(self._file.local)
            self._file.commit()
        except storage.TargetExists:
            self._checksum = self._kept_existing()
            return
        if self._remote:
            faults.reached("shard_renamed")
            with self._fence():
                storage.write_bytes(self.final_path + CRC32C_SUFFIX, checksum.encode())
        faults.reached("shard_done")
        self._checksum = checksum

    def _retire_view(self) -> None:
        """Remove ``jacobians.h5`` before this shard replaces one that holds other samples (a deleted file's
        rows taken out, others rejected): the view maps each shard's rows as they were, and its own
        per-row sources (``source_file``, ``source_row``) would name another sample's file and row for the
        new rows. Without a view the folder reads as not complete until the run's end writes it again."""
        import h5py

        if not storage.exists(self.final_path):
            return
        try:
            with storage.open_h5(self.final_path) as old, h5py.File(self._file.local, "r") as new:
                same = np.array_equal(old[SAMPLE_ID][:], new[SAMPLE_ID][:])
        except (OSError, KeyError):  # unreadable: as if it held other samples
            same = False
        if not same:
            with self._fence():
                storage.delete(storage.join(self._output_dir, VIEW))

    def _kept_existing(self) -> str:
        """A complete shard took this one's name while it was written: another attempt of this run (a
        retried bundle whose first attempt committed) wrote the same rows, and is kept; another run's
        shard is never replaced, and this one is refused."""
        theirs = read_attrs(self.final_path).get("run_key")
        if theirs != self._attrs.get("run_key"):
            raise OutputError(
                f"{self.final_path}: a complete shard of another run (run key {theirs}) appeared while this run "
                f"(run key {self._attrs.get('run_key')}) wrote it; it is kept and this run's copy discarded: "
                "two runs are writing one output folder"
            )
        return storage.crc32c(self.final_path)


class _Rows:
    """One uncompressed dataset's rows on their way into the file, in order, a whole chunk at a time
    (``write_direct_chunk``): a chunk that lies within one batch goes from the batch's buffer (the
    engine's result) into the file; only rows of a chunk that spans batches are copied, into a chunk of
    its own. h5py's slice assignment instead copies every row through HDF5's chunk cache, and writes
    each small dataset (ids, outputs, flags) once per batch: 2-4x the CPU of the copy into the file alone
    (measured when this writer replaced it: ``git log -p benchmarks/README.md``). The bytes are the
    file's: ``dtype`` is the dataset's own (bfloat16's layout is the shard's ``bfloat16`` type)."""

    def __init__(self, dataset, dtype: np.dtype):
        from h5py._objects import phil

        self._id = dataset.id
        self._hdf5_lock = phil  # see _put
        self._rows = dataset.shape[0]
        self._dtype = dtype
        self._chunk = np.zeros(dataset.chunks, np.uint16 if dtype.name == "bfloat16" else dtype)
        self._filled = 0  # rows in self._chunk
        self._next = 0  # the first row of the chunk being filled

    def write(self, offset: int, values: np.ndarray) -> None:
        if offset != self._next + self._filled:
            raise OutputError(f"rows from {offset} arrive out of order")
        if values.shape[1:] != self._chunk.shape[1:]:
            raise OutputError(f"rows of shape {values.shape[1:]} for a dataset of rows {self._chunk.shape[1:]}")
        values = np.ascontiguousarray(values, dtype=self._dtype)  # converted as h5py would, else as they are
        if self._dtype.name == "bfloat16":
            values = values.view(np.uint16)
        size, taken = len(self._chunk), 0
        if self._filled:  # complete the chunk begun by an earlier batch
            taken = min(len(values), size - self._filled)
            self._chunk[self._filled : self._filled + taken] = values[:taken]
            self._filled += taken
            if self._filled == size:
                self._put(self._chunk)
        while len(values) - taken >= size:
            self._put(values[taken : taken + size])
            taken += size
        if taken < len(values):
            self._chunk[: len(values) - taken] = values[taken:]
            self._filled = len(values) - taken

    def close(self, rows: int) -> None:
        """Write the last chunk, when the ``rows`` written end within it (the rest: zeros, outside the dataset)."""
        if self._filled:
            self._chunk[self._filled :] = 0
            self._put(self._chunk)
        if self._next < rows:
            raise OutputError(f"{self._next} of {rows} rows written")

    def _put(self, chunk: np.ndarray) -> None:
        # HDF5 takes the chunk's bytes as they are (write() made them the dataset's type and row shape):
        # only a whole chunk may go. h5py's write_direct_chunk does not take h5py's global lock as its other
        # calls do, and HDF5 is not thread-safe: without the lock, a chunk written while another thread is
        # in HDF5 (the next shard's writer, a reader of .h5 inputs) failed now and then with "Unspecified
        # error in H5Dwrite_chunk".
        with self._hdf5_lock:
            self._id.write_direct_chunk((self._next,) + (0,) * (chunk.ndim - 1), chunk)
        self._next += len(chunk)
        self._filled = 0
