"""ImageNet-size conv nets (ResNet50, MobileNetV2, EfficientNetB0 at 224x224x3, seeded weights, nothing
downloaded) against float64 copies of themselves: the truth.

On these nets every float32 gradient is about 1e-3 off the float64 one (TensorFlow's own per-sample
tape included), so the stored float32 values are judged against what TensorFlow's own float32 gradient
of one sample achieves on the same samples, and float64 runs against the float64 copy within 1e-6.
The float64 copies are built here with Keras alone (``keras.config.set_dtype_policy("float64")`` before
the model, weights cast), not with jacobeam's ``LoadedModel.with_dtype``, and checked to compute in
float64. Slow: minutes on two cores; CI runs them.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.workloads import APPLICATIONS
from jacobeam.pipeline import config, runner
from jacobeam.transforms import self_check
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.output.storage import sha256
from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction, SelfCheck

pytestmark = pytest.mark.slow

PREPROCESS = {
    "resnet50": keras.applications.resnet50.preprocess_input,
    "mobilenet_v2": keras.applications.mobilenet_v2.preprocess_input,
    "efficientnet_b0": keras.applications.efficientnet.preprocess_input,
}
SALIENCY = EngineOptions(outputs=OutputSelection("label"), reduce=Reduction("sum_abs_over_channels"))


class Net:
    """One architecture: its float32 model, a float64 copy, and seeded images with labels."""

    def __init__(self, name: str, samples: int = 11):
        self.name = name
        self.model = APPLICATIONS[name]()
        policy = keras.config.dtype_policy()
        keras.config.set_dtype_policy("float64")
        try:
            keras.utils.set_random_seed(0)
            self.twin = getattr(keras.applications, type_name(name))(weights=None)
        finally:
            keras.config.set_dtype_policy(policy)
        self.twin.set_weights([w.astype(np.float64) for w in self.model.get_weights()])
        computing = [layer for layer in self.twin.layers if not isinstance(layer, keras.layers.InputLayer)]
        assert {layer.compute_dtype for layer in computing} == {"float64"}
        rng = np.random.default_rng(0)
        self.x = PREPROCESS[name](rng.uniform(0, 255, (samples, 224, 224, 3)).astype(np.float32))
        self.labels = rng.integers(0, 1000, samples)
        self.f32 = _saliency_function(self.model, tf.float32)
        self.f64 = _saliency_function(self.twin, tf.float64)
        self._done: dict[str, dict[int, np.ndarray]] = {}

    def truth(self, rows: slice) -> np.ndarray:
        """Float64 label saliency of the samples ``rows``, one sample per call (each computed once per net)."""
        return self._per_sample("float64", rows)

    def tape(self, rows: slice) -> np.ndarray:
        """TensorFlow's own float32 label saliency of the samples ``rows``, one sample per call."""
        return self._per_sample("float32", rows)

    def _per_sample(self, dtype: str, rows: slice) -> np.ndarray:
        function, done = {"float64": self.f64, "float32": self.f32}[dtype], self._done.setdefault(dtype, {})
        ids = np.arange(len(self.x))[rows]
        for i in ids:
            if i not in done:
                done[i] = function(self.x[i : i + 1].astype(dtype), self.labels[i : i + 1]).numpy()
        return np.concatenate([done[i] for i in ids])


def type_name(name: str) -> str:
    return {"resnet50": "ResNet50", "mobilenet_v2": "MobileNetV2", "efficientnet_b0": "EfficientNetB0"}[name]


def _saliency_function(model, dtype):
    @tf.function(input_signature=[tf.TensorSpec((None, 224, 224, 3), dtype), tf.TensorSpec((None,), tf.int64)])
    def saliency(images, labels):
        with tf.GradientTape() as tape:
            tape.watch(images)
            chosen = tf.reduce_sum(tf.gather(model(images, training=False), labels, batch_dims=1))
        return tf.reduce_sum(tf.abs(tape.gradient(chosen, images)), axis=-1)

    return saliency


