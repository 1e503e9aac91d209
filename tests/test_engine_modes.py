"""Engine modes and multi-input models, and the checks that keep a path only where it agrees with the
reference, each against an independent reference. XLA: ``test_engine_xla.py``; memory budget and
out-of-memory retries: ``test_engine_memory.py``."""


import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from jacobeam.transforms.compute import build_engine
from jacobeam.transforms.engine import JacobianEngine, reverse_layer_rules
from jacobeam.transforms.engine import blocks as strategies
from jacobeam.transforms.engine.models import seeded_weights, wrap_model
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.output.layout import ENGINE_PLAN
from jacobeam.transforms.spec import EngineOptions, ModelSource, OutputSelection
from tests import models as test_models
from tests.engines import engine as _engine
from tests.engines import samples as _samples
from tests.reference import assert_close, central_differences, tape_loop


@pytest.mark.parametrize("mode", ["reverse", "reverse_loop", "forward"])
@pytest.mark.parametrize("build", [test_models.small_cnn, test_models.grid_model], ids=["cnn", "grid"])
def test_each_mode_matches_the_tape_loop(mode, build):
    model = build()
    x = _samples(model, 11)
    engine = _engine(model, mode=mode)
    assert engine.describe()["mode"] == mode
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_forward_and_reverse_agree_and_auto_picks_by_size():
    model = test_models.grid_model()  # 12 inputs, 6 outputs
    x = _samples(model, 9)
    forward, reverse = _engine(model, mode="forward")(x), _engine(model, mode="reverse")(x)
    assert_close(forward["jacobian"], reverse["jacobian"].astype(np.float64), rtol=1e-6)
    assert _engine(model, mode="auto").describe()["mode"] == "reverse"
    assert _engine(test_models.upsampler(), mode="auto", check_batch_independence=True).describe()["mode"] != "forward"


def test_forward_mode_runs_by_double_reverse_where_it_agrees_with_the_accumulator():
    model = test_models.coupling_flow()  # square: auto runs forward mode
    x = _samples(model, 9)
    engine = _engine(model, mode="auto")
    described = engine.describe()
    assert (described["mode"], described["double_reverse"]) == ("forward", True)
    assert [c["path"] for c in described["candidates"]] == ["forward, eagerly", "forward by double reverse"]
    assert described["candidates"][1]["relative_error"] < 1e-5
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


@pytest.mark.parametrize("operand", ["identity", "index", "matrix"])
@pytest.mark.parametrize(("rows", "start"), [(6, 0), (2, 3)], ids=["all rows", "a block"])
def test_reverse_mode_run_eagerly_is_the_tape_loop(operand, rows, start):
    """The eager reverse reference (one-hot cotangents through copies of the batch) gives every sample's
    rows of ``L J``: all of them or a block from ``start``, of the identity, of chosen rows per sample, or
    of a matrix of vectors, as a per-sample tape loop does."""
    model = test_models.grid_model()  # 12 inputs, 6 outputs
    x = _samples(model, 5)
    full = tape_loop(model, x).reshape(5, 6, 12)
    rng = np.random.default_rng(4)
    if operand == "index":
        given = np.stack([rng.permutation(6) for _ in range(5)]).astype(np.int32)  # (n, 6): a row order per sample
        expected = np.take_along_axis(full, given[:, :, None], axis=1)
    elif operand == "matrix":
        given = rng.normal(size=(6, 6)).astype(np.float32)
        expected = np.einsum("rm,nmd->nrd", given, full)
    else:
        given, expected = np.zeros((0, 0), np.float32), full
    block = strategies.build_block(
        "reverse", lambda xs: model(xs[0]), [(4, 3)], 0, rows, 6, tf.float32, False, operand=operand, eager=True)
    y, found = block([x], tf.constant(start), tf.constant(given))
    assert_close(np.asarray(y), model(x).numpy().reshape(5, -1), rtol=1e-6)
    assert_close(np.asarray(found), expected[:, start : start + rows], rtol=1e-5)


def test_double_reverse_that_disagrees_with_the_accumulator_is_not_used(monkeypatch):
    """Double reverse is a fast path with a known wrong case (zeros through image resizing, where the
    accumulator reports the dropped tangent): it runs only after agreeing on the probe batch."""
    build_block = strategies.build_block

    def wrong_double_reverse(*args, double_reverse=False, **kwargs):
        block = build_block(*args, double_reverse=double_reverse, **kwargs)
        if not double_reverse:
            return block

        def wrong(*inputs):
            y, columns = block(*inputs)
            return y, columns * 1.5

        wrong.experimental_get_tracing_count = block.experimental_get_tracing_count
        return wrong

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", wrong_double_reverse)
    model = test_models.coupling_flow()
    x = _samples(model, 9)
    engine = _engine(model, mode="forward")
    described = engine.describe()
    assert (described["mode"], described["double_reverse"]) == ("forward", False)
    assert any("forward by double reverse disagrees with the reference" in r for r in described["reasons"])
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def _forward_blocks_scaled(monkeypatch, factor=1.5):
    """Every forward-mode block but the eager reference gives its columns times ``factor``."""
    build_block = strategies.build_block

    def scaled(mode, *args, eager=False, **kwargs):
        block = build_block(mode, *args, eager=eager, **kwargs)
        if mode != "forward" or eager:
            return block

        def wrong(*inputs):
            y, columns = block(*inputs)
            return y, columns * factor

        wrong.experimental_get_tracing_count = block.experimental_get_tracing_count
        return wrong

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", scaled)


