"""Loading models from every supported source gives the same function and the same fingerprint."""

import numpy as np
import pytest
import tensorflow as tf

from jacobeam.transforms.engine.models import load
from jacobeam.transforms.errors import ModelError
from tests import models as test_models


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    model = test_models.small_mlp()
    model.save(folder / "mlp.keras")
    model.export(str(folder / "mlp_savedmodel"), verbose=False)

    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.arange(12 * 5, dtype=np.float32).reshape(12, 5) / 60)

        @tf.function(input_signature=[tf.TensorSpec((None, 12), tf.float32)])
        def __call__(self, x):
            return tf.tanh(x @ self.w)

    tf.saved_model.save(Module(), str(folder / "module_savedmodel"))
    return folder, model


def test_keras_file_and_exported_savedmodel_match_the_model(saved, rng):
    folder, model = saved
    x = rng.normal(size=(4, 12)).astype(np.float32)
    for path in (folder / "mlp.keras", folder / "mlp_savedmodel"):
        loaded = load(path=str(path))
        np.testing.assert_allclose(loaded.call([tf.constant(x)]).numpy(), model(x).numpy(), rtol=1e-6)
    assert load(path=str(folder / "mlp.keras")).fingerprint() == load(factory="tests.models:small_mlp").fingerprint()


def test_plain_tf_module_savedmodel_is_called_directly(saved, rng):
    folder, _ = saved
    loaded = load(path=str(folder / "module_savedmodel"))
    x = rng.normal(size=(3, 12)).astype(np.float32)
    expected = np.tanh(x @ (np.arange(60, dtype=np.float32).reshape(12, 5) / 60))
    np.testing.assert_allclose(loaded.call([tf.constant(x)]).numpy(), expected, rtol=1e-5)


def test_model_errors_name_the_source(tmp_path):
    with pytest.raises(ModelError, match=r"model.path .*nothing.keras: no such file"):
        load(path=str(tmp_path / "nothing.keras"))
    with pytest.raises(ModelError, match=r"model.factory 'tests.models:nope': cannot import"):
        load(factory="tests.models:nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match=r"weights.bin: expected a .keras file or a SavedModel directory"):
        load(path=str(tmp_path / "weights.bin"))
