"""Block sizing against the memory budget: arithmetic, tested without TensorFlow."""

from jacobeam.transforms.engine.budget import Sizes, Workload, size_blocks, smaller


def _work(**overrides):
    work = dict(batch_size=256, budget=2 * 2**30, itemsize=4, outputs=10, activations=1000,
                sizes={0: 784}, extents={0: 10}, forward=False, names=("x",))
    work.update(overrides)
    return Workload(**work)


def test_everything_fits_in_a_large_budget():
    sizes = size_blocks(_work())
    assert (sizes.batch, sizes.rows, sizes.notes) == (256, ((0, 10),), ())


def test_the_batch_shrinks_until_its_results_fit_in_half_the_budget():
    # One sample's Jacobian: 10 x 784 x 4 = 31,360 bytes; half of 100,000 bytes holds 1 of them.
    sizes = size_blocks(_work(budget=100_000))
    assert sizes.batch == 1
    # Then blocks: (100,000 - 31,360) // ((1000 + 784) * 4) = 9 rows of 10.
    assert sizes.rows == ((0, 9),)
    assert sizes.notes == ("batch 256 -> 1: one sample's Jacobian is 31,360 bytes", "x: blocks of 9 of 10 outputs")


def test_the_batch_shrinks_until_one_row_of_a_large_forward_pass_fits_beside_its_results():
    # ResNet50 label saliency: 1 row of 150,528 input entries, ~58.3 M activation elements per sample.
    work = _work(outputs=1000, activations=58_297_484, sizes={0: 150_528}, extents={0: 1})
    result, one_row = 150_528 * 4, (58_297_484 + 150_528) * 4
    sizes = size_blocks(work)
    assert sizes.batch == 2 * 2**30 // (result + one_row) == 9 and sizes.rows == ((0, 1),)
    assert sizes.notes == (f"batch 256 -> 9: one sample's forward pass and result are {result + one_row:,} bytes",)
    # The working set of the block (results, and one row's forward pass per sample) is within the budget.
    assert sizes.batch * (result + one_row) <= work.budget


def test_forward_blocks_count_columns_and_keep_the_outputs():
    sizes = size_blocks(_work(forward=True, extents={0: 784}, budget=50_000_000, batch_size=64))
    # Results per sample: 784 columns x 10 outputs x 4 bytes; per column: (1000 + 784 + 10) x 4 x 64.
    per_column = (1000 + 784 + 10) * 4 * 64
    assert sizes.batch == 64 and sizes.rows == ((0, min(784, (50_000_000 - 64 * 31_360) // per_column)),)


def test_never_below_one_sample_and_one_row():
    sizes = size_blocks(_work(budget=1))
    assert (sizes.batch, sizes.rows) == (1, ((0, 1),))


def test_smaller_halves_rows_first_then_samples_and_ends_at_one_and_one():
    steps, sizes = [], Sizes(8, ((0, 5), (1, 1)))
    while sizes is not None:
        steps.append((sizes.batch, sizes.rows))
        sizes = smaller(sizes)
    assert steps == [(8, ((0, 5), (1, 1))), (8, ((0, 2), (1, 1))), (8, ((0, 1), (1, 1))),
                     (4, ((0, 1), (1, 1))), (2, ((0, 1), (1, 1))), (1, ((0, 1), (1, 1)))]
