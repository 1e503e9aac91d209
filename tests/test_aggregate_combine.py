"""The aggregates' ``CombineFn`` (``transforms.aggregates``): bit-identical however its inputs are split
and merged, against a fixed-tree sum written here; a shard given twice or missing is refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jacobeam.transforms.aggregates import AggregateFn, partial
from jacobeam.transforms.errors import OutputError


def _tree_sum(leaves: list[dict]) -> dict:
    """The sum along the fixed binary tree over the leaves (a complete tree over the next power of two,
    absent leaves skipped): the reference ``AggregateFn`` must match bit for bit."""
    width = 1
    while width < len(leaves):
        width *= 2

    def node(lo: int, size: int):
        if lo >= len(leaves):
            return None
        if size == 1:
            return leaves[lo]
        left, right = node(lo, size // 2), node(lo + size // 2, size // 2)
        return left if right is None else {k: left[k] + right[k] for k in left}

    return node(0, width)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 23), seed=st.integers(0, 2**16), data=st.data())
def test_aggregate_combine_is_bit_identical_however_inputs_are_split_and_merged(n, seed, data):
    rng = np.random.default_rng(seed)
    # Magnitudes over 16 decades: a different order of additions changes the last bits.
    leaves = [
        partial(rng.normal(size=(int(rng.integers(1, 4)), 2, 3)) * 10.0 ** rng.integers(-8, 8), ("mean", "mean_abs", "jtj"))
        for _ in range(n)
    ]
    fn = AggregateFn(n)
    order = data.draw(st.permutations(range(n)))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=5)))
    pieces = [order[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, n])]
    accumulators = []
    for piece in pieces:
        accumulator = fn.create_accumulator()
        for position in piece:
            accumulator = fn.add_input(accumulator, (position, leaves[position]))
        accumulators.append(accumulator)
    while len(accumulators) > 1:  # merge in a drawn order, two or more at a time
        take = data.draw(st.integers(2, len(accumulators)))
        start = data.draw(st.integers(0, len(accumulators) - take))
        merged = fn.merge_accumulators(accumulators[start : start + take])
        accumulators[start : start + take] = [merged]

    total = fn.extract_output(accumulators[0])

    expected = _tree_sum(leaves)
    assert total.keys() == expected.keys() == {"count", "sum", "sum_abs", "jtj"}
    for name in expected:
        assert np.array_equal(total[name], expected[name]), name  # bit for bit
    assert int(total["count"]) == sum(int(leaf["count"]) for leaf in leaves)


def test_aggregate_combine_refuses_a_shard_twice_and_says_which_is_missing():
    leaf = partial(np.ones((1, 2, 2)), ("mean",))
    fn = AggregateFn(3)
    with pytest.raises(OutputError, match="shard partial 1 at level 0 arrived twice"):
        fn.merge_accumulators([fn.add_input({}, (1, leaf)), fn.add_input({}, (1, leaf))])
    with pytest.raises(OutputError, match="no partial sums for shard 1"):
        fn.extract_output(fn.add_input(fn.add_input({}, (0, leaf)), (2, leaf)))
    assert fn.extract_output(fn.create_accumulator()) is None
