"""The parameter side (``jacobian.wrt: parameters``): per-sample gradients and Jacobians of the weights,
projected, as norms or whole, against a float64 per-sample tape of each sample written here (closed-form
objectives, a plain loop), and the self-check's mutants."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from jacobeam.pipeline import config
from jacobeam.transforms.engine import parameter_rules
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.engine.parameter_space import BLOCK_ROWS, projection_block, projection_rows
from jacobeam.transforms.engine.parameters import ParameterEngine
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.self_check import KINK, MISMATCH, OK, checker_for
from jacobeam.transforms.spec import EngineOptions, OutputSelection, ParameterSide, Reduction, SelfCheck
from tests import models

MODELS = {"mlp": (models.small_mlp, (12,)), "bn_cnn": (models.bn_cnn, (6, 6, 2)),
          "softmax": (models.softmax_mlp, (12,)), "sequence": (models.sequence_mlp, (3, 8)),
          "tokens": (models.token_model, (6,))}
_loaded: dict = {}


def loaded(name: str, dtype: str = "float32"):
    """The test model ``name`` in ``dtype`` (built once per process: equal weights in both dtypes)."""
    if (name, dtype) not in _loaded:
        _loaded[name, dtype] = wrap_model(MODELS[name][0](dtype), name)
    return _loaded[name, dtype]


def draw(name: str, rng, n: int) -> np.ndarray:
    """``n`` inputs of the test model ``name``: token ids (as floats) for ``tokens``, else normal noise."""
    shape = (n, *MODELS[name][1])
    if name == "tokens":
        return rng.integers(0, models.TEXT_VOCABULARY, shape).astype(np.float32)
    return rng.normal(size=shape).astype(np.float32)


def reference(name: str, side: ParameterSide, selection: OutputSelection, x: np.ndarray, labels: np.ndarray,
              index: np.ndarray | None, layers=None):
    """Per sample, float64, one sample at a time by an eager tape: the objective's value (or None) and the
    gradient rows ``(rows, p)`` of the chosen weights, with the weights' layers; objectives in closed form."""
    model = loaded(name, "float64").keras_model
    chosen = [(v, layer.name) for layer in model.layers for v in layer.trainable_weights
              if layers is None or layer.name in layers]
    variables = [v for v, _ in chosen]
    probabilities = name == "softmax"
    values, grads = [], []
    for i in range(len(x)):
        if side.objective == "outputs":
            rows = list(range(int(np.prod(model.output_shape[1:])))) if index is None else list(index[i])
        else:
            rows = [None]
        found = []
        for row in rows:
            with tf.GradientTape() as tape:
                y = tf.reshape(model(x[i: i + 1].astype(np.float64), training=False), (-1,))
                y_label = y[int(labels[i])]
                if side.objective == "outputs":
                    value = y[row]
                elif side.objective == "margin":
                    if probabilities:
                        value = tf.math.log(y_label) - tf.math.log(1.0 - y_label)
                    else:
                        rest = tf.concat([y[: int(labels[i])], y[int(labels[i]) + 1:]], 0)
                        value = y_label - tf.math.log(tf.reduce_sum(tf.exp(rest)))
                else:  # cross-entropy of the label, either name
                    value = -tf.math.log(y_label) if probabilities else -(y_label - tf.reduce_logsumexp(y))
            found.append(np.concatenate([np.asarray(tf.convert_to_tensor(g)).reshape(-1)
                                         for g in tape.gradient(value, variables)]))
        values.append(float(value))
        grads.append(np.stack(found))
    return values, grads, chosen


def projected(grads, chosen, reduction: Reduction, engine) -> list[np.ndarray]:
    """Each gradient times ``P``, rebuilt weight by weight from the definition."""
    rows = np.concatenate([projection_rows(reduction.project_seed, reduction.project_kind, w, reduction.project_dim,
                                           reduction.project_structure) for w in engine.layout.weights])
    return [g @ rows for g in grads]


def assert_close(actual, expected, rtol=2e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(np.abs(expected).max(), 1e-30)
    assert np.abs(actual - expected).max() <= rtol * scale, (np.abs(actual - expected).max() / scale)


objectives = st.sampled_from([
    (ParameterSide(objective="outputs"), OutputSelection()),
    (ParameterSide(objective="outputs"), OutputSelection("indices", indices=(2, 0))),
    (ParameterSide(objective="outputs"), OutputSelection("label")),
    (ParameterSide(objective="outputs"), OutputSelection("top_k", k=2)),
    (ParameterSide(objective="margin"), OutputSelection()),
    (ParameterSide(objective="loss", loss="sparse_categorical_crossentropy"), OutputSelection()),
    (ParameterSide(objective="loss", loss="categorical_crossentropy"), OutputSelection()),
])


@contextlib.contextmanager
def only(path: str):
    """The engine's paths before ``path`` made to fail at set-up: each path is tested, not just the first."""
    with contextlib.ExitStack() as stack:
        if path != "layer rules":
            stack.enter_context(mock.patch.object(parameter_rules, "unsupported", lambda *_: "turned off by the test"))
        if path == "map_fn":
            stack.enter_context(mock.patch.object(tf, "vectorized_map", mock.Mock(side_effect=ValueError("turned off"))))
        yield


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(MODELS)), objective=objectives, kind=st.sampled_from(["project", "frobenius", "none"]),
       n=st.integers(1, 13), budget=st.sampled_from([40_000, 200_000, 2 * 2**30]), seed=st.integers(0, 2**31),
       projection=st.sampled_from(["rademacher", "gaussian"]), dim=st.sampled_from([7, 64]),
       path=st.sampled_from(["layer rules", "vectorized_map", "map_fn"]), structure=st.sampled_from(["dense", "kronecker"]),
       jit=st.booleans())
