"""A factory's model is identified by what it builds (transforms.model_identity): its Keras configuration
and weights, as a ``.keras`` file's, wherever the code that makes it lives. A change in a module the
factory imports its architecture from is refused naming the layer and key; launcher and worker compute
the identity with one function, the launcher from the model it built for its check."""

import json
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import h5py
import keras
import numpy as np
import pytest

from jacobeam.pipeline import cli, runner
from jacobeam.pipeline.config import validate
from jacobeam.transforms import model_differences, model_identity
from jacobeam.transforms.model_identity import IDENTITY_ATTR
from jacobeam.transforms.spec import ModelSource
from tests.reference import assert_close, tape_loop
from tests.test_model_identity import _config_file, _refused, _write
from tests.test_pipeline import folder_state

# The architecture, in a module of its own that the factory imports: what changes in the refused rerun.
ARCH = '''
import keras

def body():
    """x[3] -> Dense 'hidden' (4, tanh) -> Dense (2), the last named by Keras."""
    return [keras.Input((3,)), keras.layers.Dense(4, activation="tanh", name="hidden"), keras.layers.Dense(2)]
'''
FACTORY = '''
import keras
import numpy as np

from fidpkg.arch import body

CALLS = []  # one entry per model built in this process


def build():
    CALLS.append(1)
    model = keras.Sequential(body())
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
    return model


def unseeded():
    """Draws its weights anew on every call (Keras' initializers, unseeded)."""
    return keras.Sequential(body())
'''
MODULES = ("fidpkg", "fidpkg.arch", "fidpkg.factory")


def _package(root: Path, monkeypatch) -> Path:
    package = root / "code" / "fidpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "arch.py").write_text(textwrap.dedent(ARCH))
    (package / "factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # tanh -> relu: the same size, maybe the same second
    return package


def _fresh_import(monkeypatch) -> None:
    """Forget the package, as a new ``jacobeam run`` process would not have imported it."""
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)


def _calls() -> int:
    return len(sys.modules["fidpkg.factory"].CALLS)


def _build():
    from fidpkg.factory import build

    return build()


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _jacobians(out: Path) -> np.ndarray:
    with h5py.File(out / "jacobians.h5") as view:
        return view["jacobian"][:]


@pytest.fixture
def factory_run(tmp_path, monkeypatch):
    """``jacobeam run`` of ``fidpkg.factory:build`` (tanh) over a.npy (8 samples, one shard of 8)."""
    package = _package(tmp_path, monkeypatch)
    _write(tmp_path / "data", "a", 8, seed=0)
    cfg = _config_file(tmp_path, {"factory": "fidpkg.factory:build"})
    assert cli.main(["-q", "run", str(cfg)]) == 0
    return tmp_path, cfg, package


def test_the_identity_is_that_of_the_built_model_as_a_keras_file_of_it_would_name_it(factory_run, tmp_path):
    root, _, _ = factory_run
    assert _calls() == 2  # the launcher's check (whose model gives the identity: not built again), the worker's
    identity = _manifest(root / "out")["model_identity"]
    model = _build()
    model.save(tmp_path / "built.keras")
    as_file = model_identity.model_identity(ModelSource(path=str(tmp_path / "built.keras")))
    assert identity["kind"] == "factory" and identity["code"] is None
    assert identity["architecture"] == as_file["architecture"]  # names aside, the same configuration
    assert identity["weights"] == model_identity.weights_digest(model.get_weights())
    # Keras' default names as a process that builds only this model gives them (this one built many before):
    # the same bytes in every process's shards.
    layers = identity["architecture_config"]["config"]["layers"]
    assert [layer["config"]["name"] for layer in layers] == ["input_layer", "hidden", "dense"]
    assert identity["architecture_config"]["config"]["name"] == "sequential"
    assert layers[1]["config"]["activation"] == "tanh"
    with h5py.File(next((root / "out" / "shards").iterdir())) as shard:
        assert json.loads(shard.attrs[IDENTITY_ATTR]) == model_identity.stored(identity)


def test_an_unchanged_factory_reruns_keeping_every_shard(factory_run, monkeypatch):
    root, cfg, package = factory_run
    out = root / "out"
    shards, first = folder_state(out / "shards"), _manifest(out)["model_identity"]
    _fresh_import(monkeypatch)
    assert runner.launcher_loads_model(validate(json.loads(cfg.read_text())), runner.PipelineOptions([])) is False
    assert cli.main(["-q", "run", str(cfg)]) == 0
    manifest = _manifest(out)
    assert manifest["run"]["samples_computed"] == 0 and manifest["run"]["samples_kept"] == 8
    assert folder_state(out / "shards") == shards  # nothing computed again, nothing rewritten
    assert manifest["model_identity"] == first
    assert _calls() == 1  # built by the launcher for its identity; no worker loaded it

    # The factory's own module edited without changing what it builds, and new samples: extended.
    (package / "factory.py").write_text((package / "factory.py").read_text() + "\n# retuned nothing\n")
    _fresh_import(monkeypatch)
    _write(root / "data", "b", 8, seed=1)
    assert cli.main(["-q", "run", str(cfg)]) == 0
    manifest = _manifest(out)
    assert manifest["run"]["samples_computed"] == 8 and manifest["run"]["samples_kept"] == 8
    assert {name: state for name, state in folder_state(out / "shards").items() if name in shards} == shards
    samples = np.concatenate([np.load(root / "data" / "a.npy"), np.load(root / "data" / "b.npy")])
    assert_close(_jacobians(out), tape_loop(_build(), samples), rtol=1e-5)