def test_the_vectorised_accumulator_is_checked_too_and_refused_when_it_disagrees(monkeypatch):
    """Untimed, the reference is the accumulator run eagerly: the vectorised accumulator, the last
    forward path tried, is trusted only once it agrees with it, like the faster paths."""
    _forward_blocks_scaled(monkeypatch)
    model = test_models.coupling_flow()
    with pytest.raises(ModelError, match=r"no way to compute Jacobians worked: .*forward disagrees with the reference"):
        _engine(model, mode="forward")
    engine = _engine(model, mode="auto")  # falls back to reverse mode
    described = engine.describe()
    assert described["mode"] == "reverse"
    refused = [c for c in described["candidates"] if c["path"] in ("forward by double reverse", "forward")]
    assert [c["path"] for c in refused] == ["forward by double reverse", "forward"]
    assert all(abs(c["relative_error"] - 0.5) < 1e-3 for c in refused)  # |1.5 J - J| / |J|
    x = _samples(model, 9)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_without_a_reference_the_fast_forward_paths_are_not_trusted(monkeypatch):
    """If the eager reference cannot run, double reverse is not taken unchecked: the plain
    accumulator becomes the reference and runs."""
    build_block = strategies.build_block

    def no_eager(*args, eager=False, **kwargs):
        if eager:
            raise tf.errors.UnimplementedError(None, None, "no kernel")
        return build_block(*args, eager=eager, **kwargs)

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", no_eager)
    model = test_models.coupling_flow()
    engine = _engine(model, mode="forward")
    described = engine.describe()
    assert (described["mode"], described["double_reverse"], described["layer_rules"]) == ("forward", False, False)
    assert any("forward by double reverse: not tried, as no reference ran" in r for r in described["reasons"])
    x = _samples(model, 9)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_float64_compute_matches_float64_finite_differences(mode):
    model = test_models.small_mlp()
    x = _samples(model, 4)
    result = _engine(model, mode=mode, compute_dtype="float64", store_dtype="float64")(x)
    assert result["jacobian"].dtype == np.float64
    assert_close(result["jacobian"], central_differences(test_models.small_mlp("float64"), x), rtol=1e-8)


@pytest.mark.parametrize("store", ["float16", "bfloat16"])
def test_store_dtypes_round_the_float32_result(store):
    model = test_models.small_mlp()
    x = _samples(model, 5)
    stored = _engine(model, store_dtype=store)(x)["jacobian"]
    expected = tape_loop(model, x)
    dtype = np.float16 if store == "float16" else ml_dtypes.bfloat16
    assert stored.dtype == dtype
    # Rounding to the storage type is the only difference: at most half a unit in the last place.
    eps = float(ml_dtypes.finfo(dtype).eps)
    np.testing.assert_allclose(stored.astype(np.float32), expected, rtol=eps, atol=eps * np.abs(expected).max())


def test_two_input_model_gives_one_jacobian_per_input_and_wrt_selects():
    model = test_models.two_inputs()
    rng = np.random.default_rng(3)
    xs = {"image": rng.normal(size=(6, 4, 4, 1)).astype(np.float32), "meta": rng.normal(size=(6, 3)).astype(np.float32)}
    shapes = {"image": (4, 4, 1), "meta": (3,)}
    engine = JacobianEngine(wrap_model(model, "two"), shapes, EngineOptions(batch_size=4))
    result = engine(xs)
    assert set(result) == {"output", "jacobian/image", "jacobian/meta"}

    for name in ("image", "meta"):
        expected = []
        for i in range(6):
            sample = {k: tf.constant(v[i : i + 1]) for k, v in xs.items()}
            with tf.GradientTape() as tape:
                tape.watch(sample[name])
                y = model([sample["image"], sample["meta"]])[0]
            jac = tape.jacobian(y, sample[name]).numpy()
            expected.append(jac.reshape(5, *shapes[name]))
        assert_close(result[f"jacobian/{name}"], np.stack(expected), rtol=1e-5)

    only_meta = JacobianEngine(wrap_model(model, "two"), shapes, EngineOptions(batch_size=4, wrt=("meta",)))(xs)
    assert set(only_meta) == {"output", "jacobian/meta"}
    assert_close(only_meta["jacobian/meta"], result["jacobian/meta"].astype(np.float64), rtol=1e-5)
    with pytest.raises(ModelError, match=r"jacobian.wrt: two has no input\(s\) \['label'\]"):
        JacobianEngine(wrap_model(model, "two"), shapes, EngineOptions(wrt=("label",)))