def test_per_sample_gradients_match_a_float64_tape_of_each_sample(name, objective, kind, n, budget, seed, projection, dim,
                                                                  path, structure, jit):
    side, selection = objective
    shape = MODELS[name][1]
    reduction = Reduction(kind=kind, project_dim=dim, project_kind=projection, project_seed=seed,
                          project_structure=structure)
    with only(path):
        engine = ParameterEngine(loaded(name), shape, EngineOptions(
            batch_size=8, memory_budget=budget, parameters=side, outputs=selection, reduce=reduction, jit_compile=jit))
    assert engine.path == path and engine.describe()["jit_compile"] is jit
    rng = np.random.default_rng(seed)
    x = draw(name, rng, n)
    outputs = engine.outputs
    labels = rng.integers(0, outputs, n)
    datasets = {}
    for lo in range(0, n, engine.batch_size):  # as the DoFn calls it: batch_size samples at a time
        part, _ = engine.compute(x[lo: lo + engine.batch_size], labels[lo: lo + engine.batch_size])
        for key, value in part.items():
            datasets.setdefault(key, []).append(value)
    datasets = {key: np.concatenate(value) for key, value in datasets.items()}
    index = datasets.get("output_index")
    if selection.rule == "top_k":  # chosen from the float64 outputs, independently
        y64 = np.asarray(loaded(name, "float64").keras_model(x.astype(np.float64), training=False))
        np.testing.assert_array_equal(index, np.argsort(-y64, axis=1, kind="stable")[:, :2])
    elif selection.rule == "label":
        np.testing.assert_array_equal(index[:, 0], labels)
    values, grads, chosen = reference(name, side, selection, x, labels, index)
    rows = () if side.objective != "outputs" else ((outputs,) if selection.count is None else (selection.count,))
    if side.objective != "outputs":
        assert_close(datasets["objective"], values)
    if kind == "none":
        assert_close(datasets["gradient"], np.stack(grads).reshape(n, *rows, -1))
    elif kind == "project":
        assert_close(datasets["projection"], np.stack(projected(grads, chosen, reduction, engine)).reshape(n, *rows, dim))
    else:
        layers = list(dict.fromkeys(layer for _, layer in chosen))
        sizes = [int(np.prod(v.shape)) for v, _ in chosen]
        starts = np.cumsum([0, *sizes])
        by_layer = np.array([[math.sqrt(sum(float(np.sum(g[:, starts[k]: starts[k + 1]] ** 2))
                                            for k, (_, owner) in enumerate(chosen) if owner == layer))
                              for layer in layers] for g in grads])
        assert_close(datasets["frobenius_by_layer"], by_layer)
        assert_close(datasets["frobenius"], [np.linalg.norm(g) for g in grads])
        assert len(engine.layout.layers) == len(layers)  # the float64 copy's unnamed layers are named anew


