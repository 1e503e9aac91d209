"""Forward mode by layer rules (``transforms/engine/layer_rules.py``) against independent references:
a per-sample tape loop, float64 finite differences, and the accumulator's NaN/inf behaviour."""

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jacobeam.transforms.engine import layer_rules, reverse_layer_rules
from jacobeam.transforms.engine.models import seeded_weights
from jacobeam.transforms.spec import OutputSelection, Reduction
from tests.engines import engine as _engine
from tests.engines import samples as _samples
from tests.reference import assert_close, central_differences, tape_loop

ACTIVATIONS = ["linear", "tanh", "relu", "sigmoid", "softplus", "exponential"]


def dense_chain(widths=(3, 7, 5, 9), activations=("tanh", "relu", None), dtype="float32", seed=3) -> keras.Model:
    """Dense layers with every kind of activation rule, an Activation layer, Dropout and a Reshape and
    Flatten between: 3 inputs -> 9 outputs, so mode auto runs forward."""
    layers = [keras.Input((widths[0],), dtype=dtype)]
    for width, activation in zip(widths[1:], activations):
        layers.append(keras.layers.Dense(width, activation=activation, dtype=dtype))
    layers[2:2] = [
        keras.layers.Activation("sigmoid", dtype=dtype), keras.layers.Dropout(0.5, dtype=dtype),
        keras.layers.Reshape((widths[1], 1), dtype=dtype), keras.layers.Flatten(dtype=dtype),
    ]
    model = keras.Sequential(layers, name="dense_chain")
    seeded_weights(model, seed)
    return model


def ops_flow(dtype="float32", seed=5) -> keras.Model:
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)  # the models' own dtype: the engine cannot clone Keras ops into float64
    try:
        return _ops_flow(dtype, seed)
    finally:
        keras.config.set_dtype_policy(policy)


def _ops_flow(dtype: str, seed: int) -> keras.Model:
    """Affine couplings written with Keras ops (as benchmarks/workloads.py's W4): slices of the features,
    exp, *, +, -, concatenate and a permutation by take; a nested Sequential as the coupling's network."""
    x = inputs = keras.Input((6,), dtype=dtype)
    rng = np.random.default_rng(seed)
    for index in range(2):
        net = keras.Sequential(
            [keras.Input((3,), dtype=dtype), keras.layers.Dense(8, activation="softplus", dtype=dtype),
             keras.layers.Dense(6, dtype=dtype)],
            name=f"net{index}",
        )
        st_ = net(x[:, :3])
        moved = x[:, 3:] * keras.ops.exp(st_[:, :3]) + st_[:, 3:] - 0.5 * x[:, 3:]
        x = keras.ops.concatenate([x[:, :3], moved], axis=-1)
        x = keras.ops.take(x, rng.permutation(6) - 6 * index, axis=1)  # negative indices the second time
    model = keras.Model(inputs, x, name="ops_flow")
    seeded_weights(model, seed)
    return model


@pytest.mark.parametrize("build", [dense_chain, ops_flow], ids=["dense_chain", "ops_flow"])
def test_layer_rules_match_the_tape_loop_and_are_chosen_where_they_agree(build):
    model = build()
    assert layer_rules.unsupported(model) is None
    x = _samples(model, 11)
    engine = _engine(model)
    described = engine.describe()
    assert (described["mode"], described["layer_rules"], described["double_reverse"]) == ("forward", True, False)
    # Checked against the accumulator run eagerly, the reference; the slower paths are not traced.
    assert described["candidates"][0] == {"path": "forward, eagerly", "reference_only": True}
    assert [c["path"] for c in described["candidates"]] == ["forward, eagerly", "forward by layer rules"]
    assert described["candidates"][1]["relative_error"] < 1e-5
    result = engine(x)
    assert_close(result["jacobian"], tape_loop(model, x), rtol=1e-5)
    assert_close(result["output"], model(x).numpy(), rtol=1e-6)


@pytest.mark.parametrize("build", [dense_chain, ops_flow], ids=["dense_chain", "ops_flow"])
def test_float64_layer_rules_match_float64_finite_differences(build):
    model64 = build(dtype="float64")
    x = _samples(model64, 3)
    engine = _engine(model64, compute_dtype="float64", store_dtype="float64")
    assert engine.describe()["layer_rules"]
    assert_close(engine(x)["jacobian"], central_differences(model64, x), rtol=1e-7)


