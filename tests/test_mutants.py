"""The checkers tested by mutation: every engine fault of ``tests.mutants``, applied to every sample, on
every kind of input, for every kind of output, is a mismatch of the self-check's rule (which ``jacobeam
verify`` applies too) in each of the 4 samples a default shard checks, so a small shard's one check
catches it too; the same values unmutated pass.

The counts of this matrix are in docs/verifying.md ("How the checks are tested").
"""

from __future__ import annotations

import numpy as np
import pytest

from jacobeam.transforms import self_check
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.spec import SelfCheck, ShardRange
from tests import mutants

CHECKED = SelfCheck().samples  # the default: 4 samples per shard of the default size


def _verdicts(engine, batch, stored) -> list[dict]:
    """The records of the samples a default shard checks, checked together as a run's worker does."""
    checker = self_check.SelfChecker(engine, SelfCheck())
    chosen = self_check.drawn(ShardRange(0, len(batch.x)), CHECKED)  # as many as a default shard checks
    label = lambda i: int(batch.labels[i]) if batch.options.outputs.rule == "label" else None  # noqa: E731
    return checker.check_all([([batch.x[i : i + 1]], {k: v[i : i + 1] for k, v in stored.items()}, int(i), label(i))
                              for i in chosen])


@pytest.mark.slow
@pytest.mark.parametrize("output", list(mutants.OUTPUTS))
@pytest.mark.parametrize("case", mutants.CASES)
def test_every_mutant_is_a_mismatch_and_the_unmutated_values_pass(case, output):
    engine, batch, stored = mutants.batch(case, output)
    clean = _verdicts(engine, batch, stored)
    assert all(record["verdict"] != "mismatch" for record in clean), clean
    missed = []
    for name, mutant in mutants.MUTANTS.items():
        wrong = mutant(dict(stored), batch)
        if wrong is None:  # the fault does not apply to this output (no reduction to get wrong)
            continue
        records = _verdicts(engine, batch, wrong)
        # Each check alone catches it: a shard of fewer than 1,024 ids checks one sample.
        if not all(record["verdict"] == "mismatch" for record in records):
            missed.append((name, [(r["verdict"], r["dataset"], r["max_rel_error"], r["bound"]) for r in records]))
    assert not missed, missed


@pytest.mark.slow
@pytest.mark.parametrize("output", list(mutants.OUTPUTS))
def test_a_mutant_in_one_of_the_samples_checked_together_is_that_samples_mismatch_alone(output):
    """Samples checked together share each reference's call, not their verdicts: each mutant applied to one
    of the checked samples only (flat images) is a mismatch of that sample, and the others pass, with the
    records they have when checked alone but for float32's noise (measured in one pass over the group)."""
    engine, batch, stored = mutants.batch("flat_images", output)
    chosen = [int(i) for i in self_check.drawn(ShardRange(0, len(batch.x)), CHECKED)]
    checker = self_check.SelfChecker(engine, SelfCheck())
    label = lambda i: int(batch.labels[i]) if output == "label" else None  # noqa: E731
    alone = [checker.check([batch.x[i : i + 1]], {k: v[i : i + 1] for k, v in stored.items()}, i, label(i)) for i in chosen]
    assert all(record["verdict"] != "mismatch" for record in alone), alone
    leave = ("timing", "noise", "bound")
    missed = []
    for name, mutant in mutants.MUTANTS.items():
        wrong = mutant(dict(stored), batch)
        if wrong is None:
            continue
        for position, faulty in enumerate(chosen):
            mixed = {k: np.array(v) for k, v in stored.items()}
            for k in mixed:
                mixed[k][faulty] = wrong[k][faulty]
            records = _verdicts(engine, batch, mixed)
            verdicts = [record["verdict"] == "mismatch" for record in records]
            if verdicts != [i == position for i in range(len(chosen))]:
                missed.append((name, faulty, [record["verdict"] for record in records]))
            for i, (record, own) in enumerate(zip(records, alone)):
                if i != position:
                    assert {k: v for k, v in record.items() if k not in leave} == {
                        k: v for k, v in own.items() if k not in leave}, (name, faulty)
    assert not missed, missed