@pytest.mark.slow
@pytest.mark.parametrize("reduction, at_once", [
    (Reduction(kind="project", project_dim=2048), True),
    (Reduction(kind="project", project_dim=2048, project_structure="kronecker"), True),
    (Reduction(kind="frobenius"), False),
    (Reduction(kind="none"), False),
])
@pytest.mark.parametrize("budget", [None, 2**29])
def test_a_cifar_resnets_calls_stay_within_the_memory_budget(reduction, at_once, budget):
    """ResNet-20 at the default batch, at the default budget and a quarter of it: each call's working set, by
    TensorFlow's allocator, is within the budget. At the default a projection runs the whole batch in one call
    (its draws of ``P`` paid once); a batch that does not fit is cut into calls of equal size (not 165 and
    then 91)."""
    from jacobeam.transforms.engine.models import build_cifar_resnet

    side = ParameterSide(objective="loss", loss="sparse_categorical_crossentropy") if reduction.kind == "frobenius" \
        else ParameterSide(objective="margin")
    engine = ParameterEngine(wrap_model(build_cifar_resnet(), "resnet20"), (32, 32, 3),
                             EngineOptions(parameters=side, reduce=reduction, **({"memory_budget": budget} if budget else {})))
    calls = -(-256 // engine.elements)
    assert engine.elements == -(-256 // calls) and (calls == 1) == (at_once and budget is None)
    rng = np.random.default_rng(3)
    x, labels = rng.normal(size=(256, 32, 32, 3)).astype(np.float32), rng.integers(0, 10, 256)
    engine.compute(x[:2], labels[:2])  # the first batch's check against the loop, apart
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    datasets, _ = engine.compute(x, labels)
    grown = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    assert 0 < grown <= engine.options.memory_budget
    assert all(np.isfinite(v).all() and len(v) == 256 for v in datasets.values())


def test_the_defaults_on_more_samples_than_a_batch_and_named_layers():
    """Default batch size and memory budget, 300 samples (not a multiple of the batch), two named layers."""
    side = ParameterSide(objective="margin", layers=("conv", "head"))
    engine = ParameterEngine(loaded("bn_cnn"), (6, 6, 2), EngineOptions(parameters=side, reduce=Reduction(kind="project",
                                                                                                    project_dim=2048)))
    assert engine.batch_size == 256
    rng = np.random.default_rng(7)
    x, labels = rng.normal(size=(300, 6, 6, 2)).astype(np.float32), rng.integers(0, 4, 300)
    stored = np.concatenate([engine.compute(x[lo: lo + 256], labels[lo: lo + 256])[0]["projection"] for lo in (0, 256)])
    picked = rng.choice(300, 12, replace=False)
    values, grads, chosen = reference("bn_cnn", side, OutputSelection(), x[picked], labels[picked], None,
                                      layers=("conv", "head"))
    assert [w.layer for w in engine.layout.weights] == [layer for _, layer in chosen]
    assert_close(stored[picked], np.stack(projected(grads, chosen, engine.options.reduce, engine))[:, 0])


def test_jit_compile_auto_is_timed_and_a_failing_xla_compilation_is_named_or_left_out():
    """``auto`` keeps XLA only where it ran a full call faster at set-up; where XLA cannot compile the path,
    ``true`` is a one-line error and ``auto`` the plain graph; under XLA a short call is padded, not retraced."""
    options = dict(parameters=ParameterSide(objective="loss", loss="sparse_categorical_crossentropy"),
                   reduce=Reduction(kind="frobenius"))
    auto = ParameterEngine(loaded("mlp"), (12,), EngineOptions(jit_compile="auto", **options))
    timed = auto.telemetry["xla_timed"]
    assert auto.jit == (timed["xla"] < timed["plain"]) and auto.describe()["jit_compile"] == auto.jit
    forced = ParameterEngine(loaded("mlp"), (12,), EngineOptions(jit_compile=True, **options))
    rng = np.random.default_rng(3)
    for n in (3, 5):  # both padded to the call's size: one trace
        x, labels = rng.normal(size=(n, 12)).astype(np.float32), rng.integers(0, 3, n)
        norms = forced.compute(x, labels)[0]["frobenius"]
        grads = reference("mlp", forced.side, OutputSelection(), x, labels, None)[1]
        assert_close(norms, [np.linalg.norm(g) for g in grads])
    assert forced.describe()["retraces_after_setup"] == 0

    original = ParameterEngine._compiled

    def no_xla(self, path, jit=False):
        if jit:
            raise tf.errors.UnimplementedError(None, None, "no XLA kernel for the test's op\nmore")
        return original(self, path, jit)

    with mock.patch.object(ParameterEngine, "_compiled", no_xla):
        with pytest.raises(ModelError, match=r"XLA compilation of the per-sample gradients failed \(jit_compile: true\): "
                                             r"no XLA kernel for the test's op$"):
            ParameterEngine(loaded("mlp"), (12,), EngineOptions(jit_compile=True, **options))
        fallen = ParameterEngine(loaded("mlp"), (12,), EngineOptions(jit_compile="auto", **options))
    assert not fallen.jit and fallen.telemetry["xla_failure"] == "no XLA kernel for the test's op"


def test_the_projection_is_the_documented_bits_of_philox_words():
    """``P``'s rademacher rows, rebuilt here from the definition's words (little-endian bits), and its
    gaussian rows from ``stateless_normal``: what a user reads in the module's docstring."""
    from jacobeam.transforms.engine.parameter_space import Weight

    weight = Weight(index=3, name="w", layer="l", shape=(BLOCK_ROWS + 5,), offset=0)
    rows = projection_rows(11, "rademacher", weight, 40)
    for block in (0, 1):
        words = tf.random.stateless_uniform((BLOCK_ROWS, 2), [11, 3 * 2**32 + block], minval=None, maxval=None,
                                            dtype=tf.int32, alg="philox").numpy().view(np.uint32)
        bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
        want = (bits.reshape(BLOCK_ROWS, 64)[:, :40] * 2.0 - 1.0).astype(np.float32) / np.float32(math.sqrt(40))
        got = rows[block * BLOCK_ROWS: (block + 1) * BLOCK_ROWS]
        np.testing.assert_array_equal(got, want[: len(got)])
        signs = (bits.reshape(BLOCK_ROWS, 64)[:7, :40].astype(np.int64) * 2 - 1)  # other dtypes: the same signs
        for dtype in (np.float64, np.float16):
            drawn = projection_block(11, "rademacher", 3, block, 40, tf.as_dtype(dtype), 7).numpy()
            np.testing.assert_array_equal(drawn, signs.astype(dtype) / dtype(np.float32(math.sqrt(40))))
    normal = projection_rows(11, "gaussian", weight, 40)
    want = tf.random.stateless_normal((BLOCK_ROWS, 40), [11, 3 * 2**32 + 1], alg="philox").numpy() / np.float32(math.sqrt(40))
    np.testing.assert_allclose(normal[BLOCK_ROWS:], want[:5], rtol=1e-6)


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_the_kronecker_projection_is_the_documented_product_of_two_philox_draws(kind):
    """``structure: kronecker``: a matrix weight's rows of ``P`` are ``kron(A, B)``, ``A`` and ``B`` rebuilt here
    from the definition's streams ``(seed, -(2v + 1))`` and ``(seed, -(2v + 2))``; a vector weight's rows are
    its dense blocks."""
    from jacobeam.transforms.engine.parameter_space import Weight, kronecker_factors

    assert kronecker_factors(2048) == (32, 64) and kronecker_factors(7) == (1, 7) and kronecker_factors(64) == (8, 8)

    def draw(stream, rows, k):
        key = [11, stream]
        if kind == "gaussian":
            return tf.random.stateless_normal((rows, k), key, alg="philox").numpy() / np.float32(math.sqrt(k))
        words = tf.random.stateless_uniform((rows, -(-k // 32)), key, minval=None, maxval=None, dtype=tf.int32,
                                            alg="philox").numpy().view(np.uint32)
        bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
        return (bits.reshape(rows, -1)[:, :k] * 2.0 - 1.0).astype(np.float32) / np.float32(math.sqrt(k))

    kernel = Weight(index=3, name="w", layer="l", shape=(3, 3, 2, 5), offset=0)
    a, b = draw(-7, 18, 8), draw(-8, 5, 12)  # v = 3: streams -(2v + 1) and -(2v + 2); 96 = 8 x 12
    got = projection_rows(11, kind, kernel, 96, "kronecker")
    np.testing.assert_allclose(got, np.kron(a.astype(np.float64), b.astype(np.float64)), rtol=1e-6)
    g = np.random.default_rng(0).normal(size=(18, 5))  # A^T G B, flattened in C order, is g . P
    np.testing.assert_allclose(g.reshape(-1) @ got, (a.T @ g @ b).reshape(-1), rtol=1e-5)
    bias = Weight(index=4, name="b", layer="l", shape=(5,), offset=90)
    np.testing.assert_array_equal(projection_rows(11, kind, bias, 96, "kronecker"), projection_rows(11, kind, bias, 96))


def test_refusals_name_what_is_wrong():
    with pytest.raises(ModelError, match=r"no trainable layer or weight \['nope'\]"):
        ParameterEngine(loaded("mlp"), (12,), EngineOptions(parameters=ParameterSide(layers=("nope",))))
    with pytest.raises(ModelError, match="not a Keras model"):
        plain = wrap_model(tf.function(lambda x: 2 * x), "plain")
        ParameterEngine(plain, (3,), EngineOptions(parameters=ParameterSide()))
    too_big = r"reduce: none would store 1,465 entries per sample for mlp \(293 weight entries x 5 row\(s\)\)"
    with pytest.raises(ModelError, match=too_big):
        _too_big_gradient()
    engine = ParameterEngine(loaded("mlp"), (12,), EngineOptions(parameters=ParameterSide(objective="margin")))
    with pytest.raises(ModelError, match="label 7 is not an output index 0..4"):
        engine.compute(np.zeros((2, 12), np.float32), np.array([1, 7]))


def _too_big_gradient():
    """reduce: none of a model whose gradient is larger than stored whole: refused, pointing to project."""
    import jacobeam.transforms.engine.parameters as parameters

    saved = parameters.MOST_GRADIENT_BYTES
    parameters.MOST_GRADIENT_BYTES = 100
    try:
        ParameterEngine(loaded("mlp"), (12,), EngineOptions(parameters=ParameterSide(), reduce=Reduction(kind="none")))
    finally:
        parameters.MOST_GRADIENT_BYTES = saved


def test_config_keys_and_their_refusals():
    base = {"model": {"builtin": "mlp"}, "input": {"paths": ["x/*.npz"], "key": "x"}, "output": {"path": "o"}}
    parsed = config.validate({**base, "jacobian": {"wrt": "parameters", "objective": "margin", "labels": {"key": "y"},
                                                   "reduce": "project"}}).jacobian
    options = parsed.engine_options()
    assert options.parameters == ParameterSide(objective="margin") and options.wrt is None
    assert options.reduce.project_dim == 2048 and options.needs_labels
    assert config.validate({**base, "jacobian": {"reduce": "project"}}).jacobian.project.dim == 256
    named = config.validate({**base, "jacobian": {"wrt": {"parameters": "head"}, "objective": {
        "loss": "sparse_categorical_crossentropy"}, "labels": {"key": "y"}, "reduce": "frobenius",
        "project": {"dim": 16}}}).jacobian.engine_options()
    assert named.parameters == ParameterSide(layers=("head",), objective="loss", loss="sparse_categorical_crossentropy")
    assert named.reduce.project_dim == 16
    kronecker = {"wrt": "parameters", "reduce": "project", "project": {"structure": "kronecker"}}
    assert config.validate({**base, "jacobian": kronecker}).jacobian.engine_options().reduce.project_structure == "kronecker"
    from jacobeam.pipeline.identity import run_identity

    dense = config.to_dict(config.validate({**base, "jacobian": {"wrt": "parameters", "reduce": "project"}}))
    assert "jacobian.project.structure" not in run_identity(dense)  # a run from before the key keeps its identity
    assert run_identity(config.to_dict(config.validate({**base, "jacobian": kronecker})))["jacobian.project.structure"] \
        == "kronecker"
    for jacobian, message in [
        ({"reduce": "project", "project": {"structure": "kronecker"}}, "project.structure: kronecker projects the weights"),
        ({"objective": "margin"}, "objective: is what wrt: parameters differentiates"),
        ({"wrt": "parameters", "objective": "margin"}, "objective: margin needs labels"),
        ({"wrt": "parameters", "reduce": "trace"}, "reduce: trace is not for wrt: parameters"),
        ({"wrt": "parameters", "aggregate": "mean"}, "aggregate: is for the input side"),
        ({"wrt": "parameters", "objective": "margin", "labels": {"key": "y"}, "outputs": "argmax"},
         "outputs must be all"),
        ({"wrt": "parameters", "objective": {"loss": "mse"}}, "loss"),
    ]:
        with pytest.raises(config.ConfigError, match=message):
            config.validate({**base, "jacobian": jacobian})


# --- the self-check and its mutants ---------------------------------------------------------------------

def _inputs(kind: str, rng) -> np.ndarray:
    """Ordinary inputs of the conv net: noise, a flat image, saturated units."""
    if kind == "flat":
        return np.full((1, 6, 6, 2), 0.3, np.float32)
    if kind == "saturated":
        return (40.0 * rng.normal(size=(1, 6, 6, 2))).astype(np.float32)
    return rng.normal(size=(1, 6, 6, 2)).astype(np.float32)


MUTANTS = {
    "scaled": lambda d, other: {**d, **{k: v * 1.001 for k, v in d.items() if k in ("projection", "frobenius", "gradient")}},
    "negated": lambda d, other: {**d, **{k: -v for k, v in d.items() if k in ("projection", "gradient")},
                                  **({"frobenius_by_layer": d["frobenius_by_layer"][:, ::-1]} if "frobenius" in d else {})},
    "zeroed": lambda d, other: {**d, **{k: 0 * v for k, v in d.items() if k in ("projection", "frobenius", "gradient")}},
    "swapped sample": lambda d, other: {**d, **{k: other[k] for k in ("projection", "frobenius", "frobenius_by_layer",
                                                                   "gradient") if k in d}},
    "norm x1.5": lambda d, other: {**d, **({"frobenius": d["frobenius"] * 1.5} if "frobenius" in d else
                                          {k: v * 1.5 for k, v in d.items() if k in ("projection", "gradient")})},
    "one layer's norm x1.5": lambda d, other: {**d, **({"frobenius_by_layer": d["frobenius_by_layer"] * np.r_[
        1.0, 1.0, 1.5, 1.0][None, : d["frobenius_by_layer"].shape[1]]} if "frobenius" in d else
        {k: v * 1.5 for k, v in d.items() if k in ("projection", "gradient")})},
}


@pytest.fixture(scope="module")
def checked_engines():
    built = {}
    for kind in ("project", "kronecker", "frobenius", "none"):
        reduction = Reduction(kind="project", project_dim=32, project_structure="kronecker") if kind == "kronecker" \
            else Reduction(kind=kind, project_dim=32)
        for side in (ParameterSide(objective="margin"), ParameterSide(objective="loss", loss="sparse_categorical_crossentropy")):
            options = EngineOptions(parameters=side, reduce=reduction)
            engine = ParameterEngine(loaded("bn_cnn"), (6, 6, 2), options)
            built[kind, side.objective] = engine, checker_for(engine, SelfCheck())
    return built


@pytest.mark.parametrize("inputs", ["noise", "flat", "saturated"])
@pytest.mark.parametrize("kind", ["project", "kronecker", "frobenius", "none"])
def test_every_mutant_is_a_mismatch_and_the_engine_passes(checked_engines, kind, inputs):
    rng = np.random.default_rng(3)
    for objective in ("margin", "loss"):
        engine, checker = checked_engines[kind, objective]
        x = np.concatenate([_inputs(inputs, rng), _inputs("noise", rng)])
        labels = np.array([1, 2])
        datasets, _ = engine.compute(x, labels)
        mine = {k: v[:1] for k, v in datasets.items()}
        other = {k: v[1:] for k, v in datasets.items()}
        record = checker.check([x[:1]], mine, 0, 1)
        assert record["verdict"] in (OK, KINK), record
        # Checked together, as a run's worker checks a shard's samples: each judged as if alone.
        together = checker.check_all([([x[:1]], mutant(mine, other), 0, 1) for mutant in MUTANTS.values()]
                                     + [([x[:1]], mine, 0, 1), ([x[1:]], other, 1, 2)])
        for name, verdict in zip(MUTANTS, together):
            assert verdict["verdict"] == MISMATCH, (name, verdict)

        def untimed(found):
            return {k: v for k, v in found.items() if k != "timing"}

        alone = checker.check([x[1:]], other, 1, 2)
        assert untimed(together[-2]) == untimed(record) and untimed(together[-1]) == untimed(alone), together[-1]


def test_a_relu_a_few_rounding_units_from_its_kink_is_a_kink_and_its_mutants_are_mismatches():
    """A ReLU whose input is one rounding unit above 0 (5.96e-8 at an input of ones), stored as if round-off
    had put it below (the gradient at a point 1e-6 away, as the engine's batched float32 did on ResNet-20):
    moves of one unit cannot reach that side, moves of 16 can (``KINK_UNITS``), so the value passes as a
    kink; scaled, negated or zeroed it has no derivative near the sample and is a mismatch."""
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1, activation="relu"), keras.layers.Dense(3)])
    model.layers[0].set_weights([np.full((64, 1), 1 / 64, np.float32), np.array([-0.99999994], np.float32)])
    model.layers[1].set_weights([np.array([[0.5, -1.0, 2.0]], np.float32), np.array([0.1, 0.2, -0.3], np.float32)])
    engine = ParameterEngine(wrap_model(model, "kinked"), (64,), EngineOptions(parameters=ParameterSide(objective="margin"),
                                                                                reduce=Reduction(kind="none")))
    checker = checker_for(engine, SelfCheck())
    x, label = np.ones((1, 64), np.float32), np.array([2])
    at, _ = engine.compute(x, label)
    assert checker.check([x], at, 0, 2)["verdict"] == OK
    below, _ = engine.compute(x * np.float32(1 - 1e-6), label)  # the ReLU off: its weights' gradients zero
    assert np.abs(below["gradient"] - at["gradient"]).max() > 0.1
    record = checker.check([x], below, 0, 2)
    assert record["verdict"] == KINK, record
    for factor in (1.5, -1.0, 0.0):
        mutant = {**below, "gradient": factor * below["gradient"]}
        assert checker.check([x], mutant, 0, 2)["verdict"] == MISMATCH, factor


@pytest.mark.parametrize("kind", ["project", "frobenius", "none"])
def test_every_mutant_is_a_mismatch_on_a_text_model(kind):
    """Embedding and LayerNormalization by their layer rules, checked against the float64 tape: the engine
    passes, every mutant fails."""
    engine = ParameterEngine(loaded("tokens"), (6,), EngineOptions(parameters=ParameterSide(objective="margin"),
                                                                   reduce=Reduction(kind=kind, project_dim=32)))
    assert engine.path == "layer rules"
    checker = checker_for(engine, SelfCheck())
    x, labels = draw("tokens", np.random.default_rng(4), 2), np.array([3, 0])
    datasets, _ = engine.compute(x, labels)
    mine, other = {k: v[:1] for k, v in datasets.items()}, {k: v[1:] for k, v in datasets.items()}
    assert checker.check([x[:1]], mine, 0, 3)["verdict"] == OK
    for name, mutant in MUTANTS.items():
        assert checker.check([x[:1]], mutant(mine, other), 0, 3)["verdict"] == MISMATCH, name


def test_a_wrong_projection_block_and_a_wrong_row_are_mismatches():
    """The engine's projection with one block of one weight drawn for another block (and, Kronecker, one
    weight's factors drawn from another's streams); and the label's row stored for another output row."""
    import jacobeam.transforms.engine.parameters as parameters

    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 12)).astype(np.float32)
    options = EngineOptions(parameters=ParameterSide(), outputs=OutputSelection("label"),
                            reduce=Reduction(kind="project", project_dim=16))
    right = ParameterEngine(loaded("mlp"), (12,), options)
    checker = checker_for(right, SelfCheck())
    original = parameters.projection_block

    def shifted(seed, kind, weight, block, dim, dtype, *rows):  # weight 0's block from weight 1's stream
        return original(seed, kind, tf.where(tf.equal(weight, 0), 1, weight), block, dim, dtype, *rows)

    parameters.projection_block = shifted
    try:
        wrong = ParameterEngine(loaded("mlp"), (12,), options)
    finally:
        parameters.projection_block = original
    kronecker = dataclasses.replace(options, reduce=dataclasses.replace(options.reduce, project_structure="kronecker"))
    right_factors = ParameterEngine(loaded("mlp"), (12,), kronecker)
    factors_checker = checker_for(right_factors, SelfCheck())
    factors = parameters.projection_factors

    def swapped(seed, kind, weight, matrix, dim, dtype):  # A and B of weight 0 drawn from weight 1's streams
        return factors(seed, kind, tf.where(tf.equal(weight, 0), 1, weight), matrix, dim, dtype)

    parameters.projection_factors = swapped
    try:
        wrong_factors = ParameterEngine(loaded("mlp"), (12,), kronecker)
    finally:
        parameters.projection_factors = factors
    labels = np.array([0, 3, 4])
    stored, _ = wrong.compute(x, labels)
    good, _ = right.compute(x, labels)
    for i in range(3):
        assert checker.check([x[i: i + 1]], {k: v[i: i + 1] for k, v in good.items()}, i, int(labels[i]))["verdict"] == OK
        assert checker.check([x[i: i + 1]], {k: v[i: i + 1] for k, v in stored.items()}, i, int(labels[i]))["verdict"] \
            == MISMATCH
    stored, _ = wrong_factors.compute(x, labels)
    good, _ = right_factors.compute(x, labels)
    for i in range(3):
        sample = [x[i: i + 1]]
        assert factors_checker.check(sample, {k: v[i: i + 1] for k, v in good.items()}, i, int(labels[i]))["verdict"] == OK
        assert factors_checker.check(sample, {k: v[i: i + 1] for k, v in stored.items()}, i, int(labels[i]))["verdict"] \
            == MISMATCH
    other_row = {k: v[:1] for k, v in right.compute(x[:1], np.array([2]))[0].items()}
    record = checker.check([x[:1]], {**other_row, "output_index": np.array([[0]])}, 0, 0)
    assert record["verdict"] == MISMATCH
    record = checker.check([x[:1]], other_row, 0, 0)
    assert record["verdict"] == MISMATCH and "output_index" in record["detail"]


