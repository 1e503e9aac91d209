"""Output selection, reductions, products and projections against references computed from the full
Jacobian in float64 (a per-sample tape loop, then numpy)."""

import numpy as np
import pytest

from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction
from tests import models as test_models
from tests.reference import assert_close, tape_loop


def _engine(model, **options):
    options.setdefault("batch_size", 4)
    return JacobianEngine(wrap_model(model, model.name), model.input_shape[1:], EngineOptions(**options))


def _case(build, n=7, seed=0):
    model = build()
    x = np.random.default_rng(seed).normal(size=(n, *model.input_shape[1:])).astype(np.float32)
    full = tape_loop(model, x).astype(np.float64)  # (n, *out, *in)
    m = int(np.prod(model.output_shape[1:]))
    return model, x, full.reshape(n, m, -1), model(x).numpy().reshape(n, m)


@pytest.mark.parametrize(
    "selection, pick",
    [
        (OutputSelection("indices", indices=(1, 4)), lambda y: np.tile([1, 4], (len(y), 1))),
        (OutputSelection("argmax"), lambda y: y.argmax(axis=1)[:, None]),
        (OutputSelection("top_k", k=2), lambda y: np.argsort(-y, axis=1)[:, :2]),
    ],
    ids=["indices", "argmax", "top_k"],
)
@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_selected_rows_equal_those_rows_of_the_full_jacobian(selection, pick, mode):
    model, x, full, y = _case(test_models.small_mlp)
    result = _engine(model, outputs=selection, mode=mode)(x)
    index = pick(y)
    np.testing.assert_array_equal(result["output_index"], index)
    expected = np.take_along_axis(full, index[:, :, None], axis=1)
    assert_close(result["jacobian"], expected, rtol=1e-5)


def test_label_rows_and_bad_labels():
    model, x, full, _ = _case(test_models.small_mlp)
    labels = np.array([0, 4, 2, 2, 1, 3, 0])
    result = _engine(model, outputs=OutputSelection("label"))(x, labels)
    assert_close(result["jacobian"][:, 0], full[np.arange(7), labels], rtol=1e-5)
    with pytest.raises(ModelError, match=r"label 5 of batch row 1 is not an output index 0..4"):
        _engine(model, outputs=OutputSelection("label"))(x[:2], np.array([0, 5]))


@pytest.mark.parametrize("kind", ["frobenius", "max_abs_over_outputs", "sum_abs_over_channels"])
def test_norm_and_saliency_reductions(kind):
    model, x, full, _ = _case(test_models.small_cnn)
    result = _engine(model, reduce=Reduction(kind))(x)
    assert "jacobian" not in result
    if kind == "frobenius":
        assert_close(result["frobenius"], np.sqrt((full**2).sum(axis=(1, 2))), rtol=1e-5)
    elif kind == "max_abs_over_outputs":
        assert_close(result["saliency"], np.abs(full).max(axis=1).reshape(7, 8, 8, 1), rtol=1e-5)
    else:
        assert_close(result["saliency"], np.abs(full).reshape(7, 3, 8, 8, 1).sum(axis=-1), rtol=1e-5)


def test_saliency_of_the_label_row():
    model, x, full, _ = _case(test_models.small_cnn)
    labels = np.array([2, 0, 1, 1, 0, 2, 2])
    result = _engine(model, outputs=OutputSelection("label"), reduce=Reduction("sum_abs_over_channels"))(x, labels)
    expected = np.abs(full[np.arange(7), labels]).reshape(7, 1, 8, 8, 1).sum(axis=-1)
    assert_close(result["saliency"], expected, rtol=1e-5)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_square_reductions_of_a_coupling_flow(mode):
    model, x, full, _ = _case(test_models.coupling_flow)
    sign, logabsdet = np.linalg.slogdet(full)
    slog = _engine(model, reduce=Reduction("slogdet"), mode=mode, store_dtype="float64")(x)
    np.testing.assert_array_equal(slog["sign"], sign)
    np.testing.assert_allclose(slog["logabsdet"], logabsdet, atol=1e-5)
    assert_close(_engine(model, reduce=Reduction("trace"))(x)["trace"], np.trace(full, axis1=1, axis2=2), rtol=1e-5)
    assert_close(_engine(model, reduce=Reduction("diagonal"))(x)["diagonal"], np.diagonal(full, axis1=1, axis2=2), rtol=1e-5)


def test_square_reductions_refuse_a_non_square_model():
    with pytest.raises(ModelError, match=r"reduce slogdet: needs a square Jacobian; .* maps 12 input entries to 5 outputs"):
        _engine(test_models.small_mlp(), reduce=Reduction("slogdet"))


