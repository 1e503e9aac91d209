"""The engine's set-up decisions, cached in the output folder (``engine-plan.json``): reused by a later
engine of the same model, options, TensorFlow and device without probing; ignored when anything of
that changed or the file is unreadable."""

import json
import logging
from pathlib import Path

import keras
import numpy as np
import pytest

from jacobeam.pipeline import config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.compute import build_engine
from jacobeam.transforms.engine import JacobianEngine, planner
from jacobeam.transforms.engine import decisions as setup_decisions
from jacobeam.transforms.engine.models import build_mlp, wrap_model
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.output.layout import ENGINE_PLAN
from jacobeam.transforms.spec import EngineOptions, ModelSource, OutputSelection
from tests import models as test_models
from tests.reference import assert_close, tape_loop

MLP = ModelSource(factory="tests.models:small_mlp")
OPTIONS = EngineOptions(batch_size=8)


@pytest.fixture
def probes(monkeypatch):
    """How many times a planner chose a plan (probing and checking paths)."""
    count = {"planner": 0}
    choose = planner.Planner.choose

    def counted(self):
        count["planner"] += 1
        return choose(self)

    monkeypatch.setattr(planner.Planner, "choose", counted)
    return count


def test_a_second_engine_reuses_the_decisions_without_probing(tmp_path, probes, rng):
    cache = str(tmp_path / ENGINE_PLAN)
    first = build_engine(MLP, (12,), OPTIONS, plan_cache=cache)
    assert probes["planner"] == 1 and first.describe()["plan_cache"] == "probed"
    assert first.describe()["layer_rules"]  # a path checked against the eager reference again on the first real batch:
    assert not Path(cache).exists()  # the decisions are cached only once that batch agreed
    x = rng.normal(size=(11, 12)).astype(np.float32)  # more than a batch: two sub-batches
    expected = first(x)
    assert first.describe()["first_batch_check"]["reference"] == "reverse, eagerly"
    written = json.loads(Path(cache).read_text())
    assert written["key"]["model_fingerprint"] == first.fingerprint and written["plan"]["mode"] == "reverse"

    second = build_engine(MLP, (12,), OPTIONS, plan_cache=cache)
    assert probes["planner"] == 1  # no probe, no check, no timing
    described = second.describe()
    assert described["plan_cache"] == "reused"
    for key in ("mode", "jit_compile", "double_reverse", "batch_size", "block_rows", "reasons", "candidates"):
        assert described[key] == first.describe()[key], key
    assert second.traces == 1  # the plan's block, traced at set-up

    result = second(x)
    assert_close(result["jacobian"], tape_loop(test_models.small_mlp(), x))
    np.testing.assert_array_equal(result["jacobian"], expected["jacobian"])
    assert second.describe()["retraces_after_setup"] == 0


def test_changed_weights_options_or_operands_invalidate_the_decisions(probes):
    model = wrap_model(build_mlp(), "builtin:mlp")
    decisions = JacobianEngine(model, (784,), EngineOptions(batch_size=4)).decisions
    assert probes["planner"] == 1
    assert JacobianEngine(model, (784,), EngineOptions(batch_size=4), decisions=decisions).describe()["plan_cache"] == "reused"
    assert probes["planner"] == 1

    other_weights = wrap_model(build_mlp(seed=1), "builtin:mlp")
    for engine in (
        JacobianEngine(other_weights, (784,), EngineOptions(batch_size=4), decisions=decisions),
        JacobianEngine(model, (784,), EngineOptions(batch_size=8), decisions=decisions),
        JacobianEngine(model, (784,), EngineOptions(batch_size=4, outputs=OutputSelection("argmax")), decisions=decisions),
    ):
        assert engine.describe()["plan_cache"] == "probed"
    assert probes["planner"] == 4

    other_tensorflow = {**decisions, "key": {**decisions["key"], "tensorflow": "0.0.1"}}
    engine = JacobianEngine(model, (784,), EngineOptions(batch_size=4), decisions=other_tensorflow)
    assert engine.describe()["plan_cache"] == "probed"


