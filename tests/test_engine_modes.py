"""Engine modes, XLA, memory budget, multi-input models and guards, each against an independent reference."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

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
from tests.reference import assert_close, central_differences, tape_loop

REPO = Path(__file__).resolve().parent.parent


def _engine(model, wrap_block=None, **options):
    options.setdefault("batch_size", 8)
    return JacobianEngine(wrap_model(model, model.name), model.input_shape[1:], EngineOptions(**options), wrap_block=wrap_block)


def _samples(model, n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, *model.input_shape[1:])).astype(np.float32)


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


def test_xla_failure_falls_back_under_auto_and_is_an_error_when_required():
    model = test_models.not_xla_compilable()
    x = _samples(model, 6)
    engine = _engine(model, jit_compile="auto")
    described = engine.describe()
    assert described["jit_compile"] is False
    assert any("XLA failed" in reason for reason in described["reasons"])
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    with pytest.raises(ModelError, match=r"XLA compilation failed \(jit_compile: true\)"):
        _engine(model, jit_compile=True)


class _Slowed:
    """A compiled block that takes ``seconds`` longer per call: to decide which path the timing picks."""

    def __init__(self, fn, seconds):
        self._fn, self._seconds = fn, seconds

    def __call__(self, *args):
        time.sleep(self._seconds)
        return self._fn(*args)

    def experimental_get_tracing_count(self):
        return self._fn.experimental_get_tracing_count()


@pytest.mark.parametrize("slow", [False, True], ids=["plain-slower", "xla-slower"])
def test_auto_keeps_the_faster_of_xla_and_the_plain_graph(monkeypatch, slow):
    model = test_models.small_mlp()
    real = strategies.build_block

    def slowed(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs):
        fn = real(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs)
        return _Slowed(fn, 0.05) if jit_compile == slow else fn

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", slowed)
    # The plain graph and XLA of pfor's path only: reverse layer rules (never slowed) would win the timing.
    monkeypatch.setattr("jacobeam.transforms.engine.reverse_layer_rules.reverse_unsupported", lambda model: "switched off")
    engine = _engine(model, jit_compile="auto")
    described = engine.describe()
    assert described["jit_compile"] is not slow
    timed = {c["path"]: c["seconds_per_sample"] for c in described["candidates"]}
    assert set(timed) == {"reverse", "reverse + XLA"}
    assert (timed["reverse + XLA"] > timed["reverse"]) is slow
    assert any(reason.startswith("timed on a full batch: reverse ") for reason in described["reasons"])
    x = _samples(model, 3)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_xla_that_disagrees_is_rejected_under_auto_however_fast(monkeypatch):
    model = test_models.small_mlp()
    real = strategies.build_block

    def wrong_under_xla(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs):
        fn = real(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs)
        if not jit_compile:
            return _Slowed(fn, 0.05)
        return tf.function(lambda *args: (lambda y, block: (y, block * 1.01))(*fn(*args)))

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", wrong_under_xla)
    engine = _engine(model, jit_compile="auto")
    assert engine.describe()["jit_compile"] is False
    assert any("disagrees" in reason for reason in engine.describe()["reasons"])
    x = _samples(model, 3)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_required_xla_is_checked_against_the_plain_graph_and_refused_when_it_disagrees(monkeypatch):
    """``jit_compile: true`` runs XLA only, but never unchecked: TensorFlow's forward mode through
    max-pooling under XLA gives wrong Jacobians (W2: relative error 0.13)."""
    model = test_models.small_mlp()
    engine = _engine(model, jit_compile=True)
    described = engine.describe()
    assert described["jit_compile"] is True
    assert {"path": "reverse", "reference_only": True} in described["candidates"]
    assert next(c for c in described["candidates"] if c["path"] == "reverse + XLA")["relative_error"] < 1e-5

    real = strategies.build_block

    def wrong_under_xla(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs):
        fn = real(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs)
        if not jit_compile:
            return fn
        return tf.function(lambda *args: (lambda y, block: (y, block * 1.01))(*fn(*args)))

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", wrong_under_xla)
    with pytest.raises(ModelError, match=r"reverse \+ XLA disagrees with the reference .*use jit_compile auto or false"):
        _engine(model, mode="reverse", jit_compile=True)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_small_budget_forces_blocks_and_smaller_batches(mode):
    model = test_models.small_cnn()  # 64 inputs, 3 outputs
    x = _samples(model, 10)
    engine = _engine(model, mode=mode, memory_budget=6_000)
    described = engine.describe()
    extent = 64 if mode == "forward" else 3
    assert described["batch_size"] < 8 and described["block_rows"]["x"] < extent
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    assert engine.describe()["retraces_after_setup"] == 0


class _OutOfMemory:
    """A ``wrap_block`` that raises TensorFlow's out-of-memory error on chosen block calls (counted from
    1 over every block of the engine, once ``armed``), and records each call's sample count and rows."""

    def __init__(self, fail_calls=(), always=False):
        self.fail_calls, self.always, self.armed = set(fail_calls), always, False
        self.calls = []

    def __call__(self, fn):
        def run(xs, start, given):
            if self.armed:
                self.calls.append(int(xs[0].shape[0]))
                if self.always or len(self.calls) in self.fail_calls:
                    raise tf.errors.ResourceExhaustedError(None, None, "injected OOM")
            return fn(xs, start, given)

        return run