def confident(factory: str, dtype: str = "float32"):
    """The test model ``factory`` (tanh hidden layer, then logits and a softmax) with its logits 60x the seeded
    scale: float32 probabilities of exactly 1 and below 1e-7 for most samples; and ``(W1, b1, W2, b2)``."""
    model = getattr(models, factory)(dtype)
    dense = [layer for layer in model.layers if layer.trainable_weights]
    kernel, bias = dense[-1].get_weights()
    dense[-1].set_weights([60 * kernel, 60 * bias])
    return model, [w for layer in dense for w in layer.get_weights()]


@pytest.mark.parametrize("factory", ["softmax_mlp", "softmax_layer_head"])  # softmax as activation, as a layer
@pytest.mark.parametrize("objective", ["margin", "loss"])
def test_a_softmax_model_objective_is_of_its_logits_where_its_probabilities_saturate(factory, objective):
    """A model ending in a softmax: the margin and the cross-entropy of the label are those of its logits, also
    where float32's probabilities are exactly 1 or below Keras' clip of 1e-7 (from them: a margin of inf, a
    loss clipped with a vanishing gradient); the outputs stored are the probabilities. The truth: the closed
    form in float64 of ``tanh(x W1 + b1) W2 + b2``; the self-check calls the saturated values mismatches."""
    model, weights = confident(factory)
    width = int(model.inputs[0].shape[-1])
    rng = np.random.default_rng(7)
    x = rng.normal(size=(24, width)).astype(np.float32)
    p32 = np.asarray(model(x))
    labels = np.where(np.arange(24) % 2 == 0, p32.argmax(axis=1), p32.argmin(axis=1))  # sure right, sure wrong
    p_label = p32[np.arange(24), labels]
    assert (p_label == 1).any() and (p_label < 1e-7).any()  # float32 saturates both ways
    side = ParameterSide(objective="margin") if objective == "margin" else \
        ParameterSide(objective="loss", loss="sparse_categorical_crossentropy")
    engine = ParameterEngine(wrap_model(model, factory), (width,), EngineOptions(parameters=side,
                                                                                reduce=Reduction(kind="frobenius")))
    assert engine.describe()["outputs_are"] == "probabilities"
    stored, _ = engine.compute(x, labels)

    variables = [tf.Variable(np.asarray(w, np.float64)) for w in weights]
    values, norms, probabilities = [], [], []
    for i in range(24):
        with tf.GradientTape() as tape:
            z = tf.tanh(x[i: i + 1].astype(np.float64) @ variables[0] + variables[1]) @ variables[2] + variables[3]
            z, y = z[0], int(labels[i])
            others = tf.concat([z[:y], z[y + 1:]], 0)
            value = z[y] - tf.reduce_logsumexp(others) if objective == "margin" else tf.reduce_logsumexp(z) - z[y]
        grads = tape.gradient(value, variables)
        probabilities.append(np.asarray(tf.nn.softmax(z)))
        values.append(float(value))
        norms.append(math.sqrt(sum(float(tf.reduce_sum(g * g)) for g in grads)))
    assert np.isfinite(stored["objective"]).all()
    assert_close(stored["objective"], values, rtol=1e-5)
    assert_close(stored["frobenius"], norms, rtol=1e-4)  # a sure-right sample's: float32 has 1 - p_y = 0
    np.testing.assert_allclose(stored["output"], probabilities, rtol=1e-4, atol=1e-30)  # float32's error in |z| ~ 100

    checker = checker_for(engine, SelfCheck())
    with np.errstate(divide="ignore"):  # the objective as the probabilities give it in float32
        saturated = np.log(p_label) - np.log1p(-p_label) if objective == "margin" else -np.log(np.maximum(p_label, 1e-7))
    for i in np.flatnonzero(p_label == 1 if objective == "margin" else p_label < 1e-7)[:2]:  # inf; clipped
        mine = {k: v[i: i + 1] for k, v in stored.items()}
        assert checker.check([x[i: i + 1]], mine, i, int(labels[i]))["verdict"] == OK
        wrong = {**mine, "objective": saturated[i: i + 1].astype(np.float32)}
        assert checker.check([x[i: i + 1]], wrong, i, int(labels[i]))["verdict"] == MISMATCH, (i, saturated[i])


