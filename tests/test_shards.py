"""The shard writer: rows written on its background thread, failures surfacing in the caller, and
nothing half-written left behind."""

import dataclasses
import json
import os
import sys
import threading
import time

import google_crc32c
import h5py
import ml_dtypes
import numpy as np
import pytest

from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.finalize import check_shards, remove_temp_files
from jacobeam.transforms.output import layout, shard_writer, storage
from jacobeam.transforms.output.shard_writer import ShardWriter
from jacobeam.transforms.output.shards import ShardRecord
from jacobeam.transforms.spec import ModelSource
from jacobeam.transforms.testing import faults
from jacobeam.transforms.write_shards import pipeline_spec


def _batches(rng, rows=40, batch=16):
    """Per batch: first id and the arrays the compute step hands the writer; one row holds a NaN."""
    jacobian = rng.normal(size=(rows, 3, 5)).astype(np.float32)
    jacobian[21, 1, 2] = np.nan
    output = rng.normal(size=(rows, 3)).astype(np.float32)
    return (
        [
            (
                lo,
                {
                    "jacobian": jacobian[lo : lo + batch],
                    "output": output[lo : lo + batch],
                    "sample_id": np.arange(lo, min(lo + batch, rows)),
                },
            )
            for lo in range(0, rows, batch)
        ],
        jacobian,
        output,
    )


def _crc32c(path):
    """The reference: CRC32C of the whole file at once (the writer's reads it in pieces)."""
    with open(path, "rb") as stream:
        return f"{google_crc32c.value(stream.read()):08x}"


def _leftovers(folder):
    shards = folder / "shards"
    return sorted(p.name for p in shards.iterdir()) if shards.exists() else []


def test_a_committed_shard_holds_every_row_in_order_and_its_checksum(tmp_path, rng):
    batches, jacobian, output = _batches(rng)
    with ShardWriter(str(tmp_path), 0, 40, {"run_key": "k"}) as writer:
        for first, arrays in batches:
            writer.write(first, arrays)
        writer.attach("partial", {"sum": np.ones(3)})
        checksum = writer.commit()

    assert _leftovers(tmp_path) == ["shard-000000000000-000000000040.h5"]
    assert checksum == _crc32c(writer.final_path)
    assert writer.nonfinite == 1
    with h5py.File(writer.final_path) as shard:
        np.testing.assert_array_equal(shard["jacobian"][:], jacobian)
        np.testing.assert_array_equal(shard["output"][:], output)
        np.testing.assert_array_equal(shard["sample_id"][:], np.arange(40))
        np.testing.assert_array_equal(shard["nonfinite"][:], np.arange(40) == 21)
        np.testing.assert_array_equal(shard["partial/sum"][:], np.ones(3))
        assert (shard.attrs["num_rows"], shard.attrs["nonfinite_count"], shard.attrs["run_key"]) == (40, 1, "k")


def test_a_write_that_fails_in_the_background_is_raised_by_the_next_call_naming_the_shard(tmp_path, rng):
    batches, _, _ = _batches(rng)
    bad = {name: values[:, :2] if name == "jacobian" else values for name, values in batches[1][1].items()}
    with pytest.raises(OutputError, match=r"shard-000000000000-000000000040\.h5: writing the shard failed") as caught:
        with ShardWriter(str(tmp_path), 0, 40, {}) as writer:
            writer.write(*batches[0])
            writer.write(batches[1][0], bad)  # another shape than the dataset's: h5py refuses it
            writer.write(*batches[2])
            writer.commit()
    assert caught.value.__cause__ is not None  # h5py's own error, chained
    assert _leftovers(tmp_path) == []  # no half shard, no temporary file


def test_an_injected_failure_mid_shard_leaves_nothing(tmp_path, rng, monkeypatch):
    monkeypatch.setenv(faults.FAIL_SHARD_ONCE, "0")
    monkeypatch.setenv(faults.FAIL_MARKER, str(tmp_path / "marker"))
    batches, _, _ = _batches(rng)
    with pytest.raises(OutputError, match=r"shard-000000000000-000000000040\.h5: .*injected transient failure"):
        with ShardWriter(str(tmp_path / "out"), 0, 40, {}) as writer:
            for first, arrays in batches:
                writer.write(first, arrays)
            writer.commit()
    assert isinstance(writer._failure, faults.TransientFailure)
    assert _leftovers(tmp_path / "out") == []


