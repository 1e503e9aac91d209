"""Differential testing of the Jacobian engine: drawn configurations against an independent reference.

The reference shares nothing with the engine but the model's weights. For each test model (a float32
Keras model and a float64 twin with the same weights) and a fixed pool of samples it holds, once per
process:

- the float64 twin's outputs, and its per-sample Jacobians from ``tf.GradientTape().jacobian`` on one
  sample at a time (no batching, no pfor, no forward mode, no XLA); for the smooth models these are
  checked against central finite differences, so the reference does not even trust TensorFlow's
  gradients;
- for the ReLU-family models, which samples lie on a kink: where the Jacobian is piecewise constant, a
  sample is certified off every kink when its float64 Jacobian does not change under small opposite
  perturbations. A few samples are placed on kinks on purpose (an image with a constant background
  has exact max-pooling ties), as real data has them; there float32 round-off of another batching may
  legitimately pick another one-sided derivative.

The float64 twin of the MobileNet-like model is float32-accurate only: TensorFlow resizes images in
float32 whatever the input dtype (``ModelSpec.float64_exact``).

Selection (``outputs``), reductions and products (``reduce``) are applied to the reference in numpy,
written from the documentation (README "What to store", ``transforms/engine/reductions.py`` and
``transforms/engine/blocks.py`` docstrings), never by calling the engine's helpers. A drawn ``Case``
says what to ask the engine; ``expected`` says what it must store; ``compare`` decides, per sample,
relative to the reference's magnitude for that sample.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction, store_dtype
from tests import models as test_models

POOL = 24  # samples per model; a drawn call takes a slice of them
MODES = ("auto", "reverse", "reverse_loop", "forward", "autotune")
REDUCTIONS = (
    "none", "frobenius", "diagonal", "trace", "slogdet", "max_abs_over_outputs", "sum_abs_over_channels",
    "vjp", "jvp", "project", "basis",
)
SQUARE_ONLY = ("diagonal", "trace", "slogdet")
NEED_ALL_ROWS = ("diagonal", "trace", "slogdet", "vjp", "jvp", "basis")  # README: refused after a row selection
STORE_DTYPES = ("float16", "bfloat16", "float32", "float64")

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


# -- the models and their references ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A test model, with its shapes stated here so that drawing a case builds nothing (``subject``
    checks them against the model)."""

    build: Callable[[str], Any]  # dtype -> Keras model; the same seeded weights every call
    inputs: dict[str, tuple[int, ...]]  # input name -> one sample's shape
    output_shape: tuple[int, ...]
    relu_family: bool = False  # piecewise linear: kinks exist, the Jacobian is piecewise constant
    forward_mode: bool = True  # every op has a forward-mode rule (image resizing has none)
    # Every op of the float64 twin computes in float64. tf.image.resize (Keras' Resizing) computes in
    # float32 whatever its input, forward and backward, so a twin with it is float32-accurate only, and
    # so is the reference.
    float64_exact: bool = True
    kink_samples: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray] | None = None

    @property
    def m(self) -> int:
        return int(np.prod(self.output_shape, dtype=np.int64))

    @property
    def d(self) -> int:
        """Input entries of the first input (the only one that reductions apply to)."""
        return int(np.prod(next(iter(self.inputs.values())), dtype=np.int64))


