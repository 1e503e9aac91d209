"""The model's identity (transforms.model_identity): a rerun whose model or library versions differ is
refused naming what changed, never mixed with the folder's shards; read without TensorFlow."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest

from jacobeam.pipeline import cli, runner
from jacobeam.pipeline.config import validate
from jacobeam.transforms import model_differences, model_identity
from jacobeam.transforms.model_identity import IDENTITY_ATTR, VERSIONS_ATTR
from jacobeam.transforms.output.storage import crc32c
from jacobeam.transforms.spec import ModelSource
from tests.test_pipeline import folder_state

ROOT = Path(__file__).resolve().parents[1]


def _save_model(path: Path, activation: str = "tanh", scale: float = 1.0) -> Path:
    """x[3] -> Dense 'd' (4, activation) -> Dense 'out' (2), with seeded weights times ``scale``."""
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation=activation, name="d"), keras.layers.Dense(2, name="out")]
    )
    rng = np.random.default_rng(0)
    model.set_weights([scale * rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
    model.save(path)
    return path


def _write(data: Path, name: str, n: int, seed: int) -> None:
    data.mkdir(parents=True, exist_ok=True)
    np.save(data / f"{name}.npy", np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32))


def _config_file(tmp_path: Path, model: dict) -> Path:
    config = {
        "model": model,
        "input": {"paths": [str(tmp_path / "data" / "*.npy")]},
        "jacobian": {"batch_size": 4, "self_check": {"samples": 0}},
        "output": {"path": str(tmp_path / "out"), "samples_per_shard": 8},
    }
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def keras_run(tmp_path):
    """A run of a .keras model (tanh) over a.npy (8 samples); b.npy (8 more) is added afterwards."""
    model = _save_model(tmp_path / "m.keras")
    _write(tmp_path / "data", "a", 8, seed=0)
    cfg = _config_file(tmp_path, {"path": str(model)})
    assert cli.main(["-q", "run", str(cfg)]) == 0
    _write(tmp_path / "data", "b", 8, seed=1)
    return tmp_path, cfg, model


def _refused(cfg: Path, out: Path, capsys, *args: str) -> str:
    before = folder_state(out)
    assert cli.main(["-q", "run", str(cfg), *args]) == cli.FAILED
    assert folder_state(out) == before  # nothing computed, nothing mixed in
    return capsys.readouterr().err


def test_a_model_resaved_with_another_activation_is_refused_naming_the_layer(keras_run, capsys):
    tmp_path, cfg, model = keras_run
    _save_model(model, activation="relu")  # the same weights
    err = _refused(cfg, tmp_path / "out", capsys)
    assert "manifest.json: model: layer 'd': activation tanh there, relu now (so do 1 shards)" in err, err
    assert "weights differ" not in err and "use --overwrite" in err

    assert cli.main(["-q", "run", str(cfg), "--overwrite"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["run"]["samples_computed"] == 16  # every sample from the relu model
    assert manifest["model_identity"]["architecture_config"]["config"]["layers"][1]["config"]["activation"] == "relu"


def test_a_model_with_other_weights_is_refused(keras_run, capsys):
    tmp_path, cfg, model = keras_run
    _save_model(model, scale=1.5)
    err = _refused(cfg, tmp_path / "out", capsys)
    assert "manifest.json: model: the weights differ (so do 1 shards)" in err, err
    assert "layer" not in err


def test_the_same_model_saved_again_extends_the_folder(keras_run, capsys):
    tmp_path, cfg, model = keras_run
    _save_model(model)  # other file bytes (a new save), the same architecture and weights
    assert runner.launcher_loads_model(validate(json.loads(cfg.read_text())), runner.PipelineOptions([])) is False
    assert cli.main(["-q", "run", str(cfg)]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["run"]["samples_computed"] == 8 and manifest["run"]["samples_kept"] == 8
    for shard in (tmp_path / "out" / "shards").iterdir():
        with h5py.File(shard) as h5:
            assert json.loads(h5.attrs[IDENTITY_ATTR]) == model_identity.stored(manifest["model_identity"])
            assert json.loads(h5.attrs[VERSIONS_ATTR])["tensorflow"] == manifest["versions"]["tensorflow"]


def test_a_factory_whose_source_changed_is_refused_by_what_it_builds(tmp_path, capsys, monkeypatch):
    """A factory is identified by the model it builds (its configuration and weights), not by its file: the
    rerun names the layer and key that changed, and the weights."""
    module = tmp_path / "code" / "idmodels.py"
    module.parent.mkdir()
    module.write_text(textwrap.dedent(
        """
        import keras

        def build():
            return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones", name="d")])
        """
    ))
    monkeypatch.syspath_prepend(str(module.parent))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a rewrite of the same size in the same second
    _write(tmp_path / "data", "a", 8, seed=0)
    cfg = _config_file(tmp_path, {"factory": "idmodels:build"})
    assert cli.main(["-q", "run", str(cfg)]) == 0
    module.write_text(module.read_text().replace('"ones"', '"zeros"'))
    monkeypatch.delitem(sys.modules, "idmodels")  # as a new process imports it
    _write(tmp_path / "data", "b", 8, seed=1)
    err = _refused(cfg, tmp_path / "out", capsys)
    assert "manifest.json: model: layer 'd': kernel_initializer Ones() there, Zeros() now (so do 1 shards)" in err, err
    assert "manifest.json: model: the weights differ (so do 1 shards)" in err, err
    assert "source code" not in err


def _other_versions(monkeypatch):
    versions = {**model_identity.library_versions(), "tensorflow": "9.9.9"}
    monkeypatch.setattr(model_identity, "library_versions", lambda: versions)
    return versions


def test_other_library_versions_are_refused_unless_accepted(keras_run, capsys, monkeypatch):
    tmp_path, cfg, _ = keras_run
    installed = model_identity.library_versions()["tensorflow"]
    _other_versions(monkeypatch)
    err = _refused(cfg, tmp_path / "out", capsys)
    assert (
        f"manifest.json: computed with other library versions: tensorflow {installed} there, 9.9.9 now "
        "(--accept-library-versions adds shards computed with these)" in err
    ), err

    assert cli.main(["-q", "run", str(cfg), "--accept-library-versions"]) == 0
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["versions"]["tensorflow"] == "9.9.9" and manifest["run"]["samples_computed"] == 8
    recorded = {}
    for shard in sorted((out / "shards").iterdir()):
        with h5py.File(shard) as h5:
            recorded[shard.name] = json.loads(h5.attrs[VERSIONS_ATTR])["tensorflow"]
    assert list(recorded.values()) == [installed, "9.9.9"]  # each shard its own

    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    assert f"versions    tensorflow 9.9.9, keras {manifest['versions']['keras']}" in capsys.readouterr().out


def test_a_folder_written_before_shards_stored_the_identity_is_judged_by_its_weights(keras_run, capsys):
    tmp_path, cfg, model = keras_run
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("model_identity", "tf_threads"):
        del manifest[key]
    for shard in (out / "shards").iterdir():
        with h5py.File(shard, "a") as h5:
            for name in (IDENTITY_ATTR, model_identity.ARCHITECTURE_ATTR, VERSIONS_ATTR, model_identity.THREADS_ATTR):
                del h5.attrs[name]
    for entry in manifest["shards"]:  # the checksums of the shards as that jacobeam wrote them
        entry["crc32c"] = crc32c(out / entry["file"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    options = runner.PipelineOptions([])
    assert runner.launcher_loads_model(validate(json.loads(cfg.read_text())), options) is True

    _save_model(model, scale=1.5)
    err = _refused(cfg, out, capsys)
    assert "manifest.json: model weights differ (fingerprint" in err, err
    _save_model(model)  # the weights it recorded: extended
    assert cli.main(["-q", "run", str(cfg)]) == 0
    assert json.loads((out / "manifest.json").read_text())["run"]["samples_kept"] == 8


def test_the_identity_is_read_without_importing_tensorflow(tmp_path):
    model = _save_model(tmp_path / "m.keras")
    legacy = tmp_path / "m.h5"
    keras.models.load_model(model).save(legacy)
    code = textwrap.dedent(
        f"""
        import sys
        from jacobeam.transforms.model_identity import library_versions, model_identity, stored
        from jacobeam.transforms.spec import ModelSource
        found = [stored(model_identity(ModelSource(**source))) for source in
                 ({{"path": {str(model)!r}}}, {{"path": {str(legacy)!r}}}, {{"builtin": "cnn"}})]
        assert library_versions()["tensorflow"]
        assert "tensorflow" not in sys.modules and "keras" not in sys.modules, "imported"
        print(found[0]["weights"], found[1]["architecture"] is not None, found[2]["code"] is not None)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    keras_weights, legacy_architecture, builtin_code = done.stdout.split()
    assert keras_weights == model_identity.model_identity(ModelSource(path=str(model)))["weights"]
    assert legacy_architecture == builtin_code == "True"
    # A factory's identity is that of the model it builds: it is built (in the launcher, by pipeline.checks
    # or here), tests/test_factory_identity.py.