def test_a_corrupt_cache_is_ignored_with_a_debug_log_and_replaced(tmp_path, probes, caplog, rng):
    cache = tmp_path / ENGINE_PLAN
    good = build_engine(MLP, (12,), OPTIONS, plan_cache=str(cache))
    x = rng.normal(size=(3, 12)).astype(np.float32)
    expected = good(x)["jacobian"]  # the first batch: the decisions are cached once it agreed
    decisions = json.loads(cache.read_text())
    malformed = {**decisions, "plan": {**decisions["plan"], "mode": "sideways"}}
    for text in ("{not json", "[1, 2]", json.dumps({"key": decisions["key"]}), json.dumps(malformed)):
        cache.write_text(text)
        with caplog.at_level(logging.DEBUG, logger="jacobeam"):
            engine = build_engine(MLP, (12,), OPTIONS, plan_cache=str(cache))
        assert engine.describe()["plan_cache"] == "probed", text
        np.testing.assert_array_equal(engine(x)["jacobian"], expected)
        assert json.loads(cache.read_text()) == decisions  # replaced by the decisions of the probe
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("unreadable" in message for message in debug) and any("unusable" in message for message in debug)
    assert probes["planner"] == 5


def _config(data: Path, out: Path):
    return config.validate(
        {
            "model": {"factory": "tests.models:small_mlp"},
            "input": {"paths": [str(data / "*.npy")]},
            "jacobian": {"batch_size": 4},
            "output": {"path": str(out), "samples_per_shard": 8},
        }
    )


def test_a_resumed_run_reuses_the_decisions_and_verify_knows_the_file(tmp_path, rng):
    (tmp_path / "data").mkdir()
    x = rng.normal(size=(20, 12)).astype(np.float32)
    np.save(tmp_path / "data" / "a.npy", x)
    out = tmp_path / "out"
    first = runner.run(_config(tmp_path / "data", out), [], show_progress=False).manifest
    assert first["engine"]["plan_cache"] == "probed" and (out / ENGINE_PLAN).exists()

    (out / "manifest.json").unlink()  # an interrupted run: resumed, one shard computed again
    (out / "shards" / "shard-000000000008-000000000016.h5").unlink()
    second = runner.run(_config(tmp_path / "data", out), [], show_progress=False).manifest
    assert second["engine"]["plan_cache"] == "reused"
    report = verify(out, samples=2)
    assert report.ok and not report.notes, report.problems + report.notes

    (out / ENGINE_PLAN).write_text("{")
    report = verify(out)
    assert report.ok
    assert report.notes == [f"{ENGINE_PLAN}: unreadable (a cache of the engine's set-up: the next run probes again)"]


class _Unserialisable(keras.layers.Layer):
    def call(self, x):
        return 2.0 * x

    def get_config(self):
        raise NotImplementedError


def test_a_model_whose_structure_cannot_be_named_always_probes(rng):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(_Unserialisable()(inputs)))
    engine = JacobianEngine(wrap_model(model, "custom"), (3,), EngineOptions(batch_size=4))
    assert engine.decisions is None and engine.describe()["plan_cache"] == "probed"
    x = rng.normal(size=(3, 3)).astype(np.float32)
    assert_close(engine(x)["jacobian"], tape_loop(model, x))


class _Centring(keras.layers.Layer):
    """Subtracts the batch's mean where ``couples`` (a change of its code, not of its configuration or
    weights: the set-up decisions' key stays the same)."""

    couples = False

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True) if self.couples else x


def test_reused_decisions_do_not_skip_the_batch_independence_check(monkeypatch, probes):
    model = keras.Sequential([keras.Input((5,)), _Centring(), keras.layers.Dense(3)])
    decisions = JacobianEngine(wrap_model(model, "centring"), (5,), OPTIONS).decisions
    assert decisions is not None and probes["planner"] == 1
    reused = JacobianEngine(wrap_model(model, "centring"), (5,), OPTIONS, decisions=decisions)
    assert reused.describe()["plan_cache"] == "reused" and probes["planner"] == 1

    monkeypatch.setattr(_Centring, "couples", True)
    assert setup_decisions.key(wrap_model(model, "centring"), reused.fingerprint, [(5,)], OPTIONS) == decisions["key"]
    with pytest.raises(ModelError, match=r"^centring: a sample's output depends on the other samples in its batch"):
        JacobianEngine(wrap_model(model, "centring"), (5,), OPTIONS, decisions=decisions)
    assert probes["planner"] == 1
