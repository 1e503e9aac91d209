"""The self-check's references (``transforms.self_check``): a selection's reference differentiates only
the selected rows, the reverse reference is the closed-form Jacobian of every input asked for (also in
chunks and with another batch shape), and a reference in another dtype, or without a float64 copy of the
model, is named in the record."""


import numpy as np
import pytest

from jacobeam.pipeline import config, self_check_report
from jacobeam.transforms import self_check
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.spec import EngineOptions, SelfCheck


@pytest.mark.parametrize("outputs", ["label", "argmax", [3, 0], {"top_k": 2}])
def test_the_reference_of_a_selection_differentiates_only_its_rows_and_agrees_with_the_full_jacobian(outputs):
    """With a label of 1,000 classes the full per-sample Jacobian of an ImageNet-size model is a thousand
    backward passes (measured: a MobileNetV2 run's self-check took 19.8 GB and was killed); the reference
    differentiates the stored rows only, and they are the full Jacobian's rows (``tape.jacobian``)."""
    import tensorflow as tf

    from tests.models import small_mlp

    model = small_mlp()
    raw = {"batch_size": 4, "outputs": outputs}
    if outputs == "label":
        raw["labels"] = {"key": "y"}
    options = config.validate(
        {"model": {"factory": "tests.models:small_mlp"}, "input": {"paths": ["x.npy"]}, "jacobian": raw, "output": {"path": "o"}}
    ).jacobian
    engine = JacobianEngine(wrap_model(model, "small_mlp"), (12,), options.engine_options())
    x = np.random.default_rng(3).normal(size=(3, 12)).astype(np.float32)
    labels = np.array([4, 0, 2])
    stored = engine(x, labels if outputs == "label" else None)
    check = self_check.SelfChecker(engine, SelfCheck(samples=1))
    (function, _), _ = check._references()
    index = stored["output_index"].astype(np.int32)
    _, (rows,) = function(x, index)  # the three samples in one call, each its own rows
    assert rows.shape == (3, index.shape[1], 12)
    for row in range(3):
        with tf.GradientTape() as tape:
            sample = tf.constant(x[row : row + 1])
            tape.watch(sample)
            y = model(sample)
        full = tape.jacobian(y, sample).numpy().reshape(5, 12)
        np.testing.assert_allclose(rows[row], full[index[row]], rtol=1e-5, atol=1e-7)
        label = int(labels[row]) if outputs == "label" else None
        record = check.check([x[row : row + 1]], {name: value[row : row + 1] for name, value in stored.items()}, row, label)
        assert record["verdict"] == "ok", record


@pytest.mark.parametrize("forward", [False, True])
def test_the_reference_is_the_closed_form_jacobian_of_every_input_asked_for_of_each_sample(forward):
    """The reverse-mode reference (one pulled-back one-hot row per copy of a sample) and the forward-mode
    one (one JVP per input entry), for several samples in one call, against the closed form of ``y =
    tanh(x1 A + x2 B)``: ``dy/dx1 = diag(1 - y^2) A^T``, per sample, for all rows and (reverse) chosen ones."""
    import tensorflow as tf

    from jacobeam.transforms.engine import reference

    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(6, 4)), rng.normal(size=(3, 4))
    x1, x2 = rng.normal(size=(3, 6)), rng.normal(size=(3, 3))

    def call(xs):
        return tf.tanh(xs[0] @ tf.constant(a, xs[0].dtype) + xs[1] @ tf.constant(b, xs[1].dtype))

    y = np.tanh(x1 @ a + x2 @ b)
    function = reference.tape_function(call, [(6,), (3,)], forward=forward, dtype="float64")
    out, jacobians = function(x1, x2)
    np.testing.assert_allclose(np.asarray(out), y, rtol=1e-12)
    for jacobian, weights, size in zip(jacobians, (a, b), (6, 3)):
        assert jacobian.shape == (3, 4, size)
        for i in range(3):
            np.testing.assert_allclose(jacobian[i], (1 - y[i] ** 2)[:, None] * weights.T, rtol=1e-12, atol=1e-14)
    if forward:
        return
    second = reference.tape_function(call, [(6,), (3,)], dtype="float64", wrt=[1], rows=True)
    chosen = np.array([[3, 1, 3], [0, 0, 2], [2, 3, 1]])
    _, (rows,) = second(x1, x2, chosen)
    assert rows.shape == (3, 3, 3)
    for i in range(3):
        np.testing.assert_allclose(rows[i], ((1 - y[i] ** 2)[:, None] * b.T)[chosen[i]], rtol=1e-12, atol=1e-14)


