"""The checkers tested by mutation: every engine fault of ``tests.mutants``, applied to every sample, on
every kind of input, for every kind of output, is a mismatch of the self-check's rule (which ``jacobeam
verify`` applies too), in the 4 samples a shard checks at the defaults; the same values unmutated pass.

The counts of this matrix are in docs/verifying.md ("How the checks are tested").
"""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms import self_check
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.errors import SelfCheckError
from jacobeam.transforms.output.storage import crc32c
from jacobeam.transforms.spec import EngineOptions, SelfCheck, ShardRange
from tests import mutants

CHECKED = SelfCheck().samples  # the default: 4 samples per shard


def _verdicts(engine, batch, stored) -> list[dict]:
    checker = self_check.SelfChecker(engine, SelfCheck())
    chosen = self_check.chosen_ids(ShardRange(0, len(batch.x)), CHECKED)
    label = lambda i: int(batch.labels[i]) if batch.options.outputs.rule == "label" else None  # noqa: E731
    return [checker.check([batch.x[i : i + 1]], {k: v[i : i + 1] for k, v in stored.items()}, int(i), label(i))
            for i in chosen]


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
        if not any(record["verdict"] == "mismatch" for record in records):
            missed.append((name, [(r["verdict"], r["dataset"], r["max_rel_error"], r["bound"]) for r in records]))
    assert not missed, missed


def test_the_readme_images_scaled_are_a_mismatch_not_a_kink():
    """The README's bars: flat regions, ReLUs exactly at 0 and max-pooling ties. The derivatives at points
    one rounding unit away differ by about 5x the Jacobian's largest entry; a value is judged against the
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


# --- as a user runs it: jacobeam run at the defaults, then jacobeam verify ------------------------------


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The README quickstart: its bar images and its model saved as .keras; a config with only its three keys."""
    root = tmp_path_factory.mktemp("quickstart")
    images, labels = mutants.bar_images(120)
    (root / "data").mkdir()
    np.savez(root / "data" / "bars.npz", x=images, y=labels)
    mutants.readme_cnn().save(root / "cnn.keras")
    return root


def _quickstart_config(root, out, **jacobian) -> dict:
    return {"model": {"path": str(root / "cnn.keras")}, "input": {"paths": [str(root / "data" / "*.npz")], "key": "x"},
            "output": {"path": str(out)}, **({"jacobian": jacobian} if jacobian else {})}


def _patch_results(monkeypatch, change) -> None:
    """Every batch's result datasets through ``change``: an engine fault in every sample."""
    original = JacobianEngine.compute

    def compute(engine, x, labels=None):
        datasets, full = original(engine, x, labels)
        name = mutants.result(datasets)
        return {**datasets, name: change(datasets[name]).astype(datasets[name].dtype)}, full

    monkeypatch.setattr(JacobianEngine, "compute", compute)


def test_the_quickstart_scaled_stops_the_run_in_one_line_naming_shard_sample_and_dataset(quickstart, tmp_path, monkeypatch,
                                                                                          capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_quickstart_config(quickstart, tmp_path / "out")))
    _patch_results(monkeypatch, lambda values: 1.5 * values)
    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jacobeam: error:")]
    assert len(lines) == 1
    chosen = int(self_check.chosen_ids(ShardRange(0, 120), CHECKED)[0])
    assert re.match(rf"jacobeam: error: self-check failed: shards/shard-000000000000-000000000120.h5 \(ids 0..119\), "
                    rf"sample {chosen} \(input \S+/bars.npz row {chosen}\): jacobian differs from the reference .* by max "
                    r"relative error 0.5, bound 0.0001 ", lines[0]), lines[0]
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_reduction_computed_wrongly_is_caught_by_the_run_and_by_verify(quickstart, tmp_path, monkeypatch):
    """max over outputs computed as a min in the engine's own post-processing (``reduce_full``): the check
    rebuilds the reduction from its definition, so neither the run nor ``verify`` passes it."""
    from jacobeam.transforms.engine import assembly

    original = assembly.reduce_full

    def as_a_min(kind, jacobian, rows_shape, input_shape):
        if kind != "max_abs_over_outputs":
            return original(kind, jacobian, rows_shape, input_shape)
        return {"saliency": np.abs(jacobian).min(axis=1).reshape((len(jacobian), *input_shape))}

    monkeypatch.setattr(assembly, "reduce_full", as_a_min)
    raw = _quickstart_config(quickstart, tmp_path / "out", reduce="max_abs_over_outputs")
    with pytest.raises(SelfCheckError, match=r"saliency differs from the reference"):
        runner.run(config.validate(raw), [], show_progress=False)
    raw["jacobian"]["self_check"] = {"on_mismatch": "warn"}
    manifest = runner.run(config.validate(raw), [], show_progress=False).manifest
    assert len(manifest["self_check"]["mismatches"]) == CHECKED
    report = verify(tmp_path / "out", samples=8)
    assert len([p for p in report.problems if "saliency differs from the reference" in p]) == 8, report.problems