def test_pfor_fallback_is_reported_and_forward_without_a_rule_fails_over():
    model = test_models.upsampler()  # 16 inputs < 36 outputs: auto prefers forward
    x = _samples(model, 5)
    auto = _engine(model, mode="auto")
    described = auto.describe()
    assert described["mode"] == "reverse"
    assert any("forward" in reason and "forward-mode rule" in reason for reason in described["reasons"])
    assert "ResizeBilinearGrad" in described["pfor_fallbacks"]
    assert_close(auto(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    with pytest.raises(ModelError, match=r"forward mode dropped the tangent"):
        _engine(model, mode="forward")


@pytest.mark.parametrize("batch_size", [1, 7, 8, 9, 16, 256])
def test_label_rows_at_every_batch_size(batch_size):
    """``outputs: label`` failed at any batch_size above 8 (the probe had 8 samples but batch_size labels)."""
    model = test_models.small_cnn()
    x = _samples(model, 19)
    labels = np.arange(19) % 3
    engine = _engine(model, batch_size=batch_size, outputs=OutputSelection(rule="label"))
    result = {}
    for lo in range(0, len(x), engine.batch_size):
        part = engine(x[lo : lo + engine.batch_size], labels[lo : lo + engine.batch_size])
        for name, value in part.items():
            result.setdefault(name, []).append(value)
    result = {name: np.concatenate(parts) for name, parts in result.items()}
    assert (result["output_index"][:, 0] == labels).all()
    expected = tape_loop(model, x)[np.arange(19), labels][:, None]
    assert_close(result["jacobian"], expected, rtol=1e-5)


def _squares() -> keras.Model:
    """x[4] -> x * x -> Dense 3: each sample's Jacobian is proportional to it (a small sample, a small Jacobian)."""
    x = keras.Input((4,))
    model = keras.Model(x, keras.layers.Dense(3)(keras.layers.Multiply()([x, x])))
    seeded_weights(model, seed=8)
    return model


def test_a_path_wrong_only_on_a_sample_with_a_small_jacobian_is_not_used(monkeypatch):
    """Agreement is judged per sample: double reverse, 1.5 times too large on the probe's one small sample
    (its Jacobian about 1e-4 of the batch's), is refused; judged against the batch's largest entry, its
    error was below 1e-4 and it was used."""
    probe = JacobianEngine._probe

    def with_a_small_sample(self, n):
        xs = probe(self, n)
        xs[0][3:4] *= 1e-4
        return xs

    build_block = strategies.build_block

    def wrong_on_small_samples(*args, double_reverse=False, **kwargs):
        block = build_block(*args, double_reverse=double_reverse, **kwargs)
        if not double_reverse:
            return block

        def wrong(xs, start, given):
            y, columns = block(xs, start, given)
            small = np.abs(np.asarray(xs[0])).max(axis=1) < 1e-2
            return y, np.asarray(columns) * np.where(small, 1.5, 1.0)[:, None, None]

        wrong.experimental_get_tracing_count = block.experimental_get_tracing_count
        return wrong

    monkeypatch.setattr(JacobianEngine, "_probe", with_a_small_sample)
    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", wrong_on_small_samples)
    model = _squares()
    engine = _engine(model, mode="forward")
    described = engine.describe()
    assert (described["mode"], described["double_reverse"], described["layer_rules"]) == ("forward", False, False)
    refused = next(c for c in described["candidates"] if c["path"] == "forward by double reverse")
    # 0.5 times the small sample's scale (1.3e-4 of the batch's) over its floor (1e-2 of the batch's): 6.4e-3,
    # where batch-wide the error read as 6.4e-5.
    assert 1e-3 < refused["relative_error"] < 1e-2
    assert any("forward by double reverse disagrees with the reference" in r for r in described["reasons"])
    x = _samples(model, 6)
    x[2] *= 1e-4
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


@pytest.mark.parametrize(
    ("build", "mode", "path", "reference"),
    [(test_models.small_mlp, "auto", "reverse by layer rules", "reverse, eagerly"),
     (test_models.coupling_flow, "forward", "forward by double reverse", "forward, eagerly")],
    ids=["reverse", "forward"],
)
def test_the_first_batch_is_checked_against_the_reference_once(build, mode, path, reference):
    """A probed plan whose path is not its reference is checked once more on the first real batch (up to
    8 of its samples), with the reference's blocks traced at set-up: no retrace."""
    model = build()
    engine = _engine(model, mode=mode)
    x = _samples(model, 5, seed=1)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    described = engine.describe()
    assert [c["path"] for c in described["candidates"]][:2] == [reference, path]
    check = described["first_batch_check"]
    assert (check["reference"], check["samples"]) == (reference, 5) and check["relative_error"] < 1e-5
    x = _samples(model, 11, seed=2)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    assert engine.describe()["first_batch_check"] == check  # once
    assert engine.describe()["retraces_after_setup"] == 0


def test_a_path_that_agreed_on_the_probe_but_not_on_the_first_batch_is_refused(monkeypatch, tmp_path):
    """Reverse layer rules right on the seeded probe and 1.5 times too large elsewhere: the first real batch
    is refused, and every later one; the set-up decisions are not cached (a resumed run would reuse them
    unchecked)."""
    build = reverse_layer_rules.build_reverse_block

    def wrong_off_the_probe(*args, **kwargs):
        block = build(*args, **kwargs)

        def wrong(xs, start, given):
            y, rows = block(xs, start, given)
            x = np.asarray(xs[0])
            probe = np.random.default_rng(0).standard_normal(x.shape).astype(x.dtype)  # the engine's probe
            return y, rows if np.array_equal(x, probe) else rows * 1.5

        wrong.experimental_get_tracing_count = block.experimental_get_tracing_count
        return wrong

    monkeypatch.setattr(reverse_layer_rules, "build_reverse_block", wrong_off_the_probe)
    cache = tmp_path / ENGINE_PLAN
    mlp = ModelSource(factory="tests.models:small_mlp")
    engine = build_engine(mlp, (12,), EngineOptions(batch_size=8), plan_cache=str(cache))
    described = engine.describe()
    assert described["layer_rules"] and described["candidates"][1]["relative_error"] < 1e-5  # agreed on the probe
    x = _samples(test_models.small_mlp(), 5, seed=1)
    refusal = (r"^factory:tests.models:small_mlp: reverse by layer rules disagrees with the reference path reverse, "
               r"eagerly on the first batch's samples \(per-sample relative error 0.5 > 0.0001\), though it agreed on the "
               r"probe batch: refused \(mode: reverse_loop avoids this path\)$")
    with pytest.raises(ModelError, match=refusal):
        engine(x)
    assert engine.describe()["first_batch_check"]["relative_error"] == pytest.approx(0.5)
    with pytest.raises(ModelError, match=refusal):
        engine(x[:2])
    assert not cache.exists()


@pytest.mark.parametrize("options", [{}, {"mode": "forward"}, {"mode": "reverse_loop"}, {"jit_compile": "auto"}])
def test_batch_coupled_model_is_refused(options):
    """Checked before any path is probed: forward mode's eager reference, which runs copies of the batch
    as one, takes samples to be independent."""
    with pytest.raises(ModelError, match=r"depends on the other samples in its batch"):
        _engine(test_models.batch_coupled(), **options)


def test_autotune_times_every_path_and_keeps_a_correct_one():
    model = test_models.small_cnn()
    x = _samples(model, 9)
    engine = _engine(model, mode="autotune", jit_compile="auto")
    described = engine.describe()
    paths = {c["path"] for c in described["candidates"]}
    assert {"reverse", "reverse_loop"} <= paths
    timed = [c for c in described["candidates"] if "seconds_per_sample" in c]
    assert len(timed) >= 3
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_input_side_products_fall_back_to_reverse_mode_and_stay_products():
    """``reduce: project`` runs in forward mode; through an op without a forward-mode rule (a resize) it
    falls back to reverse mode, which stored the whole Jacobian as the "projection" (found by the
    differential harness on the MobileNet-like model): the product with P must follow."""
    from jacobeam.transforms.engine.reductions import projection_matrix
    from jacobeam.transforms.spec import Reduction

    model = test_models.upsampler()  # 16 inputs, 36 outputs, a bilinear resize
    x = _samples(model, 5)
    engine = _engine(model, batch_size=4, reduce=Reduction(kind="project", project_dim=3))
    assert engine.describe()["mode"] == "reverse"
    projection = engine(x)["projection"]
    expected = tape_loop(model, x).reshape(5, 36, 16) @ projection_matrix(16, 3, "rademacher", 0)
    assert projection.shape == (5, 36, 3)
    assert_close(projection, expected, rtol=1e-5)


def test_a_model_that_cannot_be_rebuilt_in_float64_is_a_model_error():
    """Keras refuses to deserialise Lambda layers (safe mode): a bare ValueError reached the user."""
    with pytest.raises(ModelError, match=r"^\w+: cannot rebuild the model in float64 \(compute_dtype: float64\): "):
        _engine(test_models.coupling_flow(), compute_dtype="float64")