def test_the_forward_reference_along_vectors_in_chunks_across_samples_is_the_closed_form():
    """Forward mode along the rows of ``R`` (a ``jvp``/``project`` product), ``chunk`` copies per call (a
    chunk holding copies of two samples): each sample's ``J R^T`` of ``y = tanh(x A)``."""
    import tensorflow as tf

    from jacobeam.transforms.engine import reference

    rng = np.random.default_rng(7)
    a, x, r = rng.normal(size=(6, 4)), rng.normal(size=(3, 6)), rng.normal(size=(5, 6))
    function = reference.tape_function(lambda xs: tf.tanh(xs[0] @ tf.constant(a)), [(6,)], forward=True,
                                       dtype="float64", directions=r, chunk=4)
    out, (product,) = function(x)
    assert product.shape == (3, 4, 5)
    np.testing.assert_allclose(out, np.tanh(x @ a), rtol=1e-12)
    for i in range(3):
        expected = ((1 - np.tanh(x[i] @ a) ** 2)[:, None] * a.T) @ r.T
        np.testing.assert_allclose(product[i], expected, rtol=1e-12, atol=1e-14)


def test_the_reverse_reference_in_chunks_across_samples_and_with_another_batch_shape_is_the_same_closed_form():
    """Rows of two samples pulled back through their copies, ``chunk`` copies per call (a chunk holding
    copies of both, the last one shorter), and with one more copy per batch (``pad``): each sample's is
    ``diag(1 - y^2) A^T`` of ``y = tanh(x A)``."""
    import tensorflow as tf

    from jacobeam.transforms.engine import reference

    rng = np.random.default_rng(6)
    a, x = rng.normal(size=(5, 7)), rng.normal(size=(2, 5))
    function = reference.tape_function(lambda xs: tf.tanh(xs[0] @ tf.constant(a)), [(5,)], dtype="float64", chunk=3)
    for pad in (False, True):
        out, (jacobian,) = function(x, pad=pad)
        assert jacobian.shape == (2, 7, 5)
        np.testing.assert_allclose(np.asarray(out), np.tanh(x @ a), rtol=1e-12)
        for i in range(2):
            np.testing.assert_allclose(jacobian[i], (1 - np.tanh(x[i] @ a) ** 2)[:, None] * a.T, rtol=1e-12, atol=1e-14)


def test_a_reference_that_computes_in_another_dtype_is_named():
    """The float64 truth must compute in float64 throughout: a cast to float32 inside is found."""
    import tensorflow as tf

    from jacobeam.transforms.engine import reference

    exact = reference.tape_function(lambda xs: tf.tanh(xs[0]), [(3,)], dtype="float64")
    assert reference.foreign_float_op(exact.graph, "float64") is None
    lossy = reference.tape_function(lambda xs: tf.cast(tf.tanh(tf.cast(xs[0], tf.float32)), tf.float64), [(3,)], dtype="float64")
    found = reference.foreign_float_op(lossy.graph, "float64")
    assert found is not None and "float32" in found


def test_without_a_float64_copy_the_truth_is_the_compute_dtype_reference_and_the_record_says_why():
    """A model that is not Keras (a plain callable of known weights) has no float64 copy: the check runs
    against the float32 per-sample reference, the noise is its spread over two batch shapes, and a
    corrupted value still fails."""
    import tensorflow as tf

    from jacobeam.transforms.engine.models import LoadedModel

    w = tf.constant(np.random.default_rng(2).normal(size=(6, 3)), tf.float32)
    loaded = LoadedModel(lambda xs: tf.tanh(xs[0] @ w), [], "plain")
    engine = JacobianEngine(loaded, (6,), EngineOptions(batch_size=4))
    checker = self_check.SelfChecker(engine, SelfCheck())
    x = np.random.default_rng(3).normal(size=(4, 6)).astype(np.float32)
    stored = engine(x)
    row = {name: values[:1] for name, values in stored.items()}
    record = checker.check([x[:1]], row, 0)
    assert record["verdict"] == "ok" and record["truth"].startswith("no float64 copy:")
    assert record["errors"]["jacobian"] < 1e-5
    wrong = checker.check([x[:1]], {**row, "jacobian": 1.01 * row["jacobian"]}, 0)
    assert wrong["verdict"] == "mismatch" and wrong["max_rel_error"] == pytest.approx(0.01, rel=0.05)
    line = self_check_report.precision_line({"precision": self_check.precision([record])}, "float32")
    assert line.startswith("jacobian: float32 error against the float32 per-sample reference (no float64 copy:")