def test_an_architecture_changed_in_an_imported_module_is_refused_naming_the_layer(factory_run, monkeypatch, capsys):
    """The bug this guards against: the factory's own file is unchanged, the module it imports its layers
    from now says relu. One folder must never hold two models."""
    root, cfg, package = factory_run
    out = root / "out"
    tanh = _jacobians(out)
    arch = package / "arch.py"
    arch.write_text(arch.read_text().replace('activation="tanh"', 'activation="relu"'))
    _fresh_import(monkeypatch)
    _write(root / "data", "b", 8, seed=1)  # something to compute, that the new model must not compute here
    err = _refused(cfg, out, capsys)
    assert "manifest.json: model: layer 'hidden': activation tanh there, relu now (so do 1 shards)" in err, err
    assert "weights differ" not in err and "source code" not in err and "use --overwrite" in err

    _fresh_import(monkeypatch)
    assert cli.main(["-q", "run", str(cfg), "--overwrite"]) == 0
    manifest = _manifest(out)
    assert manifest["run"]["samples_computed"] == 16 and manifest["run"]["samples_kept"] == 0
    assert manifest["model_identity"]["architecture_config"]["config"]["layers"][1]["config"]["activation"] == "relu"
    samples = np.concatenate([np.load(root / "data" / "a.npy"), np.load(root / "data" / "b.npy")])
    relu = _jacobians(out)
    assert_close(relu, tape_loop(_build(), samples), rtol=1e-5)  # every sample from the relu model
    assert not np.allclose(relu[:8], tanh)


def test_a_factory_that_draws_its_weights_on_each_call_is_refused(tmp_path, monkeypatch, capsys):
    """The launcher's model (checked, identified) and the worker's differ: the worker refuses before writing
    a shard, as before identities named what a factory builds. Beside a folder, the launcher refuses."""
    _package(tmp_path, monkeypatch)
    _write(tmp_path / "data", "a", 8, seed=0)
    cfg = validate(json.loads(_config_file(tmp_path, {"factory": "fidpkg.factory:unseeded"}).read_text()))
    with pytest.raises(Exception, match=r"model weights changed since the run was planned \(fingerprint \w+… then"):
        runner.run(cfg, [], show_progress=False)
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists() and not list((out / "shards").glob("*.h5"))

    seeded = _config_file(tmp_path, {"factory": "fidpkg.factory:build"})
    assert cli.main(["-q", "run", str(seeded)]) == 0
    drawn = _config_file(tmp_path, {"factory": "fidpkg.factory:unseeded"})
    err = _refused(drawn, out, capsys)
    assert "manifest.json: written by a different run: model.factory" in err, err  # another config, besides
    assert "manifest.json: model: the weights differ (so do 1 shards)" in err, err


def test_a_subclassed_models_layers_are_in_its_class_code(tmp_path, monkeypatch):
    """A subclassed model's configuration does not list its layers: the source files of the factory's module
    and of the model's class count, as a factory's file did before."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "fidsub.py").write_text(textwrap.dedent(
        '''
        import keras

        class Net(keras.Model):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.d = keras.layers.Dense(2, activation="tanh")

            def call(self, x):
                return self.d(x)
        '''
    ))
    (code / "fidsubfactory.py").write_text("from fidsub import Net\n\ndef build():\n    return Net()\n")
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    from fidsub import Net

    net = Net()
    net(np.zeros((1, 3), np.float32))
    built = SimpleNamespace(keras_model=net, variables=net.weights)
    first = model_identity.built_identity("fidsubfactory:build", built)
    assert first["kind"] == "factory" and first["code"] is not None and first["weights"] is not None
    (code / "fidsub.py").write_text((code / "fidsub.py").read_text().replace('"tanh"', '"relu"'))
    again = model_identity.built_identity("fidsubfactory:build", built)
    assert again["code"] != first["code"]
    assert model_differences.differences(first, again) == ["the factory's source code differs"]


def test_a_factory_identity_recorded_by_an_earlier_jacobeam_is_named_as_such():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    now = model_identity.built_identity("tests.models:small_mlp", SimpleNamespace(keras_model=model, variables=model.weights))
    before = {"kind": "factory", "architecture": None, "weights": None, "code": "c0de", "architecture_config": None}
    assert model_differences.differences(before, now) == [
        "the factory's model was identified by its module's source file there (an earlier jacobeam), by the "
        "model it builds now: the two cannot be compared"
    ]


def test_default_names_are_those_of_a_process_that_built_only_this_model():
    def functional():
        x = keras.Input((3,))
        h = keras.layers.Dense(4, activation="tanh")(x)
        return keras.Model(x, keras.ops.tanh(keras.layers.Dense(4, name="mine")(h)))

    functional()  # the next one's default names are numbered on
    config = json.loads(functional().to_json())
    assert config["config"]["layers"][1]["config"]["name"] != "dense"
    named = model_identity.default_names(config)
    assert [layer["name"] for layer in named["config"]["layers"]] == ["input_layer", "dense", "mine", "tanh"]
    assert named["config"]["input_layers"] == ["input_layer", 0, 0] and named["config"]["output_layers"] == ["tanh", 0, 0]
    assert named["config"]["layers"][1]["config"]["activation"] == "tanh"  # a value, not a name: kept
    assert named == model_identity.default_names(json.loads(functional().to_json()))

    x = keras.Input((3,))  # a name the factory gave is never given to another layer
    clash = keras.Model(x, keras.layers.Dense(2)(keras.layers.Activation("tanh", name="dense")(x)))
    named = model_identity.default_names(json.loads(clash.to_json()))
    assert [layer["name"] for layer in named["config"]["layers"]] == ["input_layer", "dense", "dense_1"]
