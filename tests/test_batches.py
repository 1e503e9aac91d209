"""Feeding the engine: rebatching row slices and reading ahead on a background thread."""

import threading

import numpy as np
import pytest

from transforms.batches import prefetch, rebatch


def _slices(sizes, rng):
    """Row slices (ids, samples) of the given lengths, consecutive ids."""
    found, start = [], 0
    for size in sizes:
        found.append((np.arange(start, start + size), rng.normal(size=(size, 3)).astype(np.float32)))
        start += size
    return found


@pytest.mark.parametrize("sizes", [[4, 4, 4], [3, 5, 2, 7], [1] * 9, [10], [4, 4, 1]])
def test_rebatch_gives_full_batches_of_the_same_rows_in_order(sizes, rng):
    slices = _slices(sizes, rng)

    batches = list(rebatch(iter(slices), 4))

    total = sum(sizes)
    assert [len(ids) for ids, _ in batches] == [4] * (total // 4) + ([total % 4] if total % 4 else [])
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in batches]), np.arange(total))
    np.testing.assert_array_equal(np.concatenate([x for _, x in batches]), np.concatenate([x for _, x in slices]))


def test_rebatch_passes_a_full_aligned_slice_on_without_copying(rng):
    slices = _slices([4, 4], rng)
    batches = list(rebatch(iter(slices), 4))
    assert all(batch[1] is piece[1] or np.shares_memory(batch[1], piece[1]) for batch, piece in zip(batches, slices))


def test_prefetch_yields_every_item_in_order():
    assert list(prefetch(iter(range(100)), depth=3)) == list(range(100))


def test_prefetch_raises_the_producers_exception_as_itself_where_it_happened():
    class Broken(Exception):
        pass

    def items():
        yield 1
        yield 2
        raise Broken("file changed")

    found = []
    with pytest.raises(Broken, match="file changed"):
        for item in prefetch(items()):
            found.append(item)
    assert found == [1, 2]


def test_prefetch_stops_the_producer_and_closes_its_source_when_the_consumer_stops():
    produced, closed = [], threading.Event()

    def items():
        try:
            for i in range(1000):
                produced.append(i)
                yield i
        finally:
            closed.set()

    batches = prefetch(items(), depth=2)
    assert next(batches) == 0
    batches.close()  # as `contextlib.closing` does when the consumer fails

    assert closed.is_set()
    assert not any(t.name == "prefetch" and t.is_alive() for t in threading.enumerate())
    assert len(produced) <= 5  # the one taken, the two queued, and at most the one in flight and one more


def test_rebatch_regroups_the_samples_of_several_model_inputs(rng):
    slices = [
        (np.arange(lo, lo + n), {"image": rng.normal(size=(n, 2, 2)), "meta": rng.normal(size=(n, 3))})
        for lo, n in ((0, 3), (3, 3), (6, 2))
    ]

    batches = list(rebatch(iter(slices), 4))

    assert [len(ids) for ids, _ in batches] == [4, 4]
    for name in ("image", "meta"):
        np.testing.assert_array_equal(
            np.concatenate([inputs[name] for _, inputs in batches]), np.concatenate([s[1][name] for s in slices])
        )
