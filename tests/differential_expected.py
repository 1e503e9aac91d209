"""What a drawn ``Case`` must store, and whether it did: the differential tests' expectations.

Selection (``outputs``), reductions and products (``reduce``) are applied to the float64 reference
(``tests/differential_models.py``) in numpy, written from the documentation (``docs/what-to-store.md``,
``transforms/engine/reductions.py`` and ``transforms/engine/blocks.py`` docstrings), never by calling
the engine's helpers. ``expected`` says what the engine must store; ``compare`` decides, per sample,
relative to the reference's magnitude for that sample.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from jacobeam.transforms.spec import store_dtype
from tests.differential import Case, fixed_arrays
from tests.differential_models import MODELS, Subject

# Tolerance of a result computed in each dtype, relative to the magnitudes the computation went through
# (``Expected.scale``): a float32 computation against a float64 reference (different order of operations,
# ~1e-6 seen), or float64 against float64. Rounding to the store dtype adds twice its unit roundoff of
# the reference's own magnitude.
COMPUTE_TOLERANCE = {"float32": 1e-4, "float64": 1e-8}
# On a kink, another one-sided derivative is as right as the reference's; it is still a Jacobian of the
# same model at the same point, never larger than the reference's own scale.
KINK_BOUND = 1.0


def compute_tolerance(case: Case) -> float:
    """``COMPUTE_TOLERANCE`` of the case's compute dtype; float32's for a model that is not float64
    throughout (``ModelSpec.float64_exact``)."""
    exact = MODELS[case.model].float64_exact
    return COMPUTE_TOLERANCE[case.compute_dtype if exact else "float32"]


def unit_roundoff(name: str) -> float:
    return float(ml_dtypes.finfo(store_dtype(name)).eps) / 2


# -- what to expect -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Expected:
    """A dataset's reference ``value`` (float64, the stored shape) and, per sample, the ``scale`` its
    error is relative to; or (``slack``) an absolute error allowed per sample."""

    value: np.ndarray
    scale: np.ndarray | None = None
    slack: np.ndarray | None = None
    check_sign: np.ndarray | None = None  # slogdet's sign: (n,) bool, where the determinant is clear of 0


def projection_matrix(d: int, dim: int, kind: str, seed: int) -> np.ndarray:
    """``P`` ``(d, dim)`` re-derived from the README: ``numpy.random.default_rng(seed)``; rademacher:
    ``rng.choice([-1.0, 1.0], size=(d, dim))``, gaussian: ``rng.standard_normal((d, dim))``; both
    divided by ``sqrt(dim)``."""
    rng = np.random.default_rng(seed)
    values = rng.choice([-1.0, 1.0], size=(d, dim)) if kind == "rademacher" else rng.standard_normal((d, dim))
    return values / math.sqrt(dim)


def _per_sample_max(a: np.ndarray) -> np.ndarray:
    return np.abs(a).reshape(len(a), -1).max(axis=1)


def check_selection(case: Case, s: Subject, start: int, index: np.ndarray) -> list[str]:
    """The stored ``output_index`` is what the rule picks on the reference outputs, near-ties allowed
    (the engine picks on its own outputs, computed in its compute dtype)."""
    n = len(index)
    y = s.outputs[start : start + n]
    tie = compute_tolerance(case) * np.abs(y).max(axis=1)
    rule, problems = case.outputs.rule, []
    expected_k = case.outputs.count
    if index.shape != (n, expected_k) or index.dtype != np.int64:
        return [f"output_index: shape {index.shape} dtype {index.dtype}, expected ({n}, {expected_k}) int64"]
    if rule == "indices":
        if not np.array_equal(index, np.broadcast_to(case.outputs.indices, index.shape)):
            problems.append(f"output_index: {index.tolist()} for indices {case.outputs.indices}")
    elif rule == "label":
        labels = s.labels[start : start + n]
        if not np.array_equal(index[:, 0], labels):
            problems.append(f"output_index: {index[:, 0].tolist()} for labels {labels.tolist()}")
    else:
        for i in range(n):
            row, chosen = y[i], index[i]
            if len(set(chosen.tolist())) != len(chosen) or chosen.min() < 0 or chosen.max() >= s.m:
                problems.append(f"output_index[{i}] = {chosen.tolist()}: not {len(chosen)} distinct outputs")
                continue
            values, others = row[chosen], np.delete(row, chosen)
            ordered = np.all(values[:-1] >= values[1:] - tie[i])
            largest = not len(others) or values.min() >= others.max() - tie[i]
            if not (ordered and largest):
                problems.append(f"output_index[{i}] = {chosen.tolist()}: not the {rule} of outputs {row.tolist()}")
    return problems


def expected(case: Case, s: Subject, start: int, n: int, index: np.ndarray | None) -> dict[str, Expected]:
    """Every dataset the engine must return for pool samples ``[start, start + n)``; rows of a
    selection are those of the stored ``index`` (checked by ``check_selection``).

    Scales: a dataset's error bound for a sample is relative to the largest entry of the same quantity
    computed with absolute values over every output row (``|U|^T |J| |V|`` for products, ``|J|`` for
    the Jacobian's entries), so that cancellations and small selected rows are judged against the
    magnitudes the computation actually went through.
    """
    sl = slice(start, start + n)
    found = {"output": Expected(s.outputs[sl].reshape(n, *s.output_shape), scale=_per_sample_max(s.outputs[sl]))}
    rows_shape = s.output_shape if index is None else (index.shape[1],)
    wrt = case.wrt or s.input_names
    full = {k: s.jacobians[k][sl] for k in range(len(s.input_names))}  # (n, m, d_k)
    chosen = {k: j if index is None else np.take_along_axis(j, index[:, :, None], axis=1) for k, j in full.items()}
    kind = case.reduce
    if kind == "none":
        for name in wrt:
            k = s.input_names.index(name)
            key = "jacobian" if len(s.input_names) == 1 else f"jacobian/{name}"
            found[key] = Expected(chosen[k].reshape(n, *rows_shape, *s.input_shapes[k]), scale=_per_sample_max(full[k]))
        return found
    j, jf, shape = chosen[0], full[0], s.input_shapes[0]
    biggest = _per_sample_max(jf)
    if kind == "frobenius":
        found["frobenius"] = Expected(np.sqrt((j**2).sum(axis=(1, 2))), scale=np.sqrt((jf**2).sum(axis=(1, 2))))
    elif kind == "diagonal":
        found["diagonal"] = Expected(np.diagonal(jf, axis1=1, axis2=2), scale=biggest)
    elif kind == "trace":
        diagonal = np.diagonal(jf, axis1=1, axis2=2)
        found["trace"] = Expected(diagonal.sum(axis=1), scale=np.maximum(np.abs(diagonal).sum(axis=1), biggest))
    elif kind == "slogdet":
        sign, logabsdet = np.linalg.slogdet(jf)
        # d log|det J| = tr(J^-1 dJ): at most ||J^-1||_F ||dJ||_F, with |dJ| entries up to tol * max|J|.
        tol = compute_tolerance(case)
        slack = tol * s.d() * biggest * np.linalg.norm(np.linalg.inv(jf), axis=(1, 2))
        slack = slack + 2 * unit_roundoff(case.store_dtype) * np.abs(logabsdet)
        found["sign"] = Expected(sign, slack=np.zeros(n), check_sign=slack < 0.5)
        found["logabsdet"] = Expected(logabsdet, slack=slack)
    elif kind == "max_abs_over_outputs":
        found["saliency"] = Expected(np.abs(j).max(axis=1).reshape(n, *shape), scale=biggest)
    elif kind == "sum_abs_over_channels":
        per_channel = np.abs(j).reshape(n, *rows_shape, *shape).sum(axis=-1)
        scale = _per_sample_max(np.abs(jf).reshape(n, -1, shape[-1]).sum(axis=-1))
        found["saliency"] = Expected(per_channel, scale=scale)
    else:
        arrays = fixed_arrays(case, s)
        if kind == "vjp":
            u = arrays["vectors"].reshape(-1, s.m)  # (r, m)
            value = np.einsum("rm,nmd->nrd", u, j).reshape(n, len(u), *shape)
            scale = _per_sample_max(np.einsum("rm,nmd->nrd", np.abs(u), np.abs(jf)))
            found["vjp"] = Expected(value, scale=scale)
        elif kind == "jvp":
            v = arrays["vectors"].reshape(-1, s.d())  # (r, d)
            value = np.einsum("nmd,rd->nrm", j, v).reshape(n, len(v), *s.output_shape)
            scale = _per_sample_max(np.einsum("nmd,rd->nrm", np.abs(jf), np.abs(v)))
            found["jvp"] = Expected(value, scale=scale)
        elif kind == "project":
            p = projection_matrix(s.d(), *case.project)
            value = (j @ p).reshape(n, *rows_shape, p.shape[1])
            found["projection"] = Expected(value, scale=_per_sample_max(np.abs(jf) @ np.abs(p)))
        elif kind == "basis":
            u = arrays.get("basis_output", np.eye(s.m))  # (m, p); a missing side is the identity
            v = arrays.get("basis_input", np.eye(s.d()))  # (d, q)
            value = np.einsum("mp,nmd,dq->npq", u, j, v)
            scale = _per_sample_max(np.einsum("mp,nmd,dq->npq", np.abs(u), np.abs(jf), np.abs(v)))
            found["basis_projection"] = Expected(value, scale=scale)
    return found


# -- comparing ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Verdict:
    """The outcome of comparing one call's datasets: ``problems`` fail the test; ``kink_samples`` are
    pool positions of samples on a kink that differed within the allowance (reported)."""

    problems: list[str] = dataclasses.field(default_factory=list)
    kink_samples: set[int] = dataclasses.field(default_factory=set)
    worst: float = 0.0  # the largest error relative to the tolerance over the samples held strictly


def compare(
    datasets: dict[str, np.ndarray], want: dict[str, Expected], case: Case, s: Subject, start: int,
    from_hdf5: bool = False,
) -> Verdict:
    """Every dataset against its reference, per sample (see ``Expected``).

    Float datasets come in the store dtype; read back from HDF5 (``from_hdf5``), bfloat16 comes as
    float32 (docs/configuration.md: "a 2-byte HDF5 float that h5py reads as float32") holding bfloat16 values.

    Non-finite entries must be where the reference, rounded to the store dtype, has them, and equal
    to them. A sample on a kink (ReLU-family models) may exceed the tolerance of its Jacobian-derived
    datasets, never ``KINK_BOUND`` nor the tolerance of its outputs (outputs are continuous at kinks).
    """
    verdict = Verdict()
    store = store_dtype(case.store_dtype)
    tol, rounding = compute_tolerance(case), 2 * unit_roundoff(case.store_dtype)
    atol = float(ml_dtypes.finfo(store).smallest_subnormal)  # underflow to the store dtype's subnormals
    extra = sorted(set(datasets) - set(want) - {"output_index"})
    missing = sorted(set(want) - set(datasets))
    if extra or missing:
        verdict.problems.append(f"datasets: unexpected {extra}, missing {missing}; got {sorted(datasets)}")
    for name in sorted(set(want) & set(datasets)):
        actual, reference = datasets[name], want[name]
        read_as = np.dtype(np.float32) if from_hdf5 and case.store_dtype == "bfloat16" else store
        if actual.shape != reference.value.shape or actual.dtype != read_as:
            verdict.problems.append(
                f"{name}: shape {actual.shape} dtype {actual.dtype}, expected {reference.value.shape} {read_as}"
            )
            continue
        if read_as != store and not np.array_equal(actual.astype(store).astype(read_as), actual, equal_nan=True):
            verdict.problems.append(f"{name}: values not representable in {store}")
            continue
        got = actual.astype(np.float64)
        rounded = reference.value.astype(store).astype(np.float64)
        finite = np.isfinite(rounded)
        same = (got == rounded) | (np.isnan(got) & np.isnan(rounded))
        mismatch = (finite != np.isfinite(got)) | (~finite & ~same)
        if mismatch.any():
            bad = sorted({start + i for i in np.argwhere(mismatch)[:, 0]})
            verdict.problems.append(f"{name}: non-finite entries differ from the reference at pool samples {bad}")
            continue
        difference = np.where(finite, np.abs(got - reference.value), 0.0).reshape(len(got), -1)
        if reference.slack is not None:
            allowed = reference.slack + atol
            if reference.check_sign is not None:
                allowed = np.where(reference.check_sign, allowed, np.inf)
            gross = np.zeros(len(got), bool)
        else:
            scale = np.maximum(reference.scale, np.finfo(np.float64).tiny)
            allowed = tol * scale + rounding * _per_sample_max(reference.value) + atol
            gross = (difference / scale[:, None]).max(axis=1, initial=0.0) > KINK_BOUND
        ratio = (difference / np.maximum(allowed, np.finfo(float).tiny)[:, None]).max(axis=1, initial=0.0)
        for i in np.flatnonzero(ratio > 1):
            position = start + i
            if name != "output" and s.kinks[position] and not gross[i]:
                verdict.kink_samples.add(position)
                continue
            verdict.problems.append(
                f"{name}: pool sample {position}: error {ratio[i]:.3g} x the allowed {allowed[i]:.2g}"
                f"{' (on a kink, beyond the bound)' if s.kinks[position] else ''}; "
                f"got {_brief(got[i])}, expected {_brief(reference.value[i])}"
            )
        held = [ratio[i] for i in range(len(got)) if not s.kinks[start + i]]
        verdict.worst = max(verdict.worst, *held, 0.0)
    return verdict


def _brief(a: np.ndarray) -> str:
    flat = np.asarray(a, np.float64).ravel()
    return np.array2string(flat[:6], precision=4) + (" ..." if flat.size > 6 else "")