def test_the_precision_line_says_identical_where_there_is_no_error():
    """A float64 run stores what the float64 copy computes, once both are rounded to the stored dtype: the
    line says so rather than "median 0, max 0"."""
    exact = {"median": 0.0, "max": 0.0}
    summary = {"precision": {"against": self_check_report.TRUTH_FLOAT64, "samples": 3, "datasets": {
        "jacobian": {"error": exact, "noise": exact, "passed_max": 0.0},
        "output": {"error": exact, "noise": exact, "passed_max": 0.0},
    }}}
    line = self_check_report.precision_line(summary, "float64")
    assert line == (f"jacobian: float64 values identical, as stored, to those of a "
                    f"{self_check_report.TRUTH_FLOAT64} on 3 checked sample(s)")


@pytest.mark.parametrize(("store_dtype", "passed_max", "hint"), [
    ("float32", 6e-4, True), ("float16", 6e-4, False), ("float16", 5e-3, True), ("bfloat16", 5e-3, False),
    ("float32", 5e-5, False),
])
def test_the_precision_line_suggests_float64_only_where_storing_is_not_what_limits_it(store_dtype, passed_max, hint):
    """float16 stores values 4.9e-4 off by its rounding alone: computing in float64 would not bring them nearer."""
    error = {"median": passed_max / 3, "max": passed_max}
    summary = {"precision": {"against": self_check_report.TRUTH_FLOAT64, "samples": 3, "datasets": {
        "jacobian": {"error": error, "noise": error, "passed_max": passed_max}}}}
    line = self_check_report.precision_line(summary, "float32", store_dtype)
    assert line.endswith("; jacobian.compute_dtype: float64 for more") == hint, line
    stored = f" stored as {store_dtype}" if store_dtype in ("float16", "bfloat16") else ""
    assert line.startswith(f"jacobian: float32{stored} error against"), line


def test_prepare_builds_the_references_beside_the_batches_and_a_failure_is_the_first_checks():
    """``prepare`` (a run's worker calls it at set-up) builds, traces and calls the references once on a
    thread of its own: the first check then finds them built, and judges as one that built them would. If
    building fails there, the first check builds them again and raises what went wrong."""
    from tests.models import small_mlp

    engine = JacobianEngine(wrap_model(small_mlp(), "small_mlp"), (12,), EngineOptions(batch_size=4))
    x = np.random.default_rng(5).normal(size=(2, 12)).astype(np.float32)
    stored = engine(x)
    row = {name: value[:1] for name, value in stored.items()}

    inline = self_check.SelfChecker(engine, SelfCheck())
    expected = inline.check([x[:1]], row, 0)
    assert expected["timing"]["traced"] and expected["verdict"] == "ok"

    prepared = self_check.SelfChecker(engine, SelfCheck())
    prepared.prepare()
    prepared.prepare()  # once
    thread = prepared._preparing
    thread.join(60)
    assert not thread.is_alive() and prepared._functions is not None
    record = prepared.check([x[:1]], row, 0)
    assert not record["timing"]["traced"]  # built by prepare
    assert {k: v for k, v in record.items() if k != "timing"} == {k: v for k, v in expected.items() if k != "timing"}
    wrong = prepared.check([x[:1]], {**row, "jacobian": 1.5 * row["jacobian"]}, 0)
    assert wrong["verdict"] == "mismatch"

    broken = self_check.SelfChecker(engine, SelfCheck())
    broken._function = lambda model, dtype: (_ for _ in ()).throw(RuntimeError("no reference here"))
    broken.prepare()
    broken._preparing.join(60)
    assert broken._functions is None
    with pytest.raises(RuntimeError, match="no reference here"):
        broken.check([x[:1]], row, 0)
