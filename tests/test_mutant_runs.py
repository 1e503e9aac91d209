"""The mutants of ``tests.mutants`` as a user meets them: ``jacobeam run`` on the README quickstart at the
defaults, then ``jacobeam verify``, with the engine faulty (``JacobianEngine.compute`` patched in process)."""

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

CHECKED = SelfCheck().samples  # the default: 4 samples per 4,096 ids of a shard


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
    assert re.match(rf"jacobeam: error: self-check failed: shards/shard-000000000000-000000000120.h5 \(ids 0 to 119\), "
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
    # The quickstart's 120 images are one shard: 4 checks per 4,096 ids, at least one, is one check.
    assert len(manifest["self_check"]["mismatches"]) == self_check.checked_count(120, CHECKED) == 1
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
    if name in _SOFTMAX_TOP_K:
        pytest.skip("the quickstart's model has logits, and no top_k here: test_a_confident_softmax_s_...")
    _patch_mutant(monkeypatch, mutants.MUTANTS[name])
    with pytest.raises(SelfCheckError, match="self-check failed"):
        runner.run(config.validate(raw), [], show_progress=False)
    raw.setdefault("jacobian", {})["self_check"] = {"on_mismatch": "warn"}
    manifest = runner.run(config.validate(raw), [], show_progress=False).manifest
    assert manifest["self_check"]["mismatches"]
    monkeypatch.undo()
    assert not verify(tmp_path / "out", samples=8).ok


_SOFTMAX_TOP_K = ("small_outputs_zeroed", "last_choice_smallest")  # faults of probabilities, of top_k's rows


@pytest.mark.slow
@pytest.mark.parametrize("name", _SOFTMAX_TOP_K)
def test_a_confident_softmax_s_small_probabilities_and_top_k_choices_are_checked(tmp_path, monkeypatch, name):
    """A softmax classifier whose second largest probabilities go below 1e-5, ``outputs: {top_k: 3}``: its
    small probabilities stored as 0, or its third choice the least likely class (with that class's rows),
    stop the run and fail ``verify``; judged at the largest probability's scale alone, both passed. The
    same run unmutated passes both."""
    _, x, _ = mutants.inputs("confident_softmax", 40)
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "x.npy", x)
    mutants.confident_softmax().save(tmp_path / "softmax.keras")
    raw = {"model": {"path": str(tmp_path / "softmax.keras")}, "input": {"paths": [str(tmp_path / "data" / "*.npy")]},
           "output": {"path": str(tmp_path / "out")}, "jacobian": {"outputs": {"top_k": 3}}}
    runner.run(config.validate(raw), [], show_progress=False)
    assert verify(tmp_path / "out", samples=40).ok
    raw["output"]["path"] = str(tmp_path / "wrong")
    _patch_mutant(monkeypatch, mutants.MUTANTS[name])
    with pytest.raises(SelfCheckError, match="self-check failed"):
        runner.run(config.validate(raw), [], show_progress=False)
    raw["jacobian"]["self_check"] = {"on_mismatch": "warn"}
    runner.run(config.validate(raw), [], show_progress=False)
    monkeypatch.undo()
    report = verify(tmp_path / "wrong", samples=40)
    dataset = "output differs" if name == "small_outputs_zeroed" else "output_index: stored rows"
    assert len([p for p in report.problems if dataset in p]) == 40, report.problems  # every sample
