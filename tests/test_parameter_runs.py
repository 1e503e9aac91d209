"""Parameter-side runs end to end (``jacobian.wrt: parameters``): sharded, self-checked, resumed bit for bit,
and the projection rebuilt from the manifest alone reproduces what was stored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import tensorflow as tf
import yaml

from jacobeam.pipeline import cli, config, plot, runner
from jacobeam.transforms.engine.models import load
from jacobeam.transforms.engine.parameter_space import Weight, projection_rows
from jacobeam.transforms.output.storage import sha256
from tests.test_inspect_plot import assert_titles_fit


def _write(folder: Path, shape, n: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (n, *shape)).astype(np.float32)
    y = rng.integers(0, classes, n)
    cut = n // 3
    for i, (lo, hi) in enumerate([(0, cut), (cut, n)]):
        np.savez(folder / f"part{i}.npz", x=x[lo:hi], y=y[lo:hi])
    return x, y


def _config(data: Path, out: Path, model: dict, per_shard: int, **jacobian):
    return config.validate({
        "model": model,
        "input": {"paths": [str(data / "*.npz")], "key": "x"},
        "jacobian": {"wrt": "parameters", "labels": {"key": "y"}, **jacobian},
        "output": {"path": str(out), "samples_per_shard": per_shard},
    })


def _margin_gradient(model, x: np.ndarray, label: int, variables) -> tuple[float, np.ndarray]:
    """TRAK's margin of one sample and its gradient, float64, by an eager tape (closed form of the margin)."""
    with tf.GradientTape() as tape:
        z = tf.reshape(model(x[None].astype(np.float64), training=False), (-1,))
        rest = tf.concat([z[:label], z[label + 1:]], 0)
        margin = z[label] - tf.reduce_logsumexp(rest)
    return float(margin), np.concatenate([np.asarray(g).reshape(-1) for g in tape.gradient(margin, variables)])