def _constant_background(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A zero image with one small random patch: the max-pooling windows of the background hold ties."""
    image = np.zeros(shape, np.float32)
    image[2:5, 2:5] = rng.normal(size=(3, 3, *shape[2:]))
    return image


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(test_models.small_mlp, {"x": (12,)}, (5,)),  # dense, tanh
    "cnn": ModelSpec(  # max-pooling
        test_models.small_cnn, {"x": (8, 8, 1)}, (3,), relu_family=True, kink_samples=_constant_background
    ),
    "mobilenet": ModelSpec(  # depthwise convolutions, ReLU6, BatchNormalization, Resizing
        test_models.mobilenet_like, {"x": (6, 6, 3)}, (4,), relu_family=True, forward_mode=False,
        float64_exact=False,
    ),
    "two_inputs": ModelSpec(test_models.two_inputs, {"image": (4, 4, 1), "meta": (3,)}, (5,)),
    "grid": ModelSpec(test_models.grid_model, {"x": (4, 3)}, (2, 3)),  # multi-dimensional output
    "square": ModelSpec(test_models.square_softplus, {"x": (6,)}, (6,)),  # square, softplus
    "scalar": ModelSpec(test_models.scalar_model, {"x": (5,)}, ()),  # one scalar per sample
}
KINK_POSITIONS = (7, 19)  # where kink samples go in a pool: a call of the first n < 8 samples has none


@dataclasses.dataclass(frozen=True)
class Subject:
    """A test model with its sample pool and float64 reference."""

    name: str
    spec: ModelSpec
    model: Any  # the float32 Keras model the engine differentiates
    samples: tuple[np.ndarray, ...]  # per input: (POOL, *input_shape) float32
    labels: np.ndarray  # (POOL,) int64 target outputs for `outputs: label`
    outputs: np.ndarray  # (POOL, m) float64
    jacobians: tuple[np.ndarray, ...]  # per input: (POOL, m, d_k) float64
    kinks: np.ndarray  # (POOL,) bool: the sample lies on a kink (ReLU-family models only)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self.spec.inputs)

    @property
    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.spec.inputs.values())

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.spec.output_shape

    @property
    def m(self) -> int:
        return self.spec.m

    def d(self, k: int = 0) -> int:
        return int(np.prod(self.input_shapes[k], dtype=np.int64))

    @property
    def engine_shapes(self) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
        """What ``JacobianEngine`` takes: one shape, or a mapping for several inputs."""
        if len(self.input_names) == 1:
            return self.input_shapes[0]
        return dict(zip(self.input_names, self.input_shapes))

    def batch(self, start: int, n: int) -> np.ndarray | dict[str, np.ndarray]:
        parts = [x[start : start + n] for x in self.samples]
        return parts[0] if len(parts) == 1 else dict(zip(self.input_names, parts))


def float64_twin(build: Callable[[str], Any], model32) -> Any:
    """The same architecture in float64 with the float32 model's weights (not re-drawn: seeded_weights
    draws in float64 and rounds to the model's dtype, so a twin built from the seed would differ)."""
    twin = build("float64")
    twin.set_weights([w.astype(np.float64) for w in model32.get_weights()])
    return twin


def _tape(model64, shapes: tuple[tuple[int, ...], ...]) -> Callable[[tuple[np.ndarray, ...]], tuple]:
    """``samples -> (outputs (P, m), per input (P, m, d_k) Jacobians)``: one float64 sample per
    ``tf.GradientTape().jacobian``, without pfor (the engine's reverse mode uses pfor)."""
    specs = [tf.TensorSpec((1, *shape), tf.float64) for shape in shapes]

    @tf.function(input_signature=specs)
    def one(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = tf.reshape(model64(list(xs) if len(xs) > 1 else xs[0], training=False), (-1,))
        return y, tape.jacobian(y, list(xs), experimental_use_pfor=False)

    def jacobians(samples: tuple[np.ndarray, ...]) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        outputs, found = [], [[] for _ in samples]
        for i in range(len(samples[0])):
            y, jacs = one(*[x[i : i + 1].astype(np.float64) for x in samples])
            outputs.append(y.numpy())
            for k, jac in enumerate(jacs):
                found[k].append(jac.numpy().reshape(len(y), -1))
        return np.stack(outputs), tuple(np.stack(j) for j in found)

    return jacobians


def _central_differences(model64, samples: tuple[np.ndarray, ...], step: float = 1e-6) -> tuple[np.ndarray, ...]:
    """Per input ``(P, m, d_k)``: central differences of the float64 twin, one input entry at a time."""
    found = []
    for k, x in enumerate(samples):
        rows = []
        for i in range(len(x)):
            d = x[i].size
            base = [np.repeat(s[i : i + 1].astype(np.float64), 2 * d, axis=0) for s in samples]
            offsets = (np.eye(d) * step).reshape(d, *x.shape[1:])
            base[k] = base[k] + np.concatenate([offsets, -offsets])
            ys = model64(base if len(base) > 1 else base[0], training=False).numpy().reshape(2 * d, -1)
            rows.append(((ys[:d] - ys[d:]) / (2 * step)).T)  # (m, d)
        found.append(np.stack(rows))
    return tuple(found)


def _off_kinks(tape, samples: tuple[np.ndarray, ...], jacobians, rng: np.random.Generator) -> np.ndarray:
    """Which samples are certified away from every kink of a piecewise linear model.

    Its Jacobian is constant between kinks, so a kink within reach of a perturbation ``delta`` shows as a
    change of the Jacobian at ``x + delta`` or at ``x - delta`` (of two opposite steps one crosses it).
    The steps, ~1e-3 of the sample's size per direction, are far beyond float32 round-off (~1e-7): a
    certified sample keeps its one-sided derivatives whatever batching computes it.
    """
    certified = np.ones(len(samples[0]), bool)
    for _ in range(3):
        delta = [rng.normal(scale=1e-3, size=x.shape) for x in samples]
        for sign in (1.0, -1.0):
            moved = tuple(x.astype(np.float64) + sign * dx for x, dx in zip(samples, delta))
            _, there = tape(moved)
            for here, other in zip(jacobians, there):
                scale = np.abs(here).max(axis=(1, 2))
                certified &= np.abs(other - here).max(axis=(1, 2)) <= 1e-9 * scale
    return certified


def _pool(spec: ModelSpec, tape, shapes: tuple[tuple[int, ...], ...], rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Standard-normal samples; for a ReLU-family model, redrawn until every sample is certified off
    the kinks, except the deliberate kink samples at ``KINK_POSITIONS``, which must be on one."""
    samples = tuple(rng.normal(size=(POOL, *shape)).astype(np.float32) for shape in shapes)
    if not spec.relu_family:
        return samples
    (x,) = samples
    wanted = np.zeros(POOL, bool)
    if spec.kink_samples is not None:
        wanted[list(KINK_POSITIONS)] = True
        for i in KINK_POSITIONS:
            x[i] = spec.kink_samples(rng, shapes[0])
    for _ in range(20):
        _, jacobians = tape((x,))
        on_kink = ~_off_kinks(tape, (x,), jacobians, rng)
        assert np.all(on_kink[wanted]), "a deliberate kink sample is not on a kink"
        stray = on_kink & ~wanted
        if not stray.any():
            return samples
        x[stray] = rng.normal(size=(int(stray.sum()), *shapes[0]))
    raise AssertionError("could not draw samples away from the kinks")


@functools.cache
def subject(name: str) -> Subject:
    """The model ``name`` with its pool and reference, built once per process."""
    spec = MODELS[name]
    model = spec.build("float32")
    model64 = float64_twin(spec.build, model)
    names, shapes = tuple(spec.inputs), tuple(spec.inputs.values())
    found = tuple(tuple(int(d) for d in t.shape[1:]) for t in model.inputs)
    assert found == shapes and tuple(model.outputs[0].shape[1:]) == spec.output_shape, f"{name}: shapes"
    assert len(names) == 1 or names == tuple(t.name for t in model.inputs), f"{name}: input names"
    rng = np.random.default_rng(sum(map(ord, name)))
    tape = _tape(model64, shapes)
    samples = _pool(spec, tape, shapes, rng)
    outputs, jacobians = tape(samples)

    y32 = model(list(samples) if len(samples) > 1 else samples[0], training=False).numpy().reshape(POOL, -1)
    scale = np.abs(outputs).max(axis=1, keepdims=True)
    assert np.all(np.abs(y32 - outputs) <= 1e-5 * scale), f"{name}: the float64 twin does not reproduce the model"
    if not spec.relu_family:  # finite differences check the reference where it is differentiable everywhere
        for taped, fd in zip(jacobians, _central_differences(model64, samples)):
            error = np.abs(taped - fd).max(axis=(1, 2)) / np.abs(taped).max(axis=(1, 2))
            assert error.max() < 1e-6, f"{name}: tape and finite differences disagree ({error.max():.2g})"
    kinks = np.zeros(POOL, bool)
    if spec.kink_samples is not None:
        kinks[list(KINK_POSITIONS)] = True
    return Subject(
        name=name,
        spec=spec,
        model=model,
        samples=samples,
        labels=rng.integers(0, outputs.shape[1], POOL),
        outputs=outputs,
        jacobians=jacobians,
        kinks=kinks,
    )


# -- what to ask --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn configuration: engine options (with the seeds of any vectors and bases), the engine
    calls to make (slices of the pool), and where to inject an out-of-memory error."""

    model: str
    calls: tuple[tuple[int, int], ...]  # (start, count) in the pool: one engine call each, in order
    batch_size: int = 256
    mode: str = "auto"
    jit_compile: bool | str = False
    memory_budget: int = 2 * 2**30
    compute_dtype: str = "float32"
    store_dtype: str = "float32"
    outputs: OutputSelection = OutputSelection()
    reduce: str = "none"
    vectors: tuple[int, bool] | None = None  # vjp/jvp: (count r, given as one vector without the r axis)
    project: tuple[int, str, int] = (256, "rademacher", 0)  # dim, kind, seed
    basis: tuple[int | None, int | None] = (None, None)  # columns q of basis.input V, p of basis.output U
    wrt: tuple[str, ...] | None = None
    oom: tuple[str, int] | None = None  # ("setup" | "compute", the k-th block call from then on)
    seed: int = 0  # of the vectors and bases


@st.composite
def cases(draw, models: tuple[str, ...] = tuple(MODELS), oom: bool = True) -> Case:
    """Configurations over every option; combinations the engine must refuse are drawn too (less often)."""
    name = draw(st.sampled_from(models))
    s = MODELS[name]
    first = draw(st.integers(1, POOL))
    calls = [(0, first)]
    if draw(st.booleans()):  # a second call on the same engine: another slice, another batching
        start = draw(st.integers(0, POOL - 1))
        calls.append((start, draw(st.integers(1, POOL - start))))
    # All rows half of the time: every reduction allows them.
    rule = draw(st.one_of(st.just("all"), st.sampled_from(["indices", "argmax", "top_k", "label"])))
    selection = OutputSelection(rule)
    if rule == "indices":
        indices = draw(st.lists(st.integers(0, s.m - 1), min_size=1, max_size=4))  # repeats allowed
        selection = OutputSelection("indices", indices=tuple(indices))
    elif rule == "top_k":
        selection = OutputSelection("top_k", k=draw(st.integers(1, s.m)))
    reduce = draw(st.one_of(st.just("none"), st.sampled_from(REDUCTIONS)))
    vectors = basis = None
    project = (256, "rademacher", 0)
    if reduce in ("vjp", "jvp"):
        vectors = draw(st.one_of(st.tuples(st.integers(1, 3), st.just(False)), st.just((1, True))))
    elif reduce == "project":
        project = (draw(st.integers(1, 12)), draw(st.sampled_from(["rademacher", "gaussian"])), draw(st.integers(0, 2**31)))
    elif reduce == "basis":  # (None, None) is drawn too: the engine must refuse it
        basis = (draw(st.none() | st.integers(1, 4)), draw(st.none() | st.integers(1, 4)))
    wrt = None
    if len(s.inputs) > 1 and draw(st.booleans()):
        wrt = tuple(draw(st.lists(st.sampled_from(tuple(s.inputs)), min_size=1, max_size=2, unique=True)))
    injection = None
    if oom and draw(st.booleans()):
        injection = (draw(st.sampled_from(["setup", "compute"])), draw(st.integers(1, 6)))
    return Case(
        model=name,
        calls=tuple(calls),
        batch_size=draw(st.one_of(st.sampled_from([1, 7, 8, 9]), st.integers(1, 2 * POOL))),
        mode=draw(st.sampled_from(MODES)),
        jit_compile=draw(st.sampled_from([False, "auto", True])),
        memory_budget=draw(st.one_of(st.sampled_from([1, 3_000, 30_000, 300_000, 2**62]), st.integers(1, 2**24))),
        compute_dtype=draw(st.sampled_from(["float32", "float64"])),
        store_dtype=draw(st.sampled_from(STORE_DTYPES)),
        outputs=selection,
        reduce=reduce,
        vectors=vectors,
        project=project,
        basis=basis or (None, None),
        wrt=wrt,
        oom=injection,
        seed=draw(st.integers(0, 2**16)),
    )


def fixed_arrays(case: Case, s: Subject) -> dict[str, np.ndarray]:
    """The vjp/jvp vectors and basis matrices of a case, in the shapes their .npy files hold (README:
    vectors ``(r, *output_shape)`` for vjp, ``(r, *input_shape)`` for jvp, or one vector without ``r``;
    ``basis.input`` V ``(d, q)``, ``basis.output`` U ``(m, p)``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    if case.vectors is not None:
        count, single = case.vectors
        shape = s.output_shape if case.reduce == "vjp" else s.input_shapes[0]
        shapes["vectors"] = shape if single else (count, *shape)
    q, p = case.basis
    if q is not None:
        shapes["basis_input"] = (s.d(), q)
    if p is not None:
        shapes["basis_output"] = (s.m, p)
    # One stream per array: its values depend on the seed, its name and its shape only.
    streams = {"vectors": 0, "basis_input": 1, "basis_output": 2}
    return {key: np.random.default_rng([case.seed, streams[key]]).normal(size=shape) for key, shape in shapes.items()}


def engine_options(case: Case, s: Subject, folder: Path) -> EngineOptions:
    """The case as ``EngineOptions``; its vectors and bases are written to .npy files in ``folder``."""
    paths = {}
    for key, array in fixed_arrays(case, s).items():
        path = folder / f"{case.model}-{key}-{case.seed}-{'x'.join(map(str, array.shape))}.npy"
        np.save(path, array)
        paths[key] = str(path)
    dim, kind, seed = case.project
    return EngineOptions(
        batch_size=case.batch_size,
        mode=case.mode,
        jit_compile=case.jit_compile,
        memory_budget=case.memory_budget,
        wrt=case.wrt,
        compute_dtype=case.compute_dtype,
        store_dtype=case.store_dtype,
        outputs=case.outputs,
        reduce=Reduction(
            kind=case.reduce,
            vectors=paths.get("vectors"),
            project_dim=dim,
            project_kind=kind,
            project_seed=seed,
            basis_input=paths.get("basis_input"),
            basis_output=paths.get("basis_output"),
        ),
    )


# -- refusals -----------------------------------------------------------------------------------------


def refusals(case: Case) -> tuple[list[str], list[str]]:
    """Why the engine must refuse the case, and why it may; each reason a pattern of its ModelError.

    Must (README "What to store", and the engine's checks of its options against the model): a
    reduction of a several-input model, a reduction needing every output row after a row selection, a
    square-only reduction of a non-square Jacobian, a basis without either side. May: forward mode
    through an op without a forward-mode rule, when forward mode is asked for or a product needs it
    (products with input-side vectors run in forward mode); XLA that fails or disagrees with the plain
    graph under ``jit_compile: true``.
    """
    spec, must, may = MODELS[case.model], [], []
    if case.reduce != "none" and len(spec.inputs) > 1:
        must.append(r"is for one-input models")
    if case.outputs.rule != "all" and case.reduce in NEED_ALL_ROWS:
        must.append(r"cannot be combined with outputs")
    if case.reduce in SQUARE_ONLY and spec.m != spec.d:
        must.append(r"needs a square Jacobian")
    if case.reduce == "basis" and case.basis == (None, None):
        must.append(r"give jacobian\.basis\.input and/or jacobian\.basis\.output")
    forward_only = case.reduce in ("jvp", "project") or (case.reduce == "basis" and case.basis[0] is not None)
    if not spec.forward_mode and (case.mode == "forward" or forward_only):
        may.append(r"forward mode dropped the tangent")
    if case.jit_compile is True:
        may.append(r"XLA compilation failed|disagrees with the reference")
    return must, may


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


# -- injected out-of-memory errors --------------------------------------------------------------------


class OOMInjector:
    """The engine's ``wrap_block`` seam: counts calls of every compiled block and raises TensorFlow's
    out-of-memory error on the armed one, once."""

    def __init__(self) -> None:
        self.calls = 0
        self.fire_at: int | None = None
        self.fired_rows: int | None = None  # leading dimension of the block call that raised

    def arm(self, after: int) -> None:
        """Fail the ``after``-th block call from now."""
        self.fire_at = self.calls + after

    @property
    def fired(self) -> bool:
        return self.fired_rows is not None

    def wrap(self, block: Callable) -> Callable:
        return _Counted(block, self)


class _Counted:
    def __init__(self, block: Callable, injector: OOMInjector) -> None:
        self._block, self._injector = block, injector

    def __call__(self, *args, **kwargs):
        injector = self._injector
        injector.calls += 1
        if injector.calls == injector.fire_at:
            injector.fired_rows = _leading_dimension(args)
            raise tf.errors.ResourceExhaustedError(None, None, "injected OOM")
        return self._block(*args, **kwargs)

    def __getattr__(self, name: str):  # experimental_get_tracing_count and the like
        return getattr(self._block, name)


def _leading_dimension(args) -> int | None:
    """The batch dimension of the first tensor among a block call's arguments (its samples)."""
    for arg in args:
        if isinstance(arg, (list, tuple)):
            found = _leading_dimension(arg)
            if found is not None:
                return found
        elif hasattr(arg, "shape") and len(arg.shape):
            return int(arg.shape[0])
    return None


def matches_any(message: str, patterns: list[str]) -> bool:
    return any(re.search(pattern, message) for pattern in patterns)