def test_a_caller_that_fails_mid_shard_stops_the_writer_and_leaves_nothing(tmp_path, rng):
    batches, _, _ = _batches(rng)
    with pytest.raises(RuntimeError, match="engine failed"):
        with ShardWriter(str(tmp_path), 0, 40, {}) as writer:
            writer.write(*batches[0])
            raise RuntimeError("engine failed")
    assert _leftovers(tmp_path) == []
    assert not any(t.name.startswith("write shard-") for t in threading.enumerate()), [
        t.name for t in threading.enumerate()
    ]


def test_commit_refuses_a_shard_with_missing_rows(tmp_path, rng):
    batches, _, _ = _batches(rng)
    with pytest.raises(OutputError, match=r"16 rows written, 40 planned"):
        with ShardWriter(str(tmp_path), 0, 40, {}) as writer:
            writer.write(*batches[0])
            writer.commit()
    assert _leftovers(tmp_path) == []


def test_the_caller_waits_when_the_queue_is_full(tmp_path, rng, monkeypatch):
    """At most ``pending`` batches wait for the writer thread: memory stays bounded when the disk is slow."""
    batches, _, _ = _batches(rng, rows=64, batch=16)
    release = threading.Event()
    store = ShardWriter._store
    monkeypatch.setattr(ShardWriter, "_store", lambda self, *args: (release.wait(), store(self, *args)))
    with ShardWriter(str(tmp_path), 0, 64, {}, pending=1) as writer:
        try:
            writer.write(*batches[0])  # taken by the thread, which then waits
            deadline = time.monotonic() + 5
            while writer._jobs.qsize() and time.monotonic() < deadline:
                time.sleep(0.01)
            writer.write(*batches[1])  # queued: the queue is full now
            third = threading.Thread(target=writer.write, args=batches[2])
            third.start()
            third.join(0.3)
            assert third.is_alive()  # waits for room
        finally:
            release.set()
        third.join()
        writer.write(*batches[3])
        writer.commit()
    with h5py.File(writer.final_path) as shard:
        np.testing.assert_array_equal(shard["sample_id"][:], np.arange(64))


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread scheduling policies are a Linux feature")
def test_the_writer_thread_is_scheduled_as_a_batch_thread(tmp_path, rng, monkeypatch):
    """So that on busy cores it does not preempt the engine's threads mid-operation."""
    batches, _, _ = _batches(rng, rows=32, batch=16)
    seen = []
    store = ShardWriter._store
    monkeypatch.setattr(
        ShardWriter,
        "_store",
        lambda self, *args: (seen.append(os.sched_getscheduler(threading.get_native_id())), store(self, *args)),
    )
    with ShardWriter(str(tmp_path), 0, 32, {}) as writer:
        for first, arrays in batches:
            writer.write(first, arrays)
        writer.commit()
    assert seen == [os.SCHED_BATCH, os.SCHED_BATCH]
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER  # the caller's is unchanged


def test_a_later_commit_returns_at_once_and_its_future_gives_the_checksum(tmp_path, rng, monkeypatch):
    """``commit_later`` queues the commit behind the writes: the caller goes on while the shard is
    checksummed, flushed and renamed; the shard exists under its name only once the future is done."""
    batches, jacobian, _ = _batches(rng)
    release = threading.Event()
    finish = ShardWriter._finish
    monkeypatch.setattr(ShardWriter, "_finish", lambda self, rows: (release.wait(), finish(self, rows)))
    with ShardWriter(str(tmp_path), 0, 40, {}) as writer:
        for first, arrays in batches:
            writer.write(first, arrays)
        future = writer.commit_later()
        assert not future.done() and not os.path.exists(writer.final_path)
        with pytest.raises(OutputError, match="already committed"):
            writer.attach("late", {"sum": np.ones(3)})
        release.set()
        checksum = future.result(timeout=30)
    assert checksum == _crc32c(writer.final_path)
    assert _leftovers(tmp_path) == ["shard-000000000000-000000000040.h5"]
    with h5py.File(writer.final_path) as shard:
        np.testing.assert_array_equal(shard["jacobian"][:], jacobian)