def test_a_margin_of_a_softmax_over_one_of_several_axes_is_refused():
    x = keras.Input((3, 4))
    model = keras.Model(x, keras.layers.Dense(5, activation="softmax")(x))
    with pytest.raises(ModelError, match=r"one softmax over a classifier's outputs; .* outputs \(3, 5\)"):
        ParameterEngine(wrap_model(model, "rows"), (3, 4), EngineOptions(parameters=ParameterSide(objective="margin"),
                                                                         reduce=Reduction(kind="frobenius")))


@pytest.mark.parametrize("groups", [1, 3])  # the inputs whole, or in groups of columns (a stride-one Conv2D's)
@pytest.mark.parametrize("positions, width, height", [(1, 7, 5), (3, 8, 16), (40, 6, 3)])  # |a||b|, Gram, formed
def test_kernel_norms_without_the_gradient_match_the_formed_gradients(positions, width, height, groups):
    rng = np.random.default_rng(positions)
    a, b = rng.normal(size=(5, positions, width)), rng.normal(size=(5, positions, height))
    want = np.array([np.sum((a[i].T @ b[i]) ** 2) for i in range(5)])
    parts = [tf.constant(part, tf.float32) for part in np.array_split(a, groups, axis=2)]
    got = parameter_rules._kernel_squares(parts, tf.constant(b, tf.float32)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.tuples(st.integers(3, 7), st.integers(3, 7)), kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       stride=st.sampled_from([1, 2]), dilation=st.sampled_from([1, 2]), padding=st.sampled_from(["same", "valid"]),
       channels=st.integers(1, 4), filters=st.integers(1, 9), kind=st.sampled_from(["none", "project", "frobenius"]),
       seed=st.integers(0, 2**31))
