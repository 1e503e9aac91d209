"""The compiled engine against independent references: a per-sample tape loop and float64 differences."""

import numpy as np
import pytest

from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import build_cnn, build_mlp, load, wrap_model
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import EngineOptions
from tests import models as test_models
from tests.reference import assert_close, central_differences, tape_loop


def _engine(model, batch_size=8, **options):
    return JacobianEngine(wrap_model(model, "test"), model.input_shape[1:], EngineOptions(batch_size=batch_size, **options))


@pytest.mark.parametrize("build", [test_models.small_mlp, test_models.small_cnn, test_models.grid_model,
                                   test_models.scalar_model], ids=["mlp", "cnn", "grid", "scalar"])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_engine_matches_tape_loop_and_finite_differences(build, jit_compile, rng):
    model = build()
    samples = rng.normal(size=(11, *model.input_shape[1:])).astype(np.float32)
    engine = _engine(model, batch_size=8, jit_compile=jit_compile)

    result = engine(samples)

    out_shape = tuple(model.output_shape[1:])
    assert result["jacobian"].shape == (11, *out_shape, *samples.shape[1:])
    assert_close(result["output"], model(samples).numpy(), rtol=1e-6)
    assert_close(result["jacobian"], tape_loop(model, samples), rtol=1e-5)
    fd = central_differences(build("float64"), samples[:3])
    assert_close(result["jacobian"][:3], fd, rtol=1e-4)


@pytest.mark.parametrize("build", [build_mlp, build_cnn], ids=["W1-mlp", "W2-cnn"])
def test_builtin_models_match_references(build, rng):
    model = build()
    samples = rng.random((4, *model.input_shape[1:])).astype(np.float32)
    result = _engine(model, batch_size=4)(samples)
    assert_close(result["jacobian"], tape_loop(model, samples), rtol=1e-5)
    assert_close(result["jacobian"][:2], central_differences(build(dtype="float64"), samples[:2]), rtol=1e-4)


def test_short_batches_do_not_retrace(rng):
    engine = _engine(test_models.small_mlp(), batch_size=8)
    traced = engine.traces  # once per path traced at set-up: reverse layer rules' (the eager reference never traces)
    for n in (8, 3, 1, 8):
        engine(rng.normal(size=(n, 12)).astype(np.float32))
    assert engine.traces == traced == 1
    assert [c["path"] for c in engine.describe()["candidates"]] == ["reverse, eagerly", "reverse by layer rules"]


def test_sample_shape_that_the_model_rejects_is_a_model_error():
    model = test_models.small_mlp()
    with pytest.raises(ModelError, match=r"small_mlp expects samples of shape \(12,\); the inputs hold samples of shape \(7,\)"):
        JacobianEngine(wrap_model(model, "small_mlp"), (7,), EngineOptions(batch_size=2))


def test_fingerprint_hashes_the_weights():
    a, b = load(builtin="mlp"), load(builtin="mlp")
    assert a.fingerprint() == b.fingerprint()
    b.variables[0].assign_add(np.full(b.variables[0].shape, 1e-3, np.float32))
    assert a.fingerprint() != b.fingerprint()


def test_paths_are_compared_over_finite_entries_and_must_agree_on_which_are_finite():
    """The engine's agreement check (XLA, double reverse, batch independence): a NaN must not make every
    comparison pass, as ``nan > tolerance`` would."""
    from jacobeam.transforms.engine import relative_error

    reference = np.array([[1.0, np.nan], [4.0, 2.0]])
    assert relative_error(np.array([[1.0, np.nan], [4.0, 2.2]]), reference) == pytest.approx(0.05)
    assert relative_error(np.array([[1.0, 0.0], [4.0, 2.0]]), reference) == float("inf")
    assert relative_error(np.array([[1.0, np.nan], [np.inf, 2.0]]), reference) == float("inf")
    assert relative_error(np.full((2, 2), np.nan), np.full((2, 2), np.nan)) == 0.0


def test_agreement_is_judged_per_sample():
    """A sample whose Jacobian is small against the batch's is judged at its own scale, down to 1e-2 of
    the batch's: batch-wide, a 50% error of a sample at 1.5e-4 of the batch's scale reads as 7.5e-5,
    below the 1e-4 agreement; so does a 0.15% error at 5e-2 of it."""
    from jacobeam.transforms.engine import relative_error
    from jacobeam.transforms.engine.diagnostics import per_sample_relative_error

    def with_scales(scales):
        """Four samples of (3, 5) entries, sample i's largest entry scales[i]."""
        samples = np.random.default_rng(0).normal(size=(4, 3, 5))
        return samples * (np.asarray(scales) / np.abs(samples).max(axis=(1, 2)))[:, None, None]

    expected = with_scales([1.0, 0.7, 1.5e-4, 5e-2])
    actual = expected.copy()
    actual[2] *= 1.5  # wrong by 50%
    assert relative_error(actual, expected) == pytest.approx(7.5e-5)
    assert per_sample_relative_error(actual, expected) == pytest.approx(0.5 * 1.5e-4 / 1e-2)  # floored at 1e-2
    actual = expected.copy()
    actual[3] *= 1.0015  # wrong by 0.15%
    assert relative_error(actual, expected) == pytest.approx(7.5e-5)
    assert per_sample_relative_error(actual, expected) == pytest.approx(1.5e-3)  # its own error
    actual[1] *= 1.5
    assert per_sample_relative_error(actual, expected) == pytest.approx(0.5)
    assert per_sample_relative_error(expected, expected) == 0.0

    # An all-zero sample's noise does not read as a disagreement; a gross error at the floor's scale does.
    zero = expected.copy()
    zero[2] = 0.0
    noisy = zero.copy()
    noisy[2] = 1e-30
    assert per_sample_relative_error(noisy, zero) == pytest.approx(1e-28)
    noisy[2, 0, 0] = 1e-3
    assert per_sample_relative_error(noisy, zero) == pytest.approx(0.1)

    # Non-finite entries: compared as relative_error does, sample by sample.
    with_nan = expected.copy()
    with_nan[1, 0, 0] = np.nan
    assert per_sample_relative_error(with_nan, with_nan) == 0.0
    assert per_sample_relative_error(expected, with_nan) == float("inf")
    assert per_sample_relative_error(expected[:3], expected) == float("inf")  # a sample missing


def test_aggregates_are_of_the_one_inputs_jacobian_and_refused_for_several_inputs(rng):
    model = test_models.small_mlp()
    x = rng.normal(size=(6, 12)).astype(np.float32)
    _, full = _engine(model, aggregate=("mean", "jtj")).compute(x)
    assert_close(full, tape_loop(model, x), rtol=1e-5)  # (n, rows, d): what aggregates.partial sums

    two = test_models.two_inputs()
    with pytest.raises(ModelError, match=r"^jacobian.aggregate: aggregates are for one-input models; test takes inputs "
                                         r"\['image', 'meta'\]$"):
        JacobianEngine(wrap_model(two, "test"), {"image": (4, 4, 1), "meta": (3,)}, EngineOptions(aggregate=("mean",)))