def test_the_readme_images_scaled_are_a_mismatch_not_a_kink():
    """The README's bars: flat regions, ReLUs exactly at 0 and max-pooling ties. The derivatives at points
    a rounding unit away differ by about 5x the Jacobian's largest entry; a value is judged against the
    nearest of them, within float32's noise at the sample, never within their spread."""
    engine, batch, stored = mutants.batch("flat_images", "all")
    for factor in (1.5, -1.0, 0.0):
        records = _verdicts(engine, batch, {**stored, "jacobian": factor * stored["jacobian"]})
        assert [record["verdict"] for record in records] == ["mismatch"] * CHECKED, records
        assert all(record["nearest"] > 1 for record in records)
    assert all(record["verdict"] == "ok" for record in _verdicts(engine, batch, stored))


def test_a_small_row_negated_is_judged_at_its_own_scale():
    """A peaked softmax: most rows are 100x smaller than the largest. Negating them, or one of them, is a
    mismatch named by its dataset, though its error relative to the largest entry is tiny."""
    engine, batch, stored = mutants.batch("peaked_softmax", "all")
    rows = stored["jacobian"].reshape(8, 10, 12)
    size = np.abs(rows).max(axis=2)
    sample = int(np.argmax(size.max(axis=1) / np.sort(size, axis=1)[:, 1]))  # the most peaked
    smallest = int(np.argmin(size[sample]))
    assert size[sample, smallest] < size[sample].max() / 100
    wrong = rows.copy()
    wrong[sample, smallest] *= -1
    checker = self_check.SelfChecker(engine, SelfCheck())
    one = lambda values: {k: v[sample : sample + 1] for k, v in values.items()}  # noqa: E731
    assert checker.check([batch.x[sample : sample + 1]], one(stored), sample)["verdict"] == "ok"
    negated = {**stored, "jacobian": wrong.reshape(stored["jacobian"].shape)}
    record = checker.check([batch.x[sample : sample + 1]], one(negated), sample)
    assert record["verdict"] == "mismatch" and record["dataset"] == "jacobian", record


def test_rows_are_chosen_again_by_the_check():
    """The label is the one read from the input, argmax and top_k come from the truth's own outputs: a
    stored output_index that differs is a mismatch even when the stored rows are that index's rows."""
    for output in ("label", "top_k"):
        engine, batch, stored = mutants.batch("gaussian", output)
        shifted = (stored["output_index"] + 1) % 10
        rows = np.take_along_axis(batch.full, shifted[:, :, None], axis=1)
        wrong = {**stored, "output_index": shifted, "jacobian": rows.reshape(stored["jacobian"].shape).astype(np.float32)}
        records = _verdicts(engine, batch, wrong)
        assert [r["dataset"] for r in records] == ["output_index"] * CHECKED, records
        assert all(r["verdict"] == "mismatch" and "the reference chooses" in r["detail"] for r in records)


def test_a_row_float32_cannot_compute_bounds_no_value_by_its_noise():
    """A softmax so confident that ``1 - p`` of one sample's largest probability is 1.2e-8: float32 rounds it
    away, and its own per-sample gradient of that row is 75% off the float64 truth. The noise widens the bound
    only up to ``MAX_BOUND``: the stored float32 values fail, saying why, and so do zeros and the row negated
    (within 3x the row's scale, which a bound of 4x the noise passed)."""
    _, batch, _ = mutants.batch("confident_softmax", "all")  # its inputs
    model = mutants.confident_softmax(factor=3.0)
    engine = JacobianEngine(wrap_model(model, "confident"), (12,), mutants.OUTPUTS["all"])
    stored = engine(batch.x)
    checker = self_check.SelfChecker(engine, SelfCheck())
    one = lambda values: {k: v[6:7] for k, v in values.items()}  # noqa: E731 - 1 - p = 1.2e-8
    record = checker.check([batch.x[6:7]], one(stored), 6)
    assert record["verdict"] == "mismatch" and record["bound"] == self_check.MAX_BOUND, record
    assert record["noise"]["jacobian"] * self_check.NOISE_FACTOR > self_check.MAX_BOUND
    assert "the compute dtype cannot compute this value (compute_dtype: float64, or model.logits: true for a softmax's" \
           in self_check.mismatch_text(record)
    for factor in (0.0, -1.0):
        assert checker.check([batch.x[6:7]], one({**stored, "jacobian": factor * stored["jacobian"]}), 6)["verdict"] == "mismatch"
    assert checker.check([batch.x[3:4]], {k: v[3:4] for k, v in stored.items()}, 3)["verdict"] == "ok"  # resolved
