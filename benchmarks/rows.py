"""The in-memory rows: each builds a function ``x[b, *input_shape] -> J[b, *output_shape, *input_shape]``
(float32 numpy) for one workload, from the workload's numpy weights.

A row is described by a ``RowSpec`` (plain data, sent to the worker process that measures it); the
framework is imported only by the builder that needs it.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.workloads import Workload, keras_model, weights

# The modes the engine is getting (issue 5), for an ``EngineOptions.mode`` typed as a plain ``str``.
KNOWN_MODES = ("auto", "reverse", "forward", "autotune")
BASELINE = "engine"  # the row every other row's speed is divided by


@dataclass(frozen=True)
class RowSpec:
    id: str
    label: str
    kind: str  # tf_eager_loop | tf_batch_jacobian | jax | torch | engine | pipeline | cli
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def in_memory(self) -> bool:
        return self.kind not in ("pipeline", "cli")


@dataclass
class Built:
    """A row's Jacobian function, ready to call (traced or compiled on its first call at most)."""

    jacobians: Callable[[np.ndarray], np.ndarray]
    batch: int | None = None  # the batch it was built for (engine); None: any batch
    per_sample: bool = False  # loops over samples: the batch size does not matter


def engine_modes() -> tuple[list[str], str | None]:
    """The values of ``EngineOptions.mode`` and its default, or ``([], None)`` when the engine has no
    modes yet (another change adds them; the suite runs with and without)."""
    from jacobeam.transforms.spec import EngineOptions

    fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
    if "mode" not in fields:
        return [], None
    hint = typing.get_type_hints(EngineOptions)["mode"]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
    else:
        values = [str(v) for v in typing.get_args(hint) if isinstance(v, str)] or list(KNOWN_MODES)
    default = fields["mode"].default
    return values, str(getattr(default, "value", default))


def row_specs(modes: list[str], default_mode: str | None, peers: dict[str, bool]) -> list[RowSpec]:
    """Every row for one workload, reference (the status quo) first."""
    batch_jacobian = "TF tf.function batch_jacobian"
    rows = [
        RowSpec("tf_eager_loop", "TF eager per-sample tape.jacobian (status quo)", "tf_eager_loop"),
        RowSpec("tf_batch_jacobian", batch_jacobian, "tf_batch_jacobian", {"jit_compile": False}),
        RowSpec("tf_batch_jacobian_xla", f"{batch_jacobian}, XLA", "tf_batch_jacobian", {"jit_compile": True}),
    ]
    if peers.get("jax"):
        rows += [RowSpec(f"jax_{m}", f"JAX jit(vmap({m}))", "jax", {"transform": m}) for m in ("jacrev", "jacfwd")]
    if peers.get("torch"):
        rows += [
            RowSpec(f"torch_{m}", f"torch.func vmap({m})", "torch", {"transform": m}) for m in ("jacrev", "jacfwd")
        ]
    suffix = f", mode={default_mode}" if default_mode else ""
    rows += [
        RowSpec(BASELINE, f"jacobeam engine{suffix}", "engine", {"jit_compile": False, "mode": default_mode}),
        RowSpec("engine_xla", f"jacobeam engine{suffix}, XLA", "engine", {"jit_compile": True, "mode": default_mode}),
        RowSpec(
            "engine_jit_auto", f"jacobeam engine{suffix}, jit_compile=auto", "engine",
            {"jit_compile": "auto", "mode": default_mode},
        ),
    ]
    rows += [
        RowSpec(f"engine_{m}", f"jacobeam engine, mode={m}", "engine", {"jit_compile": False, "mode": m})
        for m in modes
        if m != default_mode
    ]
    rows += [
        RowSpec("pipeline_1proc", "jacobeam pipeline, in-process (runner.run)", "pipeline", {"workers": 1}),
        RowSpec("pipeline_2proc", "jacobeam pipeline, 2 worker processes (runner.run)", "pipeline", {"workers": 2}),
        RowSpec("cli", "jacobeam command (python -m jacobeam run)", "cli", {"workers": 1}),
    ]
    return rows


def build(row: RowSpec, workload: Workload) -> Built:
    """The row's Jacobian function for ``workload``; the builders below import their framework."""
    builders: dict[str, Callable[..., Built]] = {
        "tf_eager_loop": _tf_eager_loop,
        "tf_batch_jacobian": _tf_batch_jacobian,
        "jax": _jax,
        "torch": _torch,
        "engine": _engine,
    }
    return builders[row.kind](workload, **row.params)


def _tf_eager_loop(workload: Workload) -> Built:
    """The seed's status quo: one eager ``tape.jacobian`` per sample."""
    import tensorflow as tf

    model = keras_model(workload)

    def jacobians(x: np.ndarray) -> np.ndarray:
        found = []
        for sample in x:
            sample = tf.constant(sample[None])
            with tf.GradientTape() as tape:
                tape.watch(sample)
                y = model(sample, training=False)[0]
            found.append(tape.jacobian(y, sample).numpy().reshape(*workload.output_shape, *workload.input_shape))
        return np.stack(found)

    return Built(jacobians, per_sample=True)


def _tf_batch_jacobian(workload: Workload, jit_compile: bool) -> Built:
    """The seed's answer: ``tape.batch_jacobian`` in a ``tf.function`` with a fixed input signature."""
    import tensorflow as tf

    model = keras_model(workload)
    spec = tf.TensorSpec((None, *workload.input_shape), tf.float32)

    @tf.function(input_signature=[spec], jit_compile=jit_compile)
    def batch_jacobian(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=False)
        return tape.batch_jacobian(y, x)

    return Built(lambda x: batch_jacobian(tf.constant(x)).numpy())


def _jax(workload: Workload, transform: str) -> Built:
    import jax

    from benchmarks.peers import jax_function

    f = jax_function(workload, weights(workload))
    compiled = jax.jit(jax.vmap(getattr(jax, transform)(f)))
    return Built(lambda x: np.asarray(compiled(x)))  # np.asarray waits for the result


def _torch(workload: Workload, transform: str) -> Built:
    import torch.func

    from benchmarks.peers import torch_function

    batched = torch.func.vmap(getattr(torch.func, transform)(torch_function(workload, weights(workload))))
    return Built(lambda x: batched(torch.from_numpy(x)).numpy())


def _engine(workload: Workload, jit_compile: bool, mode: str | None, batch_size: int = 256) -> Built:
    """jacobeam's engine in memory, on the model the pipeline loads for ``workload.factory``."""
    from jacobeam.transforms.engine import JacobianEngine
    from jacobeam.transforms.engine.models import load
    from jacobeam.transforms.spec import EngineOptions

    options: dict[str, Any] = {"batch_size": batch_size, "jit_compile": jit_compile}
    if mode is not None:
        hint = typing.get_type_hints(EngineOptions)["mode"]
        options["mode"] = hint(mode) if isinstance(hint, type) and issubclass(hint, enum.Enum) else mode
    engine = JacobianEngine(load(factory=workload.factory), workload.input_shape, EngineOptions(**options))
    return Built(lambda x: engine(x)["jacobian"], batch=batch_size)
