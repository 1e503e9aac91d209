"""The models of the differential tests and their independent float64 reference (``tests/differential.py``
draws what to ask of them; ``tests/differential_expected.py`` says what must be stored, from this reference).

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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tests import models as test_models

POOL = 24  # samples per model; a drawn call takes a slice of them

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