def test_differences_name_layers_by_position_not_by_default_names():
    def config(activation, name):
        return {"class_name": "Sequential", "config": {"name": "s", "layers": [
            {"class_name": "Dense", "config": {"name": name, "units": 4, "activation": activation}}]}}

    def identity(activation, name):
        return {"kind": "keras", "architecture": model_identity.architecture_digest(config(activation, name)),
                "weights": "w", "code": None, "architecture_config": config(activation, name)}

    assert model_differences.differences(identity("tanh", "dense"), identity("tanh", "dense_7")) == []
    assert model_differences.differences(identity("tanh", "dense"), identity("relu", "dense_7")) == [
        "layer 'dense_7': activation tanh there, relu now"
    ]


def _counting_loads(monkeypatch) -> list[str]:
    """Each ``keras.models.load_model`` call's path, as jacobeam's loader makes them."""
    calls, load_model = [], keras.models.load_model

    def counted(path, *args, **kwargs):
        calls.append(str(path))
        return load_model(path, *args, **kwargs)

    monkeypatch.setattr(keras.models, "load_model", counted)
    return calls


def _fresh_config(tmp_path: Path, model: Path, out: str):
    """A run of ``model`` over ``tmp_path/data`` into a new folder, every other key at its default (the
    self-check on)."""
    return validate({"model": {"path": str(model)}, "input": {"paths": [str(tmp_path / "data" / "*.npy")]},
                     "output": {"path": str(tmp_path / out)}})


