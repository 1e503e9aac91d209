"""Differential testing of the Jacobian engine: drawn configurations against an independent reference.

The models and their float64 reference are in ``tests/differential_models.py``; what each drawn case
must store, and the per-sample comparison, in ``tests/differential_expected.py``. Here: a ``Case`` says
what to ask the engine (``cases`` draws it over every option), ``refusals`` which combinations it must
refuse and how, and ``OOMInjector`` where an out-of-memory error is injected.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction
from tests.differential_models import MODELS, POOL, Subject

MODES = ("auto", "reverse", "reverse_loop", "forward", "autotune")
REDUCTIONS = (
    "none", "frobenius", "diagonal", "trace", "slogdet", "max_abs_over_outputs", "sum_abs_over_channels",
    "vjp", "jvp", "project", "basis",
)
SQUARE_ONLY = ("diagonal", "trace", "slogdet")
NEED_ALL_ROWS = ("diagonal", "trace", "slogdet", "vjp", "jvp", "basis")  # README: refused after a row selection
STORE_DTYPES = ("float16", "bfloat16", "float32", "float64")


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