@example(size=(6, 7), kernel=(2, 3), stride=1, dilation=2, padding="same", channels=2, filters=3, kind="none", seed=1)
@example(size=(7, 6), kernel=(3, 2), stride=1, dilation=1, padding="same", channels=3, filters=4, kind="project", seed=2)
@example(size=(4, 4), kernel=(3, 3), stride=1, dilation=1, padding="valid", channels=4, filters=9, kind="frobenius",
         seed=3)  # 2 x 2 positions, 36 x 9 entries: the Gram way
@example(size=(3, 5), kernel=(2, 3), stride=1, dilation=2, padding="valid", channels=2, filters=2, kind="frobenius",
         seed=4)  # one position: the outer way
@example(size=(6, 5), kernel=(3, 3), stride=2, dilation=1, padding="same", channels=2, filters=3, kind="none", seed=5)
def test_layer_rules_match_a_float64_tape_for_any_convolution_geometry(size, kernel, stride, dilation, padding, channels,
                                                                       filters, kind, seed):
    """A stride-one Conv2D's patches are slices of its padded input, one per kernel offset; a strided one's
    are ``extract_patches``'. Either way, for any kernel, dilation, padding and input size: the per-sample
    gradients, their Kronecker projection and their norms (outer, Gram or formed) are a float64 tape's."""
    assume(stride == 1 or dilation == 1)  # Keras refuses both
    assume(padding == "same" or min(s - (k - 1) * dilation for s, k in zip(size, kernel)) >= 1)
    model = models.conv_geometry(size, kernel, stride, dilation, padding, channels, filters, "float32")
    model64 = models.conv_geometry(size, kernel, stride, dilation, padding, channels, filters, "float64")
    model64.set_weights([w.astype(np.float64) for w in model.get_weights()])
    side = ParameterSide(objective="loss", loss="sparse_categorical_crossentropy")
    reduction = Reduction(kind=kind, project_dim=12, project_seed=seed, project_structure="kronecker")
    engine = ParameterEngine(wrap_model(model, "conv"), (*size, channels),
                             EngineOptions(batch_size=8, parameters=side, reduce=reduction))
    assert engine.path == "layer rules"
    rng = np.random.default_rng(seed)
    x, labels = rng.normal(size=(5, *size, channels)).astype(np.float32), rng.integers(0, 3, 5)
    stored, _ = engine.compute(x, labels)
    grads = []
    for xi, label in zip(x, labels):
        with tf.GradientTape() as tape:
            y = tf.reshape(model64(xi[None].astype(np.float64), training=False), (-1,))
            value = tf.reduce_logsumexp(y) - y[int(label)]
        grads.append(np.concatenate([np.asarray(g).reshape(-1) for g in tape.gradient(value, model64.trainable_variables)]))
    grads = np.stack(grads)
    if kind == "none":
        assert_close(stored["gradient"], grads)
    elif kind == "project":
        assert_close(stored["projection"], projected(grads, None, reduction, engine))
    else:
        assert_close(stored["frobenius"], np.linalg.norm(grads, axis=1))