def test_a_later_commit_that_fails_gives_its_error_through_the_future_and_leaves_nothing(tmp_path, rng, monkeypatch):
    batches, _, _ = _batches(rng)

    def no_disk(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("jacobeam.transforms.output.storage.durable", no_disk)
    with ShardWriter(str(tmp_path), 0, 40, {}) as writer:
        for first, arrays in batches:
            writer.write(first, arrays)
        future = writer.commit_later()
        with pytest.raises(
            OutputError, match=r"shard-000000000000-000000000040\.h5: writing the shard failed: .*No space left"
        ):
            future.result(timeout=30)
    assert _leftovers(tmp_path) == []


def test_crc32c_is_the_castagnoli_checksum_of_the_files_bytes(tmp_path):
    """RFC 3720's check value for "123456789", a file longer than one read, and an empty file."""
    (tmp_path / "digits").write_bytes(b"123456789")
    assert storage.crc32c(tmp_path / "digits") == "e3069283"
    (tmp_path / "long").write_bytes(data := np.random.default_rng(0).bytes(3 * storage._CRC_READ_BYTES + 5))
    assert storage.crc32c(tmp_path / "long") == f"{google_crc32c.value(data):08x}"
    (tmp_path / "empty").write_bytes(b"")
    assert storage.crc32c(tmp_path / "empty") == "00000000"


@pytest.mark.parametrize("compression", ["none", "gzip"])
@pytest.mark.parametrize("sizes", [(8, 8, 8, 8, 8, 2), (5, 11, 3, 16, 5, 2), (42,)])
def test_rows_across_chunks_and_batches_are_stored_exactly(tmp_path, rng, monkeypatch, sizes, compression):
    """Chunks of 4 jacobian rows (6 would fit: a power of two is taken, without compression) against
    batches of 8, of uneven sizes, or one batch; a last chunk that ends past the last row; bfloat16; a
    dataset that is one chunk. Every row reads back as written."""
    monkeypatch.setattr(shard_writer, "_CHUNK_BYTES", 6 * 60)  # 6 rows of the jacobian's 60 bytes
    rows = sum(sizes)
    jacobian = rng.normal(size=(rows, 3, 5)).astype(np.float32)
    jacobian[9, 0, 0] = np.inf
    saliency = rng.normal(size=(rows, 7)).astype(ml_dtypes.bfloat16)
    with ShardWriter(str(tmp_path), 100, 100 + rows, {}, compression=compression) as writer:
        first = 0
        for size in sizes:
            part = slice(first, first + size)
            writer.write(100 + first, {"jacobian": jacobian[part], "saliency": saliency[part],
                                       "sample_id": np.arange(100 + first, 100 + first + size)})
            first += size
        checksum = writer.commit()
    assert checksum == _crc32c(writer.final_path)
    with h5py.File(writer.final_path) as shard:
        assert shard["jacobian"].chunks == ((4 if compression == "none" else 6), 3, 5)
        assert shard["sample_id"].chunks == (rows,)
        np.testing.assert_array_equal(shard["jacobian"][:], jacobian)
        np.testing.assert_array_equal(shard["saliency"][:], saliency.astype(np.float32))
        np.testing.assert_array_equal(shard["sample_id"][:], np.arange(100, 100 + rows))
        np.testing.assert_array_equal(shard["nonfinite"][:], np.arange(rows) == 9)


def test_rows_of_another_shape_or_type_than_the_first_batch(tmp_path, rng):
    """A later batch of another row shape fails (never a chunk of wrong bytes); one of another float type
    is converted to the dataset's, as h5py converts."""
    jacobian = rng.normal(size=(8, 3, 5))
    with ShardWriter(str(tmp_path), 0, 8, {}) as writer:
        writer.write(0, {"jacobian": jacobian[:4].astype(np.float32)})
        writer.write(4, {"jacobian": jacobian[4:]})  # float64
        writer.commit()
    with h5py.File(writer.final_path) as shard:
        np.testing.assert_array_equal(shard["jacobian"][:], jacobian.astype(np.float32))
    with ShardWriter(str(tmp_path), 8, 16, {}) as writer:
        writer.write(8, {"jacobian": jacobian[:4].astype(np.float32)})
        writer.write(12, {"jacobian": jacobian[4:, :1].astype(np.float32)})
        with pytest.raises(OutputError, match=r"shard-000000000008-000000000016.h5: writing the shard failed: rows of "
                                              r"shape \(1, 5\) for a dataset of rows \(3, 5\)"):
            writer.commit()
    assert _leftovers(tmp_path) == ["shard-000000000000-000000000008.h5"]



def test_chunks_written_while_other_threads_use_hdf5_are_complete(tmp_path):
    """HDF5 is not thread-safe, and h5py's write_direct_chunk does not take h5py's global lock as its
    other calls do: unless the shard's rows take it, a chunk written while another thread is in HDF5 fails
    now and then with "Unspecified error in H5Dwrite_chunk" (seen in a 20,000-sample two-process run; this
    test, without the lock, had 1-2 such errors in each of 3 runs)."""
    errors: list[BaseException] = []

    def chunks(k: int) -> None:
        try:
            for r in range(30):
                with h5py.File(tmp_path / f"rows-{k}-{r}.h5", "w") as h5:
                    dataset = h5.create_dataset("x", (64 * 32, 256), "f4", chunks=(32, 256))
                    rows = shard_writer._Rows(dataset, np.dtype("f4"))
                    for i in range(64):
                        rows.write(i * 32, np.full((32, 256), i, "f4"))
                    rows.close(64 * 32)
        except BaseException as err:  # noqa: B036 - reported by the assertion below
            errors.append(err)

    def other(k: int) -> None:
        try:
            for r in range(30):
                with h5py.File(tmp_path / f"other-{k}-{r}.h5", "w") as h5:
                    for i in range(20):
                        h5.create_dataset(f"y{i}", data=np.zeros((100, 100)))
                        h5.attrs[f"a{i}"] = i
        except BaseException as err:  # noqa: B036
            errors.append(err)

    threads = [threading.Thread(target=f, args=(k,)) for f in (chunks, other) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    with h5py.File(tmp_path / "rows-1-29.h5") as h5:
        np.testing.assert_array_equal(h5["x"][::32, 0], np.arange(64, dtype="f4"))


def _commit(folder, run_key, rng, run_id=""):
    with ShardWriter(str(folder), 0, 40, {"run_key": run_key}, run_id=run_id) as writer:
        for first, arrays in _batches(rng)[0]:
            writer.write(first, arrays)
        return writer.commit(), writer.final_path


def test_a_commit_never_replaces_a_complete_shard_of_another_run(tmp_path, rng):
    checksum, path = _commit(tmp_path, "first", rng)
    with pytest.raises(OutputError, match=r"a complete shard of another run \(run key first\) appeared while this "
                                          r"run \(run key second\) wrote it; it is kept"):
        _commit(tmp_path, "second", rng)
    assert _crc32c(path) == checksum and h5py.File(path).attrs["run_key"] == "first"
    assert _leftovers(tmp_path) == ["shard-000000000000-000000000040.h5"]  # the refused copy is gone


def test_a_retried_attempt_of_the_same_run_keeps_the_shard_its_first_attempt_committed(tmp_path, rng):
    checksum, path = _commit(tmp_path, "k", rng)
    # The retry computes other bytes (here other values; in Beam, another worker's threads): the first stays.
    again, _ = _commit(tmp_path, "k", np.random.default_rng(99))
    assert again == checksum == _crc32c(path)
    assert _leftovers(tmp_path) == ["shard-000000000000-000000000040.h5"]


def test_a_shards_temporary_name_carries_its_runs_id(tmp_path, rng):
    with ShardWriter(str(tmp_path), 0, 40, {"run_key": "k"}, run_id="a1b2c3") as writer:
        (temp,) = _leftovers(tmp_path)
        assert temp.startswith(".shard-000000000000-000000000040.h5.tmp-a1b2c3-")
        assert layout.is_shard_temp(temp) and layout.temp_run(temp) == "a1b2c3"
        for first, arrays in _batches(rng)[0]:
            writer.write(first, arrays)
        writer.commit()
    assert _leftovers(tmp_path) == ["shard-000000000000-000000000040.h5"]


def test_a_run_removes_its_own_temporary_files_at_its_end_and_every_runs_at_its_start(tmp_path):
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    names = {
        "ours": layout.temp_name(layout.shard_name(0, 8), "0f0f", "aaaa"),
        "theirs": layout.temp_name(layout.shard_name(8, 16), "0e0e", "bbbb"),
        "before run ids": layout.temp_name(layout.shard_name(16, 24), "0d0d"),
    }
    for name in names.values():
        (shards_dir / name).write_bytes(b"partial")
    (tmp_path / layout.temp_name(layout.MANIFEST, "0c0c", "aaaa")).write_text("{")

    remove_temp_files(str(tmp_path), "aaaa")  # the other run's and the one without an id stay
    assert sorted(p.name for p in shards_dir.iterdir()) == sorted([names["theirs"], names["before run ids"]])
    assert [p.name for p in tmp_path.iterdir()] == ["shards"]
    remove_temp_files(str(tmp_path))  # at a run's start, holding the lease: every run's
    assert list(shards_dir.iterdir()) == []


def test_finalize_refuses_a_shard_replaced_or_changed_after_its_commit(tmp_path, rng):
    spec = pipeline_spec(str(tmp_path), ModelSource(factory="tests.models:small_mlp"), (5,), samples_per_shard=40)
    checksum, path = _commit(tmp_path, spec.run_key, rng)
    record = ShardRecord(file="shards/" + os.path.basename(path), start=0, stop=40, sha256=None,
                         model_fingerprint="", computed=True, crc32c=checksum)
    check_shards([record], spec)  # as committed

    with h5py.File(path, "r+") as h5:
        h5.attrs["run_key"] = "another"
    with pytest.raises(OutputError, match="replaced by another run's shard \\(run key another"):
        check_shards([record], spec)
    with h5py.File(path, "r+") as h5:
        h5.attrs["run_key"] = spec.run_key
        h5["jacobian"][0, 0, 0] += 1
    with pytest.raises(OutputError, match=r"its bytes changed after this run committed it \(crc32c [0-9a-f]{8}, committed "
                                          + checksum):
        check_shards([record], spec)


def test_finalize_names_shards_computed_with_other_library_versions_than_its_own(tmp_path, rng):
    from jacobeam.transforms import model_identity

    spec = pipeline_spec(str(tmp_path), ModelSource(factory="tests.models:small_mlp"), (5,), samples_per_shard=40)
    other = {**model_identity.library_versions(), "tensorflow": "2.0.0"}  # a worker image of its own
    with ShardWriter(str(tmp_path), 0, 40, {"run_key": spec.run_key, model_identity.VERSIONS_ATTR: json.dumps(other)}) as writer:
        for first, arrays in _batches(rng)[0]:
            writer.write(first, arrays)
        checksum = writer.commit()
    record = ShardRecord(file="shards/shard-000000000000-000000000040.h5", start=0, stop=40, sha256=None,
                         model_fingerprint="", computed=True, crc32c=checksum)
    ours = model_identity.library_versions()["tensorflow"]
    assert check_shards([record], spec) == [
        f"shards/shard-000000000000-000000000040.h5: tensorflow 2.0.0 there, {ours} now"
    ]
    assert check_shards([dataclasses.replace(record, computed=False)], spec) == []  # kept: judged by the plan