def errors(values: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per sample: max |value - truth| / max |truth|."""
    values, truth = (np.asarray(a, np.float64).reshape(len(truth), -1) for a in (values, truth))
    return np.abs(values - truth).max(axis=1) / np.abs(truth).max(axis=1)


def no_worse_than_tensorflow(stored: np.ndarray, truth: np.ndarray, *tensorflow: np.ndarray) -> None:
    """The stored values' error against float64 is at most twice that of TensorFlow's own float32
    gradients (per sample, and batched where given), or 1e-4, whichever is larger: in the median and at
    the worst sample."""
    ours, theirs = errors(stored, truth), [errors(values, truth) for values in tensorflow]
    for statistic in (np.median, np.max):
        assert statistic(ours) <= max(*(2 * statistic(e) for e in theirs), 1e-4), (ours, theirs)


@pytest.fixture(scope="module", params=list(PREPROCESS))
def net(request):
    return Net(request.param)


def test_label_saliency_at_batch_sizes_one_after_another_is_no_worse_than_tensorflow_float32(net):
    truth, tape = net.truth(slice(None)), net.tape(slice(None))
    assert np.median(errors(tape, truth)) > 1e-6  # float32 itself is off on these nets: the test can tell
    # In one process, a new engine each; of 11 samples, batch 7 makes two batches (the last of 4), the
    # default (256) one batch of 11.
    for batch in (1, 7, SALIENCY.batch_size):
        engine = JacobianEngine(wrap_model(net.model, net.name), (224, 224, 3), EngineOptions(
            batch_size=batch, outputs=SALIENCY.outputs, reduce=SALIENCY.reduce))
        stored = np.concatenate([
            engine(net.x[lo : lo + batch], net.labels[lo : lo + batch])["saliency"] for lo in range(0, len(net.x), batch)
        ])
        assert stored.shape == (len(net.x), 1, 224, 224)
        no_worse_than_tensorflow(stored, truth, tape)


def test_top_k_rows_and_a_projection_are_no_worse_than_tensorflow_float32(net):
    """Judged over all samples and rows together, against TensorFlow's float32 gradients of one sample and
    of the batch: one row of one sample can be 10x off TensorFlow's batch-1 gradient where the batch-1
    kernels happen to round luckier than any batched computation (docs/verifying.md), as it can be 10x
    better."""
    x = net.x[:4]
    engine = JacobianEngine(wrap_model(net.model, net.name), (224, 224, 3), EngineOptions(outputs=OutputSelection("top_k", k=3)))
    stored = engine(x)
    rows = stored["output_index"]
    truth = np.concatenate([_rows(net.twin, x[i : i + 1].astype(np.float64), rows[i], tf.float64) for i in range(len(x))])
    tape = np.concatenate([_rows(net.model, x[i : i + 1], rows[i], tf.float32) for i in range(len(x))])
    batched = np.stack([_batched_rows(net.model, x, rows[:, j]) for j in range(3)], axis=1).reshape(truth.shape)
    no_worse_than_tensorflow(stored["jacobian"].reshape(truth.shape), truth, tape, batched)
    # reduce: project (J P for 4 seeded columns) of output row 7 (one row: reverse mode, then the product),
    # against that row of the float64 copy's Jacobian times the engine's projection matrix.
    projected = JacobianEngine(wrap_model(net.model, net.name), (224, 224, 3), EngineOptions(
        outputs=OutputSelection("indices", indices=(7,)), reduce=Reduction("project", project_dim=4)))
    result = projected(x)["projection"].reshape(len(x), 4)
    basis = projected.operands.right  # (4, 150528): the projection's columns as the engine applies them
    seven = np.array([7])
    truth = np.concatenate([_rows(net.twin, x[i : i + 1].astype(np.float64), seven, tf.float64) for i in range(len(x))])
    tape = np.concatenate([_rows(net.model, x[i : i + 1], seven, tf.float32) for i in range(len(x))])
    batched = _batched_rows(net.model, x, np.full(len(x), 7))
    no_worse_than_tensorflow(result, *(values.reshape(len(x), -1) @ basis.T for values in (truth, tape, batched)))


_PULLS: dict[int, object] = {}


def _rows(model, x, rows, dtype) -> np.ndarray:
    """The Jacobian rows ``rows`` of one sample, one compiled backward pass each: ``(len(rows), 224, 224, 3)``."""
    if id(model) not in _PULLS:

        @tf.function(input_signature=[tf.TensorSpec((1, 224, 224, 3), dtype), tf.TensorSpec((), tf.int32)])
        def pull(x, row):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = model(x, training=False)[0, row]
            return tape.gradient(y, x)[0]

        _PULLS[id(model)] = pull
    pull = _PULLS[id(model)]
    return np.stack([pull(tf.constant(x, dtype), tf.constant(int(row), tf.int32)).numpy() for row in rows]).astype(np.float64)


def _batched_rows(model, x, rows) -> np.ndarray:
    """Row ``rows[i]`` of each sample's Jacobian in one batched backward pass (TensorFlow's own batched
    float32 gradient): ``(n, 224, 224, 3)``."""
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(tf.gather(model(x, training=False), tf.constant(rows), batch_dims=1))
    return tape.gradient(y, x).numpy().astype(np.float64)


def test_compute_dtype_float64_is_within_1e_6_of_the_float64_copy(net):
    engine = JacobianEngine(wrap_model(net.model, net.name), (224, 224, 3), EngineOptions(
        outputs=SALIENCY.outputs, reduce=SALIENCY.reduce, compute_dtype="float64", store_dtype="float64"))
    stored = engine(net.x[:4], net.labels[:4])["saliency"]
    assert stored.dtype == np.float64
    assert errors(stored, net.truth(slice(0, 4))).max() <= 1e-6


def test_the_self_check_passes_good_values_and_fails_a_value_ten_times_the_float32_noise(net):
    """The self-check's bound follows float32's own error on the sample; a stored value 10x as far from
    the float64 truth as every independent float32 computation the check measures still fails."""
    engine = JacobianEngine(wrap_model(net.model, net.name), (224, 224, 3), SALIENCY)
    checker = self_check.SelfChecker(engine, SelfCheck())
    stored = engine(net.x[:4], net.labels[:4])
    truth = net.truth(slice(0, 4))
    noisiest = int(np.argmax(errors(net.tape(slice(0, 4)), truth)))
    row = lambda i: {k: v[i : i + 1] for k, v in stored.items()}  # noqa: E731
    records = [checker.check([net.x[i : i + 1]], row(i), i, int(net.labels[i])) for i in range(4)]
    assert all(record["verdict"] == "ok" for record in records), records
    assert records[0]["truth"] == self_check.TRUTH_FLOAT64
    # The record's error is the stored value's against the float64 truth, as computed here independently.
    for i, record in enumerate(records):
        independent = errors(stored["saliency"][i : i + 1], truth[i : i + 1])[0]
        assert record["errors"]["saliency"] == pytest.approx(independent, rel=0.02, abs=1e-7)

    i = noisiest
    (own, twin), _ = checker._references()
    xs, index = [net.x[i : i + 1]], stored["output_index"][i : i + 1]
    reference = checker.datasets(twin, [net.x[i : i + 1].astype(np.float64)], index)[0]["saliency"]
    noise = max(errors(checker.datasets(own, xs, index, pad=pad)[0]["saliency"], reference)[0] for pad in (False, True))
    noise = max(noise, 1e-4 / 4)
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=reference.shape)
    wrong = reference + 10 * noise * np.abs(reference).max() * signs
    record = checker.check(xs, {**row(i), "saliency": wrong.astype(np.float32)}, i, int(net.labels[i]))
    assert record["verdict"] == "mismatch" and record["dataset"] == "saliency", record


def test_a_run_at_the_defaults_completes_with_its_precision_reported_and_resumes_bit_for_bit(tmp_path):
    """MobileNetV2 label saliency through ``jacobeam run``'s runner, every key but the shard size at its
    default (self-check on, on_mismatch fail); a shard deleted and the run resumed gives the same bytes."""
    name = "mobilenet_v2"
    rng = np.random.default_rng(3)
    data = tmp_path / "images.npz"
    np.savez(data, x=PREPROCESS[name](rng.uniform(0, 255, (20, 224, 224, 3)).astype(np.float32)), y=rng.integers(0, 1000, 20))
    cfg = config.validate({
        "model": {"factory": f"benchmarks.workloads:{name}"},
        "input": {"paths": [str(data)], "key": "x"},
        "jacobian": {"outputs": "label", "labels": {"key": "y"}, "reduce": "sum_abs_over_channels"},
        "output": {"path": str(tmp_path / "out"), "samples_per_shard": 8},
    })
    manifest = runner.run(cfg, [], show_progress=False).manifest
    summary = manifest["self_check"]
    assert summary["samples_checked"] == 3 and summary["mismatches"] == []  # one per shard of 8 (4 per 4,096 ids)
    precision = summary["precision"]
    assert precision["against"] == self_check.TRUTH_FLOAT64 and precision["samples"] == 3
    assert 0 < precision["datasets"]["saliency"]["error"]["median"] <= precision["datasets"]["saliency"]["error"]["max"]
    shards = sorted((tmp_path / "out" / "shards").iterdir())
    before = {p.name: sha256(p) for p in shards}
    shards[1].unlink()
    (tmp_path / "out" / "manifest.json").unlink()
    resumed = runner.run(cfg, [], show_progress=False).manifest
    assert resumed["run"]["samples_computed"] == 8 and resumed["run"]["samples_kept"] == 12
    assert {p.name: sha256(p) for p in sorted((tmp_path / "out" / "shards").iterdir())} == before
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["self_check"]["mismatches"] == []