@pytest.mark.parametrize("name", ["sequence", "mlp", "bn_cnn", "tokens"])
def test_ghost_norms_of_the_layer_rules_match_a_float64_tape(name):
    """reduce: frobenius by layer rules never forms a kernel's gradient where its positions are fewer than its
    entries (the sequence model's first Dense layer: 3 positions), nor an embedding's (6 positions, 88 entries);
    the norms are the tape's."""
    side, shape = ParameterSide(objective="loss", loss="sparse_categorical_crossentropy"), MODELS[name][1]
    formed = mock.Mock(side_effect=AssertionError("an embedding's gradient formed"))
    ways = mock.Mock(wraps=parameter_rules.kernel_norm_way)
    with mock.patch.object(parameter_rules, "_embedding_gradient", formed), \
            mock.patch.object(parameter_rules, "kernel_norm_way", ways):
        engine = ParameterEngine(loaded(name), shape, EngineOptions(parameters=side, reduce=Reduction(kind="frobenius")))
        assert engine.path == "layer rules"
        rng = np.random.default_rng(11)
        x, labels = draw(name, rng, 9), rng.integers(0, engine.outputs, 9)
        stored, _ = engine.compute(x, labels)
    _, grads, chosen = reference(name, side, OutputSelection(), x, labels, None)
    layers = list(dict.fromkeys(layer for _, layer in chosen))
    starts = np.cumsum([0, *[int(np.prod(v.shape)) for v, _ in chosen]])
    by_layer = np.array([[math.sqrt(sum(float(np.sum(g[:, starts[k]: starts[k + 1]] ** 2))
                                        for k, (_, owner) in enumerate(chosen) if owner == layer)) for layer in layers]
                         for g in grads])
    assert_close(stored["frobenius_by_layer"], by_layer)
    assert_close(stored["frobenius"], np.sqrt((by_layer**2).sum(axis=1)))
    chosen_ways = {(c.args, parameter_rules.kernel_norm_way(*c.args)) for c in ways.call_args_list}
    assert all(args[0] is not None for args, _ in chosen_ways)  # the positions known when the graph is built
    if name == "sequence":
        assert ((3, 8, 16), "gram") in chosen_ways