def test_blocks_of_columns_and_projections_run_by_layer_rules():
    """A small memory budget cuts the columns into blocks (``start`` > 0); ``reduce: project`` pushes
    the projection's columns instead of the identity's."""
    from jacobeam.transforms.engine.reductions import projection_matrix

    model = ops_flow()
    x = _samples(model, 10)
    blocked = _engine(model, memory_budget=4_000)
    assert blocked.describe()["layer_rules"] and blocked.describe()["block_rows"]["x"] < 6
    assert_close(blocked(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    projected = _engine(model, reduce=Reduction(kind="project", project_dim=4))
    assert projected.describe()["layer_rules"]
    expected = tape_loop(model, x) @ projection_matrix(6, 4, "rademacher", 0)
    assert_close(projected(x)["projection"], expected, rtol=1e-5)


def test_a_layer_without_a_rule_falls_back_to_the_existing_forward_paths():
    dtype = "float32"
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.LayerNormalization(),
         keras.layers.Dense(8, activation="gelu")],
        name="normalised",
    )
    seeded_weights(model, 2)
    reason = layer_rules.unsupported(model)
    assert reason is not None and "LayerNormalization" in reason
    x = _samples(model, 7)
    described = _engine(model).describe()
    assert (described["mode"], described["layer_rules"]) == ("forward", False)
    assert "forward by layer rules" not in [c["path"] for c in described["candidates"]]
    assert_close(_engine(model)(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    gelu = keras.Sequential([keras.Input((2,), dtype=dtype), keras.layers.Dense(3, activation="gelu")])
    assert "activation" in layer_rules.unsupported(gelu)


def test_an_argument_without_a_rule_found_while_tracing_falls_back():
    """``x[:, None]`` (a new axis) passes the layer check but has no rule: the path is noted and skipped."""
    x = inputs = keras.Input((3,))
    x = keras.layers.Dense(5, activation="tanh")(x)
    x = keras.layers.Flatten()(x[:, None, :])
    model = keras.Model(inputs, x, name="new_axis")
    seeded_weights(model, 4)
    assert layer_rules.unsupported(model) is None
    engine = _engine(model)
    described = engine.describe()
    assert (described["mode"], described["layer_rules"], described["double_reverse"]) == ("forward", False, True)
    assert any(r.startswith("forward by layer rules: x[") for r in described["reasons"])
    samples = _samples(model, 5)
    assert_close(engine(samples)["jacobian"], tape_loop(model, samples), rtol=1e-5)


def _wrong(monkeypatch, rules, name: str) -> None:
    """``rules.<name>`` (a module of layer rules) builds blocks whose derivatives are 1.5 times too large."""
    build = getattr(rules, name)

    def wrong(*args, **kwargs):
        block = build(*args, **kwargs)

        def scaled(*inputs):
            y, derivatives = block(*inputs)
            return y, derivatives * 1.5

        scaled.experimental_get_tracing_count = block.experimental_get_tracing_count
        return scaled

    monkeypatch.setattr(rules, name, wrong)


def test_layer_rules_that_disagree_with_the_accumulator_are_not_used(monkeypatch):
    _wrong(monkeypatch, layer_rules, "build_block")
    model = dense_chain()
    x = _samples(model, 9)
    engine = _engine(model)
    described = engine.describe()
    assert (described["mode"], described["layer_rules"], described["double_reverse"]) == ("forward", False, True)
    assert any("forward by layer rules disagrees with the reference" in r for r in described["reasons"])
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


@pytest.mark.parametrize("build", [dense_chain, ops_flow], ids=["dense_chain", "ops_flow"])
def test_nan_and_inf_samples_give_what_the_accumulator_gives(build, monkeypatch):
    """Non-finite samples (and relu's kink at exactly 0): the Jacobians the accumulator's path computes
    (the same entries finite, equal values there), the outputs of the model's own call. The other
    forward paths' outputs can differ there: their graphs fuse MatMul, BiasAdd and Relu, and the fused
    Relu maps NaN to 0 (eager Keras and these rules keep NaN)."""
    model = build()
    x = _samples(model, 6)
    x[1, 0], x[2, 1], x[3, 2], x[4] = np.nan, np.inf, -np.inf, 0.0
    by_rules = _engine(model)
    assert by_rules.describe()["layer_rules"]
    monkeypatch.setattr(layer_rules, "unsupported", lambda model: "switched off")
    accumulator = _engine(model, mode="forward", jit_compile=False)
    assert not accumulator.describe()["layer_rules"]
    ours = by_rules(x)
    for key, expected in (("jacobian", accumulator(x)["jacobian"]), ("output", model(x).numpy())):
        np.testing.assert_array_equal(np.isfinite(ours[key]), np.isfinite(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(ours[key][finite], expected[finite], rtol=1e-5, atol=1e-6)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    activations=st.lists(st.sampled_from(ACTIVATIONS), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_any_dense_chain_by_layer_rules_matches_the_tape_loop(widths, activations, seed):
    """Against the tape loop of the same weights in float64: a float32 tape loop is itself 2e-5 off where
    two exponential activations follow each other (widths 3, 6, 6, 5; exponential, exponential, tanh; seed
    65536), where the engine is 3.5e-6 off."""

    def chain(dtype):
        layers = [keras.Input((widths[0],), dtype=dtype)]
        layers += [keras.layers.Dense(w, activation=a, dtype=dtype) for w, a in zip(widths[1:], activations)]
        return keras.Sequential(layers, name="chain")

    model, model64 = chain("float32"), chain("float64")
    seeded_weights(model, seed)
    model64.set_weights([w.astype(np.float64) for w in model.get_weights()])
    engine = _engine(model, mode="forward")
    assert engine.describe()["layer_rules"]
    x = _samples(model, 5, seed)
    assert_close(engine(x)["jacobian"], tape_loop(model64, x.astype(np.float64)), rtol=1e-5)


# -- reverse mode by layer rules ----------------------------------------------------------------------


def reverse_chain(
    widths=(12, 9, 7, 3), activations=("tanh", "relu", None), functional=False, dtype="float32", seed=6
) -> keras.Model:
    """More inputs than outputs (mode auto runs reverse): Dense layers, an Activation, Dropout, Reshape
    and Flatten, as a Sequential or as a functional chain."""
    layers = [keras.layers.Dense(w, activation=a, dtype=dtype) for w, a in zip(widths[1:], activations)]
    layers[1:1] = [
        keras.layers.Activation("sigmoid", dtype=dtype), keras.layers.Dropout(0.5, dtype=dtype),
        keras.layers.Reshape((widths[1], 1), dtype=dtype), keras.layers.Flatten(dtype=dtype),
    ]
    if functional:
        x = inputs = keras.Input((widths[0],), dtype=dtype)
        for layer in layers:
            x = layer(x)
        model = keras.Model(inputs, x, name="reverse_chain_functional")
    else:
        model = keras.Sequential([keras.Input((widths[0],), dtype=dtype), *layers], name="reverse_chain")
    seeded_weights(model, seed)
    return model


@pytest.mark.parametrize("functional", [False, True], ids=["sequential", "functional"])
def test_reverse_layer_rules_match_the_tape_loop_and_are_chosen_where_they_agree(functional):
    model = reverse_chain(functional=functional)
    assert reverse_layer_rules.reverse_unsupported(model) is None
    x = _samples(model, 11)
    engine = _engine(model)
    described = engine.describe()
    assert (described["mode"], described["layer_rules"]) == ("reverse", True)
    # Checked against reverse mode run eagerly, the reference; pfor's batch_jacobian is not traced.
    assert described["candidates"][0] == {"path": "reverse, eagerly", "reference_only": True}
    assert [c["path"] for c in described["candidates"]] == ["reverse, eagerly", "reverse by layer rules"]
    assert described["candidates"][1]["relative_error"] < 1e-5
    result = engine(x)
    assert_close(result["jacobian"], tape_loop(model, x), rtol=1e-5)
    assert_close(result["output"], model(x).numpy(), rtol=1e-6)


def test_float64_reverse_layer_rules_match_float64_finite_differences():
    model64 = reverse_chain(dtype="float64")
    x = _samples(model64, 3)
    engine = _engine(model64, compute_dtype="float64", store_dtype="float64")
    assert engine.describe()["layer_rules"]
    assert_close(engine(x)["jacobian"], central_differences(model64, x), rtol=1e-7)


@pytest.mark.parametrize(
    "selection",
    [OutputSelection("argmax"), OutputSelection("label"), OutputSelection("indices", (2, 0)), OutputSelection("top_k", k=2)],
    ids=["argmax", "label", "indices", "top_k"],
)
def test_reverse_layer_rules_with_output_selections(selection):
    model = reverse_chain()
    x = _samples(model, 9)
    labels = np.arange(9) % 3
    engine = _engine(model, outputs=selection)
    assert engine.describe()["layer_rules"]
    result = engine(x, labels=labels)
    chosen = result["output_index"]
    if selection.rule == "label":
        np.testing.assert_array_equal(chosen[:, 0], labels)
    expected = np.take_along_axis(tape_loop(model, x), chosen[:, :, None], axis=1)
    assert_close(result["jacobian"], expected, rtol=1e-5)


def test_blocks_of_rows_and_vector_jacobian_products_run_by_reverse_layer_rules(tmp_path):
    """A small memory budget cuts the rows into blocks (``start`` > 0); ``reduce: vjp`` pulls back the
    vectors' rows instead of the identity's."""
    model = reverse_chain(widths=(40, 30, 20, 6))
    x = _samples(model, 10)
    blocked = _engine(model, memory_budget=20_000)
    assert blocked.describe()["layer_rules"] and blocked.describe()["block_rows"]["x"] < 6
    assert_close(blocked(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    vectors = np.random.default_rng(1).normal(size=(2, 6)).astype(np.float32)
    np.save(tmp_path / "v.npy", vectors)
    vjp = _engine(model, reduce=Reduction(kind="vjp", vectors=str(tmp_path / "v.npy")))
    assert vjp.describe()["layer_rules"]
    products = {k: v for k, v in vjp(x).items() if k not in ("output",)}
    (value,) = products.values()
    assert_close(value, vectors @ tape_loop(model, x), rtol=1e-5)


def test_a_model_without_reverse_rules_falls_back_to_pfor():
    """A layer without a rule (LayerNormalization), and ops with forward rules only (a residual sum
    of slices): reverse mode runs by pfor and still matches the tape loop."""
    normalised = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(6, activation="tanh"), keras.layers.LayerNormalization(), keras.layers.Dense(2)],
        name="normalised_reverse",
    )
    x = inputs = keras.Input((8,))
    h = keras.layers.Dense(4, activation="tanh")(x)
    residual = keras.Model(inputs, h[:, :2] + h[:, 2:], name="residual")
    for model in (normalised, residual):
        seeded_weights(model, 2)
        assert reverse_layer_rules.reverse_unsupported(model) is not None
        samples = _samples(model, 7)
        engine = _engine(model)
        described = engine.describe()
        assert (described["mode"], described["layer_rules"]) == ("reverse", False)
        assert "reverse by layer rules" not in [c["path"] for c in described["candidates"]]
        assert_close(engine(samples)["jacobian"], tape_loop(model, samples), rtol=1e-5)


def test_reverse_layer_rules_that_disagree_with_the_reference_are_not_used(monkeypatch):
    """Wrong layer rules disagree with reverse mode run eagerly: pfor, tried next, agrees and is used."""
    _wrong(monkeypatch, reverse_layer_rules, "build_reverse_block")
    model = reverse_chain()
    x = _samples(model, 9)
    engine = _engine(model)
    described = engine.describe()
    assert (described["mode"], described["layer_rules"]) == ("reverse", False)
    assert [c["path"] for c in described["candidates"]] == ["reverse, eagerly", "reverse by layer rules", "reverse"]
    assert any("reverse by layer rules disagrees with the reference" in r for r in described["reasons"])
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    activations=st.lists(st.sampled_from(ACTIVATIONS), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_any_dense_chain_by_reverse_layer_rules_matches_the_tape_loop(widths, activations, seed):
    layers = [keras.Input((widths[0] + 6,))]  # more inputs than outputs: mode auto runs reverse
    layers += [keras.layers.Dense(w, activation=a) for w, a in zip(widths[1:], activations)]
    model = keras.Sequential(layers, name="reverse_chain")
    seeded_weights(model, seed)
    x = np.random.default_rng(seed).normal(size=(5, widths[0] + 6)).astype(np.float32)
    engine = _engine(model, mode="reverse")
    assert engine.describe()["layer_rules"]
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-4)