def _jacobeam(*args: str) -> None:
    """``jacobeam ARGS`` in a process of its own: a ResNet's run returns its gigabytes when it ends, instead of
    keeping them in the test worker beside the other tests'."""
    done = subprocess.run([sys.executable, "-m", "jacobeam", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_trak_features_of_a_cifar_resnet_resume_bit_for_bit_and_rebuild_from_the_manifest(tmp_path):
    x, y = _write(tmp_path / "data", (32, 32, 3), 300, 10)
    cfg = _config(tmp_path / "data", tmp_path / "out", {"builtin": "cifar_resnet"}, 128, objective="margin",
                  reduce="project")
    (tmp_path / "trak.yaml").write_text(yaml.safe_dump(config.to_dict(cfg)))
    _jacobeam("run", str(tmp_path / "trak.yaml"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["self_check"]["samples_checked"] == 3 and not manifest["self_check"]["mismatches"]
    out = tmp_path / "out"
    with h5py.File(out / "jacobians.h5") as h5:
        projection, objective, ids = h5["projection"][:], h5["objective"][:], h5["sample_id"][:]
    assert projection.shape == (300, 2048) and np.array_equal(ids, np.arange(300))

    # The projection rebuilt from the manifest alone: its weights, in order, and the seed.
    stored = manifest["stored"]["parameters"]
    seed, dim = manifest["config"]["jacobian"]["project"]["seed"], manifest["config"]["jacobian"]["project"]["dim"]
    assert (stored["objective"], dim, stored["projection_block_rows"]) == ("margin", 2048, 4096)
    rows = np.concatenate([projection_rows(seed, "rademacher", Weight(w["index"], w["name"], w["layer"], tuple(w["shape"]),
                                                                      w["offset"]), dim) for w in stored["weights"]])
    model = load(builtin="cifar_resnet").with_dtype("float64").keras_model
    variables = model.trainable_variables
    assert [list(v.shape) for v in variables] == [w["shape"] for w in stored["weights"]]
    for i in (0, 150, 299):
        margin, g = _margin_gradient(model, x[i], int(y[i]), variables)
        np.testing.assert_allclose(objective[i], margin, rtol=1e-5)
        want = g @ rows
        assert np.abs(projection[i] - want).max() <= 1e-4 * np.abs(want).max()

    # A lost shard is computed again, bit for bit; the others are kept.
    before = {p.name: sha256(p) for p in (out / "shards").iterdir()}
    lost = sorted(before)[1]
    (out / "shards" / lost).unlink()
    _jacobeam("run", str(tmp_path / "trak.yaml"))
    again = json.loads((out / "manifest.json").read_text())
    assert again["run"]["samples_computed"] == 128
    assert {p.name: sha256(p) for p in (out / "shards").iterdir()} == before
    _jacobeam("verify", str(out), "--samples", "4")  # exit 0: verified


@pytest.mark.slow
def test_grand_scores_and_entk_features_of_a_small_conv_net(tmp_path):
    """Per-sample loss-gradient norms, in total and per layer (GraNd), and projected rows of the logits
    (eNTK features), each against a float64 per-sample tape."""
    x, y = _write(tmp_path / "data", (6, 6, 2), 45, 4, seed=1)
    model = {"factory": "tests.models:bn_cnn"}
    cfg = _config(tmp_path / "data", tmp_path / "grand", model, 16, objective={"loss": "sparse_categorical_crossentropy"},
                  reduce="frobenius")
    manifest = runner.run(cfg, [], show_progress=False).manifest
    assert manifest["stored"]["parameters"]["layers"] == ["conv", "bn", "head"]
    reference = load(factory="tests.models:bn_cnn").with_dtype("float64").keras_model
    with h5py.File(tmp_path / "grand" / "jacobians.h5") as h5:
        norms, by_layer, loss = h5["frobenius"][:], h5["frobenius_by_layer"][:], h5["objective"][:]
    owners = [layer.name for layer in reference.layers for _ in layer.trainable_weights]
    for i in range(0, 45, 7):
        with tf.GradientTape() as tape:
            z = reference(x[i: i + 1].astype(np.float64), training=False)[0]
            value = -(z[int(y[i])] - tf.reduce_logsumexp(z))
        grads = tape.gradient(value, reference.trainable_variables)
        squares = {name: 0.0 for name in ("conv", "bn", "head")}
        for owner, g in zip(owners, grads):
            squares[owner] += float(np.sum(np.asarray(g) ** 2))
        np.testing.assert_allclose(loss[i], float(value), rtol=1e-5)
        np.testing.assert_allclose(by_layer[i], np.sqrt(list(squares.values())), rtol=1e-4)
        np.testing.assert_allclose(norms[i], np.sqrt(sum(squares.values())), rtol=1e-4)
    pytest.importorskip("matplotlib")
    figure, _ = plot.draw(str(tmp_path / "grand"), manifest)
    assert_titles_fit(figure)
    titles = [axis.get_title().replace("\n", " ") for axis in figure.axes]
    assert any("norm of the per-sample gradient" in t for t in titles) and any("objective" in t for t in titles)
    assert any("norm per layer (3 layers" in t for t in titles)
    layers = next(axis for axis in figure.axes if "norm per layer" in axis.get_title())
    assert [tick.get_text() for tick in layers.get_xticklabels()] == ["conv", "bn", "head"]  # categories, named
    shown = int(layers.get_title().split(":")[0].split()[-1])  # "sample <id>: norm per layer ..."
    np.testing.assert_array_equal([bar.get_height() for bar in layers.patches], by_layer[shown])

    for structure in ("dense", "kronecker"):  # P rebuilt from what the manifest records
        out = tmp_path / f"entk_{structure}"
        cfg = _config(tmp_path / "data", out, model, 16, reduce="project",
                      project={"dim": 64, "seed": 9, "structure": structure})
        manifest = runner.run(cfg, [], show_progress=False).manifest
        assert manifest["self_check"]["samples_checked"] == 3 and not manifest["self_check"]["mismatches"]
        weights, recorded = manifest["stored"]["parameters"]["weights"], manifest["stored"]["projection"]
        rows = np.concatenate([projection_rows(recorded["seed"], recorded["kind"], Weight(
            w["index"], w["name"], w["layer"], tuple(w["shape"]), w["offset"]), recorded["dim"],
            recorded.get("structure", "dense")) for w in weights])
        assert recorded.get("kronecker_factors", [8, 8]) == [8, 8] and ("structure" in recorded) == (structure != "dense")
        with h5py.File(out / "jacobians.h5") as h5:
            features = h5["projection"][:]
        assert features.shape == (45, 4, 64)
        for i in (0, 44):
            with tf.GradientTape(persistent=True) as tape:
                z = reference(x[i: i + 1].astype(np.float64), training=False)[0]
                outputs = [z[r] for r in range(4)]
            jacobian = np.stack([np.concatenate([np.asarray(g).reshape(-1) for g in
                                                 tape.gradient(row, reference.trainable_variables)]) for row in outputs])
            want = jacobian @ rows
            assert np.abs(features[i] - want).max() <= 1e-4 * np.abs(want).max(), structure
        _jacobeam("verify", str(out), "--samples", "4")
        assert_titles_fit(plot.draw(str(out), manifest)[0])
    assert json.loads(json.dumps(manifest["stored"]))["parameters"]["objective"] == "outputs"


def test_a_wrong_projection_checked_at_its_shards_end_stops_the_run_before_the_shard_is_committed(tmp_path, monkeypatch):
    """A run's worker checks a shard's chosen samples together, after its last batch (one pass over ``P``):
    the checks still come before the commit, so a wrong value leaves no shard."""
    from jacobeam.transforms.engine.parameters import ParameterEngine
    from jacobeam.transforms.errors import SelfCheckError

    _write(tmp_path / "data", (6, 6, 2), 45, 4, seed=1)
    compute = ParameterEngine.compute

    def scaled(self, x, labels=None):
        datasets, rest = compute(self, x, labels)
        return {**datasets, "projection": datasets["projection"] * 1.5}, rest

    monkeypatch.setattr(ParameterEngine, "compute", scaled)
    cfg = _config(tmp_path / "data", tmp_path / "out", {"factory": "tests.models:bn_cnn"}, 16, reduce="project",
                  project={"dim": 64})
    with pytest.raises(SelfCheckError, match=r"shards/\S+ \(ids \d+ to \d+\), sample \d+"):
        runner.run(cfg, [], show_progress=False)
    assert not list((tmp_path / "out").rglob("*.h5"))


def test_a_rerun_that_computes_nothing_keeps_the_weights_layout_that_rebuilds_p(tmp_path, capsys):
    """A complete TRAK folder run again with another self-check (every shard kept, no engine built): the
    manifest's ``stored.parameters`` lost the weights' layout (names, shapes, offsets: what rebuilds ``P``)
    and ``inspect`` failed on it with a KeyError."""
    _write(tmp_path / "data", (12,), 30, 3)
    raw = lambda **check: _config(tmp_path / "data", tmp_path / "out", {"factory": "tests.models:softmax_mlp"}, 16,  # noqa: E731
                                  objective="margin", reduce="project", project={"dim": 32}, **check)
    first = runner.run(raw(), [], show_progress=False).manifest
    again = runner.run(raw(self_check={"samples": 1}), [], show_progress=False).manifest

    assert again["run"]["samples_computed"] == 0
    assert again["stored"]["parameters"] == first["stored"]["parameters"] and "size" in first["stored"]["parameters"]
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "out")]) == cli.OK
    said = capsys.readouterr().out
    assert f"wrt: parameters, {first['stored']['parameters']['size']:,} weight entries" in said
    assert "reduce: project; P 32 columns, rademacher, seed 0, dense)" in said  # what rebuilds P


@pytest.mark.slow
def test_the_layers_of_wrt_parameters_are_a_set_their_order_and_repeats_are_the_same_run(tmp_path):
    """The weights are taken once each, in the model's order, however the layers are listed: a folder written
    with ``[head, conv]`` is resumed by ``[conv, head, conv]`` (it was refused as another run's)."""
    _write(tmp_path / "data", (6, 6, 2), 40, 4, seed=2)
    model = {"factory": "tests.models:bn_cnn"}

    def run(out: str, layers: list[str]):
        cfg = _config(tmp_path / "data", tmp_path / out, model, 16, wrt={"parameters": layers},
                      objective={"loss": "sparse_categorical_crossentropy"}, reduce="frobenius")
        return runner.run(cfg, [], show_progress=False).manifest

    run("out", ["head", "conv"])
    (tmp_path / "out" / "shards" / "shard-000000000016-000000000032.h5").unlink()
    (tmp_path / "out" / "manifest.json").unlink()
    resumed = run("out", ["conv", "head", "conv"])
    run("fresh", ["conv", "head"])

    assert resumed["run"]["samples_computed"] == 16 and resumed["stored"]["parameters"]["layers"] == ["conv", "head"]
    with h5py.File(tmp_path / "out" / "jacobians.h5") as ours, h5py.File(tmp_path / "fresh" / "jacobians.h5") as theirs:
        for name in ("frobenius", "frobenius_by_layer", "objective", "sample_id"):
            np.testing.assert_array_equal(ours[name][:], theirs[name][:])