def test_verify_catches_a_stored_value_scaled_and_a_label_row_of_another_class(quickstart, tmp_path):
    out = tmp_path / "out"
    raw = _quickstart_config(quickstart, out, outputs="label", labels={"key": "y"})
    runner.run(config.validate(raw), [], show_progress=False)
    assert verify(out, samples=8).ok
    shard = next((out / "shards").iterdir())
    with h5py.File(shard, "r+") as h5:
        jacobian = h5["jacobian"][()]
        h5["jacobian"][0] = 1.5 * jacobian[0]
        h5["output_index"][1] = (h5["output_index"][1] + 1) % 10
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][0]["crc32c"] = crc32c(shard)
    (out / "manifest.json").write_text(json.dumps(manifest))
    report = verify(out, samples=120)
    problems = [p for p in report.problems if p.startswith("sample")]
    assert problems[0].startswith("sample 0 (") and "jacobian differs from the reference" in problems[0], problems
    assert problems[1].startswith("sample 1 (") and "output_index: stored rows" in problems[1], problems
    assert len(problems) == 2


def _patch_mutant(monkeypatch, mutant) -> None:
    """The engine computes every batch through ``mutant`` (its full Jacobians from an engine of the same model
    storing all rows, built once)."""
    original = JacobianEngine.compute
    everything = {}

    def compute(engine, x, labels=None):
        datasets, full = original(engine, x, labels)
        if id(engine) not in everything:
            everything[id(engine)] = JacobianEngine(engine.model, engine.input_shapes[0], EngineOptions(batch_size=8))
        jacobians = original(everything[id(engine)], x)[0]["jacobian"]
        batch = mutants.Batch(None, engine.options, np.asarray(x), np.asarray(labels),
                              jacobians.reshape(len(x), jacobians[0].shape[0], -1).astype(np.float64))
        return mutant(dict(datasets), batch), full

    monkeypatch.setattr(JacobianEngine, "compute", compute)


@pytest.mark.slow
@pytest.mark.parametrize("output", ["all", "label", "projection"])
@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_every_mutant_stops_the_run_at_the_defaults_and_fails_verify(quickstart, tmp_path, monkeypatch, name, output):
    """The README quickstart (its bar images and model, every key at its default), its engine faulty."""
    jacobian = {"all": {}, "label": {"outputs": "label", "labels": {"key": "y"}},
                "projection": {"reduce": "project", "project": {"dim": 8}}}[output]
    raw = _quickstart_config(quickstart, tmp_path / "out", **jacobian)
    if name == "wrong_reduction" and output != "projection":
        pytest.skip("nothing reduced to get wrong")
    _patch_mutant(monkeypatch, mutants.MUTANTS[name])
    with pytest.raises(SelfCheckError, match="self-check failed"):
        runner.run(config.validate(raw), [], show_progress=False)
    raw.setdefault("jacobian", {})["self_check"] = {"on_mismatch": "warn"}
    manifest = runner.run(config.validate(raw), [], show_progress=False).manifest
    assert manifest["self_check"]["mismatches"]
    monkeypatch.undo()
    assert not verify(tmp_path / "out", samples=8).ok
