"""Reading ahead in Python (``transforms.read``): files read in Python come in whole batches across file
boundaries, from a thread that hands errors on and stops when its consumer does."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jacobeam.transforms import read
from jacobeam.transforms.read import _ahead

FEATURES = 12  # tests.models:small_mlp's input


def _readers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "jacobeam-read"]


def test_items_come_in_order_and_an_error_after_the_items_before_it():
    def items():
        yield from range(5)
        raise OSError("disk gone")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item in _ahead(items()):
            got.append(item)
    assert got == [0, 1, 2, 3, 4]
    assert not _readers()


def test_a_consumer_that_stops_stops_the_thread_and_closes_the_items():
    closed = threading.Event()

    def items():
        try:
            yield from range(1000)
        finally:
            closed.set()

    ahead = _ahead(items())
    assert [next(ahead) for _ in range(3)] == [0, 1, 2]
    ahead.close()
    assert closed.is_set() and not _readers()


def _spec(tmp_path, sizes, batch_size, samples_per_shard):
    from jacobeam.pipeline import config, plan

    cfg = config.validate(
        {
            "model": {"factory": "tests.models:small_mlp"},
            "input": {"paths": [str(tmp_path / "data" / "*.npz")]},
            "jacobian": {"batch_size": batch_size},
            "output": {"path": str(tmp_path / "out"), "samples_per_shard": samples_per_shard},
        }
    )
    return plan.make_job(cfg, check_model=False).spec


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    batch_size=st.integers(1, 33),
    samples_per_shard=st.integers(1, 90),
    seed=st.integers(0, 2**16),
)
def test_files_read_in_python_come_in_whole_batches_with_their_values(tmp_path_factory, sizes, batch_size,
                                                                      samples_per_shard, seed):
    """``.npz`` files of any sizes (read in Python): each range's batches are whole but for its last, its
    ids are the range's and its values those written."""
    tmp_path = tmp_path_factory.mktemp("ahead")
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(seed)
    parts = [rng.normal(size=(size, FEATURES)).astype(np.float32) for size in sizes]
    for i, part in enumerate(parts):
        np.savez(tmp_path / "data" / f"p{i:03d}.npz", x=part)
    rows = np.concatenate(parts)
    spec = _spec(tmp_path, sizes, batch_size, samples_per_shard)
    for shard in spec.ranges():
        batches = list(read.shard_batches(spec, shard))
        whole, rest = divmod(shard.stop - shard.start, batch_size)
        assert [len(b.ids) for b in batches] == [batch_size] * whole + ([rest] if rest else [])
        np.testing.assert_array_equal(np.concatenate([b.ids for b in batches]), np.arange(shard.start, shard.stop))
        np.testing.assert_array_equal(np.concatenate([b.inputs for b in batches]), rows[shard.start : shard.stop])
        assert all(len(b.labels) == len(b.ids) for b in batches)


def test_a_consumer_that_stops_mid_range_leaves_no_reading_thread(tmp_path, rng):
    (tmp_path / "data").mkdir()
    for i in range(20):
        np.savez(tmp_path / "data" / f"p{i:03d}.npz", x=rng.normal(size=(10, FEATURES)).astype(np.float32))
    spec = _spec(tmp_path, None, batch_size=4, samples_per_shard=200)
    (shard,) = spec.ranges()
    batches = read.shard_batches(spec, shard)
    first = next(batches)
    assert len(first.ids) == 4 and _readers()
    batches.close()
    assert not _readers()