def test_a_fresh_in_process_run_reads_its_keras_file_once(tmp_path, monkeypatch):
    """The launcher's check loads the file; the run's engine in the same process takes that model (the file
    unchanged), not a second load, and computes the file's model's Jacobians."""
    from jacobeam.transforms.engine import models
    from tests.reference import tape_loop

    model = _save_model(tmp_path / "m.keras")
    _write(tmp_path / "data", "a", 11, seed=0)
    cfg = _fresh_config(tmp_path, model, "out")
    calls = _counting_loads(monkeypatch)
    assert runner.launcher_loads_model(cfg, runner.PipelineOptions([])) is True  # a fresh folder, in process
    manifest = runner.run(cfg, [], show_progress=False).manifest
    assert calls == [str(model)]
    assert manifest["self_check"]["samples_checked"] >= 1 and not manifest["self_check"]["mismatches"]
    assert models._kept is None  # nothing held once the run is over
    monkeypatch.undo()
    samples = np.load(tmp_path / "data" / "a.npy")
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        np.testing.assert_allclose(view["jacobian"][:], tape_loop(keras.models.load_model(model), samples), rtol=1e-5,
                                   atol=1e-6)


def test_a_keras_file_replaced_after_the_plan_is_read_again_and_refused(tmp_path, monkeypatch):
    """A file changed between the launcher's check and the engine (here new weights, saved over it) is
    loaded again, never taken from the check, so the run refuses it as a model other than the planned one;
    the same model saved again (other file bytes, the same weights) is read again and runs."""
    model = _save_model(tmp_path / "m.keras")
    _write(tmp_path / "data", "a", 11, seed=0)
    calls = _counting_loads(monkeypatch)
    with pytest.raises(Exception, match="model weights changed since the run was planned"):
        runner.run(_fresh_config(tmp_path, model, "out"), [], show_progress=False,
                   planned=lambda spec: _save_model(model, scale=1.5))
    assert calls == [str(model)] * 2

    calls.clear()
    _save_model(model)
    manifest = runner.run(_fresh_config(tmp_path, model, "again"), [], show_progress=False,
                          planned=lambda spec: _save_model(model)).manifest
    assert calls == [str(model)] * 2 and manifest["run"]["samples_computed"] == 11