def _plan_sizes(engine, batch, rows):
    """Set an engine's plan to ``batch`` samples per sub-batch and ``rows`` rows per block, without the
    first batch's check against the reference path (its block calls would count among the plan's)."""
    from jacobeam.transforms.engine.budget import Sizes

    plan = engine._plan
    engine._plan = dataclasses.replace(plan, sizes=Sizes(batch, tuple((k, rows) for k, _ in plan.sizes.rows)))
    engine._reference = None


def test_out_of_memory_is_retried_with_smaller_blocks():
    model = test_models.small_cnn()
    x = _samples(model, 7)
    oom = _OutOfMemory(fail_calls=[1])
    engine = _engine(model, mode="reverse", wrap_block=oom)
    oom.armed = True
    result = engine(x)
    described = engine.describe()
    assert described["oom_retries"] == 1 and described["block_rows"]["x"] == 1
    assert_close(result["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_out_of_memory_part_way_recomputes_every_incomplete_sample():
    """The issue's reproduction: 16 samples, 8 per sub-batch, 1 row per block, an OOM on the first block
    call. The retry halved the batch while the loop's step stayed 8, and samples 12-15 came back as
    uninitialised memory with no error."""
    model = test_models.small_mlp()
    x = _samples(model, 16)
    expected = tape_loop(model, x)
    for fail_at in (1, 2, 5, 7):  # the first call; a later row of the first sub-batch; the second sub-batch
        oom = _OutOfMemory(fail_calls=[fail_at])
        engine = _engine(model, mode="reverse", batch_size=8, wrap_block=oom)
        _plan_sizes(engine, batch=8, rows=1)
        oom.armed = True
        result = engine(x)
        assert engine.describe()["oom_retries"] == 1
        assert np.isfinite(result["jacobian"]).all()
        assert_close(result["jacobian"], expected, rtol=1e-5)
        assert_close(result["output"], model(x).numpy(), rtol=1e-6)


def test_out_of_memory_retries_use_the_smaller_batch_for_every_remaining_sample():
    model = test_models.small_mlp()
    x = _samples(model, 16)
    oom = _OutOfMemory(fail_calls=[1, 2])
    engine = _engine(model, mode="reverse", batch_size=8, wrap_block=oom)
    _plan_sizes(engine, batch=8, rows=1)
    oom.armed = True
    result = engine(x)
    # Two failures at one row per block: the batch halves twice; every later call has 2 samples.
    assert oom.calls[:2] == [8, 4] and set(oom.calls[2:]) == {2}
    assert engine.batch_size == 2 and engine.describe()["oom_retries"] == 2
    assert_close(result["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_persistent_out_of_memory_is_a_clear_error():
    model = test_models.small_mlp()
    oom = _OutOfMemory(always=True)
    engine = _engine(model, mode="reverse", batch_size=4, wrap_block=oom, memory_budget=10**9)
    oom.armed = True
    with pytest.raises(ModelError, match=r"\w+: out of memory even for one sample and one row per block "
                                         r"\(samples x rows per block tried: 4 x \{'x': 5\}, .*1 x \{'x': 1\}; "
                                         r"memory_budget 1,000,000,000 bytes\)"):
        engine(_samples(model, 6))


def test_an_error_of_jacobeams_own_code_surfaces_instead_of_a_fallback(monkeypatch):
    """Falling back to another path is for what TensorFlow cannot run; a TypeError raised by jacobeam's
    own code is a bug. (The function is compiled under the engine's file name: raised by jacobeam.)"""
    from jacobeam.transforms.engine import operands

    namespace = {}
    code = "def select(self, n, y, labels):\n    raise TypeError('a bug in jacobeam')\n"
    exec(compile(code, operands.__file__, "exec"), namespace)
    monkeypatch.setattr(operands.Operands, "select", namespace["select"])
    with pytest.raises(TypeError, match="a bug in jacobeam"):
        _engine(test_models.small_mlp(), outputs=OutputSelection(rule="argmax"))


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
    [(test_models.small_mlp, "auto", "reverse by layer rules", "reverse"),
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
    refusal = (r"^factory:tests.models:small_mlp: reverse by layer rules disagrees with the reference path reverse "
               r"on the first batch's samples \(per-sample relative error 0.5 > 0.0001\), though it agreed on the "
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


@pytest.mark.slow
def test_thousand_outputs_on_224x224x3_within_a_2gib_budget():
    """Peak memory is measured in a fresh process: one sample's Jacobian alone is 602 MB."""
    script = REPO / "tests" / "budget_probe.py"
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    assert int(report["batch"]) == 1
    assert float(report["max_rel_error"]) < 1e-5
    assert int(report["growth"]) <= 2 * 2**30, report


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