def test_a_layer_without_a_rule_runs_as_itself_where_its_weights_are_not_differentiated():
    """An rms-scaled LayerNormalization and a masking Embedding have no rule; with only the head
    differentiated they run as themselves (the mask reaches the pooling), and the rules still apply."""
    import keras

    model = keras.Sequential([keras.Input((5,)), keras.layers.Embedding(7, 6, mask_zero=True, name="embed"),
                              keras.layers.LayerNormalization(rms_scaling=True, name="norm"),
                              keras.layers.GlobalAveragePooling1D(name="pool"), keras.layers.Dense(3, name="head")])
    models.seeded_weights(model, seed=2)
    side = ParameterSide(objective="margin", layers=("head",))
    options = EngineOptions(parameters=side, reduce=Reduction(kind="none"))
    engine = ParameterEngine(wrap_model(model, "masked"), (5,), options)
    assert engine.path == "layer rules"
    x = np.array([[1, 2, 0, 0, 0], [3, 3, 6, 1, 0]], np.float32)  # padded with id 0, which the mask drops
    labels = np.array([2, 0])
    stored, _ = engine.compute(x, labels)
    for i in range(2):
        with tf.GradientTape() as tape:
            z = model(x[i: i + 1], training=False)[0]
            rest = tf.concat([z[: labels[i]], z[labels[i] + 1:]], 0)
            value = z[labels[i]] - tf.reduce_logsumexp(rest)
        head = model.get_layer("head").trainable_weights
        want = np.concatenate([np.asarray(g).reshape(-1) for g in tape.gradient(value, head)])
        assert_close(stored["gradient"][i], want, rtol=1e-5)


def test_the_first_batch_is_checked_against_the_loop_and_an_out_of_memory_call_retried_smaller():
    options = EngineOptions(parameters=ParameterSide(objective="margin"), reduce=Reduction(kind="project", project_dim=8))
    rng = np.random.default_rng(2)
    x, labels = rng.normal(size=(11, 12)).astype(np.float32), rng.integers(0, 5, 11)

    wrong = ParameterEngine(loaded("mlp"), (12,), options)
    right = wrong._step
    wrong._step = lambda *args: {**right(*args), "projection": 1.5 * right(*args)["projection"]}  # agreed on the probe
    for _ in range(2):  # refused, and refused again
        with pytest.raises(ModelError, match="disagree with a loop of per-sample tape gradients on the first batch"):
            wrong.compute(x, labels)

    engine = ParameterEngine(loaded("mlp"), (12,), options)
    want, _ = engine.compute(x, labels)
    assert engine.describe()["first_batch_check"]["samples"] == 8
    step, sizes = engine._step, []

    def small_only(xs, *rest):  # as if more than 3 elements did not fit
        sizes.append(int(xs[0].shape[0]))
        if sizes[-1] > 3:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
        return step(xs, *rest)

    engine._step, engine.elements = small_only, 16
    got, _ = engine.compute(x, labels)
    assert_close(got["projection"], want["projection"])  # other calls, other round-off
    assert engine.elements == 2 and engine.telemetry["oom_retries"] == 3 and sizes[:4] == [11, 8, 4, 2]
