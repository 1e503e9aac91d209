"""``model.logits``: the model differentiated without its last layer's softmax, checked against logits
computed by hand in numpy and their closed-form Jacobians."""

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from jacobeam.pipeline import config, runner
from jacobeam.pipeline.identity import run_identity
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import load, without_softmax, wrap_model
from jacobeam.transforms.errors import JacobeamError, ModelError
from jacobeam.transforms.spec import EngineOptions, ModelSource, run_key
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_self_check import _write


def plain_module():
    """A factory returning a callable that is not a Keras model."""

    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.ones((12, 3)))

        def __call__(self, x):
            return tf.nn.softmax(x @ self.w)

    return Module()


def _two_dense(model: keras.Model):
    """The weights of a tanh Dense then a Dense head, as float64 numpy arrays."""
    w1, b1, w2, b2 = (w.astype(np.float64) for w in model.get_weights())
    return w1, b1, w2, b2


def _logits_by_hand(model: keras.Model, x: np.ndarray):
    """Logits ``tanh(x W1 + b1) W2 + b2`` and their Jacobians ``W2^T diag(1 - h^2) W1^T`` (n, m, d)."""
    w1, b1, w2, b2 = _two_dense(model)
    h = np.tanh(x.astype(np.float64) @ w1 + b1)
    return h @ w2 + b2, np.einsum("ki,nk,jk->nij", w2, 1 - h**2, w1)


@pytest.mark.parametrize("build", [test_models.softmax_mlp, test_models.softmax_layer_head], ids=["dense", "layer"])
def test_logits_and_their_jacobians_match_the_hand_computed_ones(build, rng):
    name = build.__name__
    x = rng.normal(size=(9, *build().input_shape[1:])).astype(np.float32)
    logits, jacobians = _logits_by_hand(build(), x)
    loaded = load(factory=f"tests.models:{name}", logits=True)
    assert loaded.fingerprint() == load(factory=f"tests.models:{name}").fingerprint()  # the same weights
    assert_close(loaded.call([tf.constant(x)]).numpy(), logits, rtol=1e-6)

    result = JacobianEngine(loaded, x.shape[1:], EngineOptions(batch_size=4))(x)
    assert_close(result["output"], logits, rtol=1e-6)
    assert_close(result["jacobian"], jacobians, rtol=1e-5)
    assert_close(result["jacobian"], tape_loop(loaded.keras_model, x), rtol=1e-5)

    # Without the key: the probabilities, whose Jacobian is another one.
    probabilities = JacobianEngine(load(factory=f"tests.models:{name}"), x.shape[1:], EngineOptions(batch_size=4))(x)
    np.testing.assert_allclose(probabilities["output"].sum(axis=1), 1, rtol=1e-6)
    assert np.abs(probabilities["jacobian"] - jacobians).max() > 1e-2


def test_the_float64_twin_of_the_logits_model_is_logits_too(rng):
    x = rng.normal(size=(5, 12))
    logits, jacobians = _logits_by_hand(test_models.softmax_mlp(), x)
    loaded = load(factory="tests.models:softmax_mlp", logits=True)
    twin = loaded.with_dtype("float64")
    head = twin.keras_model.layers[-1]
    assert head.dtype == "float64" and head.activation.__name__ == "linear"
    np.testing.assert_allclose(twin.call([tf.constant(x)]).numpy(), logits, rtol=1e-12)
    result = JacobianEngine(loaded, (12,), EngineOptions(batch_size=4, compute_dtype="float64"))(x.astype(np.float32))
    assert_close(result["jacobian"], jacobians.astype(np.float32).astype(np.float64), rtol=1e-6)


def test_the_users_model_is_not_changed(rng):
    model = test_models.softmax_mlp()
    x = rng.normal(size=(3, 12)).astype(np.float32)
    before = model(x).numpy()
    logits = without_softmax(model)
    assert model.layers[-1].activation.__name__ == "softmax"
    assert model.layers[-1].get_config()["activation"] == "softmax"
    np.testing.assert_array_equal(model(x).numpy(), before)
    np.testing.assert_allclose(before.sum(axis=1), 1, rtol=1e-6)
    # softmax(logits) gives the model's outputs back
    np.testing.assert_allclose(tf.nn.softmax(logits(x)).numpy(), before, rtol=1e-5)


def test_an_activation_layer_a_softmax_op_and_a_convolution_lose_their_softmax(rng):
    inputs = keras.Input((5,))
    dense = keras.layers.Dense(4)
    activation = keras.Model(inputs, keras.layers.Activation("softmax")(dense(inputs)))
    op_inputs = keras.Input((5,))
    op_dense = keras.layers.Dense(4)
    op = keras.Model(op_inputs, keras.ops.softmax(op_dense(op_inputs)))
    x = rng.normal(size=(3, 5)).astype(np.float32)
    for model, layer in ((activation, dense), (op, op_dense)):
        kernel, bias = layer.get_weights()
        np.testing.assert_allclose(without_softmax(model)(x).numpy(), x @ kernel + bias, rtol=1e-5, atol=1e-6)

    conv = keras.Sequential([keras.Input((4, 4, 2)), keras.layers.Conv2D(3, 1, activation="softmax")])
    kernel, bias = conv.get_weights()
    images = rng.normal(size=(2, 4, 4, 2)).astype(np.float32)
    logits = wrap_model(without_softmax(conv), "conv")
    np.testing.assert_allclose(logits.call([tf.constant(images)]).numpy(), images @ kernel[0, 0] + bias, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        logits.with_dtype("float64").call([tf.constant(images, tf.float64)]).numpy(),
        images.astype(np.float64) @ kernel[0, 0].astype(np.float64) + bias, rtol=1e-12,
    )