def test_vjp_and_jvp_with_fixed_vectors(tmp_path):
    model, x, full, _ = _case(test_models.grid_model)  # in (4, 3), out (2, 3)
    rng = np.random.default_rng(9)
    u = rng.normal(size=(2, 2, 3))
    v = rng.normal(size=(3, 4, 3))
    np.save(tmp_path / "u.npy", u)
    np.save(tmp_path / "v.npy", v)
    vjp = _engine(model, reduce=Reduction("vjp", vectors=str(tmp_path / "u.npy")))
    assert vjp.describe()["mode"] == "reverse"
    expected = np.einsum("rm,nmd->nrd", u.reshape(2, 6), full).reshape(7, 2, 4, 3)
    assert_close(vjp(x)["vjp"], expected, rtol=1e-5)
    jvp = _engine(model, reduce=Reduction("jvp", vectors=str(tmp_path / "v.npy")))
    assert jvp.describe()["mode"] == "forward"
    expected = np.einsum("nmd,rd->nrm", full, v.reshape(3, 12)).reshape(7, 3, 2, 3)
    assert_close(jvp(x)["jvp"], expected, rtol=1e-5)
    np.save(tmp_path / "bad.npy", rng.normal(size=(2, 5)))
    with pytest.raises(ModelError, match=r"jacobian.vectors .*bad.npy: shape \(2, 5\); expected \(r, 2, 3\)"):
        _engine(model, reduce=Reduction("vjp", vectors=str(tmp_path / "bad.npy")))


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_projection_is_reproducible_from_the_stored_seed(kind):
    model, x, full, _ = _case(test_models.small_cnn)
    result = _engine(model, reduce=Reduction("project", project_dim=5, project_kind=kind, project_seed=11))(x)
    # The recipe documented in the README, rebuilt here by hand.
    rng = np.random.default_rng(11)
    matrix = rng.choice([-1.0, 1.0], size=(64, 5)) if kind == "rademacher" else rng.standard_normal((64, 5))
    assert_close(result["projection"], (full @ (matrix / np.sqrt(5))).reshape(7, 3, 5), rtol=1e-5)


@pytest.mark.parametrize(
    ("outputs", "dim", "mode", "expected_mode"),
    [
        (OutputSelection("indices", indices=(1,)), 5, "auto", "reverse"),  # 1 backward pass, not 5 JVPs
        (OutputSelection("all"), 5, "auto", "reverse"),  # 3 output rows, 5 vectors
        (OutputSelection("all"), 2, "auto", "forward"),  # 2 vectors, 3 output rows
        (OutputSelection("indices", indices=(1,)), 5, "forward", "forward"),  # as configured
    ],
)
def test_a_projection_runs_in_the_mode_with_fewer_passes(outputs, dim, mode, expected_mode):
    """``mode: auto`` counts a product's vectors against the output rows: J P of one label's row on an
    ImageNet net is one backward pass where forward mode traced 256 JVPs (minutes of set-up)."""
    from jacobeam.transforms.engine.reductions import projection_matrix

    model, x, full, _ = _case(test_models.small_cnn)  # m = 3, d = 64
    engine = _engine(model, mode=mode, outputs=outputs, reduce=Reduction("project", project_dim=dim))
    assert engine.describe()["mode"] == expected_mode
    rows = full if outputs.rule == "all" else full[:, list(outputs.indices)]
    expected = rows @ projection_matrix(64, dim, "rademacher", 0)
    assert_close(engine(x)["projection"].reshape(expected.shape), expected, rtol=1e-5)


@pytest.mark.parametrize("sides", ["output", "input", "both"])
def test_basis_projection(tmp_path, sides):
    model, x, full, _ = _case(test_models.small_mlp)  # m = 5, d = 12
    rng = np.random.default_rng(4)
    u, v = rng.normal(size=(5, 2)), rng.normal(size=(12, 3))
    np.save(tmp_path / "u.npy", u)
    np.save(tmp_path / "v.npy", v)
    reduction = Reduction(
        "basis",
        basis_output=str(tmp_path / "u.npy") if sides != "input" else None,
        basis_input=str(tmp_path / "v.npy") if sides != "output" else None,
    )
    left = u.T if sides != "input" else np.eye(5)
    right = v if sides != "output" else np.eye(12)
    result = _engine(model, reduce=reduction)(x)["basis_projection"]
    assert_close(result, np.einsum("pm,nmd,dq->npq", left, full, right), rtol=1e-5)