def test_a_keras_application_gives_its_logits(rng):
    model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), alpha=0.35, classes=7)
    assert model.layers[-1].name == "predictions"
    logits = without_softmax(model)
    assert logits.layers[-1].name == "predictions" and logits.layers[-1].activation.__name__ == "linear"
    x = rng.normal(size=(2, 32, 32, 3)).astype(np.float32)
    z = logits(x, training=False).numpy()
    # log softmax(z) = z - logsumexp(z): the log-probabilities and the logits differ by one number per sample
    shift = np.log(model(x, training=False).numpy()) - z
    np.testing.assert_allclose(shift, shift[:, :1].repeat(7, axis=1), atol=1e-4)
    twin = wrap_model(logits, "mobilenet").with_dtype("float64")
    assert_close(twin.call([tf.constant(x, tf.float64)]).numpy(), z, rtol=1e-4)


def test_a_model_without_softmax_and_a_model_that_is_not_keras_are_refused(tmp_path):
    cases = [
        (dict(factory="tests.models:small_mlp"),
         r"^model.logits: factory:tests.models:small_mlp: its last layer 'dense\w*' \(Dense\) has activation 'linear', "
         r"not softmax: there are no logits to take$"),
        (dict(factory="tests.models:scalar_model"),
         r"^model.logits: factory:tests.models:scalar_model: its last layer 'reshape\w*' \(Reshape\) has no activation, "
         r"not softmax"),
        (dict(builtin="mlp"), r"^model.logits: builtin:mlp: its last layer 'dense\w*' \(Dense\) has activation 'linear'"),
        (dict(factory="tests.test_logits:plain_module"),
         r"^model.logits: factory:tests.test_logits:plain_module is not a Keras model \(a SavedModel or tf.Module\)"),
    ]
    tanh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="tanh", name="head")])
    tanh.save(tmp_path / "tanh.keras")
    cases.append((dict(path=str(tmp_path / "tanh.keras")), r"its last layer 'head' \(Dense\) has activation 'tanh'"))
    module = plain_module()
    tf.saved_model.save(module, str(tmp_path / "module"), signatures=tf.function(
        module.__call__, input_signature=[tf.TensorSpec((None, 12), tf.float32)]))
    cases.append((dict(path=str(tmp_path / "module")), r"module is not a Keras model \(a SavedModel or tf.Module\)"))
    for source, message in cases:
        with pytest.raises(ModelError, match=message) as caught:
            load(**source, logits=True)
        assert "\n" not in str(caught.value), source
        with pytest.raises(ModelError, match=message):
            ModelSource(**source, logits=True).load()
    load(factory="tests.models:small_mlp")  # without the key: loads


def _cfg(data, out, **model):
    return config.validate({
        "model": {"factory": "tests.models:softmax_mlp", **model},
        "input": {"paths": [str(data / "*.npy")]},
        "jacobian": {"batch_size": 4},
        "output": {"path": str(out), "samples_per_shard": 16},
    })


def test_the_config_key_defaults_to_false_and_enters_the_run_identity(tmp_path):
    plain, logits = _cfg(tmp_path, tmp_path / "out"), _cfg(tmp_path, tmp_path / "out", logits=True)
    assert plain.model.logits is False and logits.model.logits is True
    with pytest.raises(config.ConfigError, match=r"model.logits"):
        _cfg(tmp_path, tmp_path / "out", logits="maybe")
    raw = {"model": {"factory": "tests.models:softmax_mlp"}, "input": {"paths": ["*.npy"]}, "output": {"path": "out"}}
    assert config.load(None, ["model.logits=true"], base=raw).model.logits is True  # --set model.logits=true
    plain_identity, logits_identity = run_identity(config.to_dict(plain)), run_identity(config.to_dict(logits))
    assert "model.logits" not in plain_identity  # a run without the key keeps the run key it had
    assert logits_identity == {**plain_identity, "model.logits": True}
    assert run_key(plain_identity) != run_key(logits_identity)


def test_a_run_with_logits_stores_their_jacobians_and_does_not_share_shards(tmp_path):
    samples = _write(tmp_path / "data")
    logits, jacobians = _logits_by_hand(test_models.softmax_mlp(), samples)
    out = tmp_path / "out"
    manifest = runner.run(_cfg(tmp_path / "data", out, logits=True), [], show_progress=False).manifest
    assert manifest["config"]["model"]["logits"] is True and manifest["run_identity"]["model.logits"] is True
    with h5py.File(out / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], np.arange(len(samples)))
        assert_close(view["output"][:], logits, rtol=1e-6)
        assert_close(view["jacobian"][:], jacobians, rtol=1e-5)
    report = verify(out, samples=4)  # recomputes the logits' Jacobians (from the manifest's model config)
    assert report.ok, report.problems
    assert len(report.samples) == 4
    # The recomputation follows the manifest's model.logits: told the shards hold probabilities, it disagrees.
    manifest_file = out / "manifest.json"
    original = manifest_file.read_text()
    manifest_file.write_text(original.replace('"logits": true', '"logits": false'))
    told = verify(out, samples=2)
    assert original != manifest_file.read_text() and not told.ok
    assert any("; output too" in problem or ": output differs" in problem for problem in told.problems), told.problems
    manifest_file.write_text(original)
    # A run without logits does not take the folder as its own.
    with pytest.raises(JacobeamError, match=r"written by a different run: model.logits is true there, false in this run"):
        runner.run(_cfg(tmp_path / "data", out), [], show_progress=False)
