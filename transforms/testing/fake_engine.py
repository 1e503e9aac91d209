"""A closed-form stand-in for ``JacobianEngine``, in numpy: tests of reading, writing, finalizing and
resuming run without TensorFlow computing anything (as Beam's own tests run ``RunInference`` with a
``FakeModelHandler``).

The "model" maps one sample ``x`` (flattened to ``d = prod(input_shape)`` entries) to ``m`` outputs::

    y_r(x) = sum_j A[r, j] x_j + 1/2 sum_j B[r, j] x_j**2

so its Jacobian is ``J[r, j] = A[r, j] + B[r, j] x_j``: a different matrix for every sample, computed
entrywise (one multiply and one add in float64, then rounded once to the store dtype), hence the same
bits however the samples are batched. ``A`` and ``B`` ``(m, d)`` are seeded standard-normal draws
(``coefficients``); a test computes the expected Jacobian from them on its own.

Use it through the engine seam of the compute transform::

    ComputeJacobians(model, input_shape, options, engine_factory=FakeEngineFactory())
    runner.run(config, beam_args, pipeline=TestPipeline(...), engine_factory=FakeEngineFactory())

It supports what the plumbing needs: one input, ``outputs: all``, ``reduce: none``, every store dtype
and ``aggregate``; other options are a ``ModelError`` when the engine is built. The model named in
the job (``ModelSource``) is never loaded. The run's self-check recomputes samples with TensorFlow
from the real engine's model and operands, which this engine does not have: a run with the fake engine
sets ``jacobian.self_check.samples: 0`` (``SelfCheck(samples=0)``); otherwise the worker's set-up fails
naming that setting.

Importing this module, building the engine and computing import neither TensorFlow nor anything of
jacobeam that does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import resource
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.output.layout import JACOBIAN
from jacobeam.transforms.spec import EngineOptions, ModelSource, store_dtype

INPUT_NAME = "x"  # the fake model's one input


def coefficients(input_shape: Sequence[int], outputs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The fake model's ``A`` and ``B``, each ``(outputs, prod(input_shape))`` float64."""
    d = math.prod(int(n) for n in input_shape)
    rng = np.random.default_rng(seed)
    return rng.standard_normal((outputs, d)), rng.standard_normal((outputs, d))


class FakeEngine:
    """What ``ComputeJacobiansFn`` uses of ``JacobianEngine``: ``compute``, ``batch_size``, ``describe()``,
    ``fingerprint``, ``options``, ``input_names``, ``output_shape`` (and ``engine(x)``).

    Args:
        input_shape: one sample's shape.
        options: the job's ``EngineOptions``; ``batch_size`` (capped by ``max_batch``), ``store_dtype``
            and ``aggregate`` are honoured.
        outputs: ``m``, the number of outputs.
        seed: seeds ``A`` and ``B`` (``coefficients``).
        max_batch: at most this many samples per ``compute`` call (as the real engine takes fewer where
            its memory budget says so); None: ``options.batch_size``.

    Raises:
        ModelError: several inputs, or options it does not support (``outputs`` other than ``all``,
            ``reduce`` other than ``none``, ``wrt``).
    """

    def __init__(
        self, input_shape: Sequence[int] | Mapping[str, Sequence[int]], options: EngineOptions, outputs: int = 3,
        seed: int = 0, max_batch: int | None = None,
    ):
        if isinstance(input_shape, Mapping):
            raise ModelError(f"FakeEngine: one input only, got inputs {sorted(input_shape)}")
        unsupported = [
            f"{name} {value!r}"
            for name, value, supported in (
                ("outputs", options.outputs.rule, "all"),
                ("reduce", options.reduce.kind, "none"),
                ("wrt", options.wrt, None),
            )
            if value != supported
        ]
        if unsupported:
            raise ModelError(f"FakeEngine: does not support {', '.join(unsupported)}")
        self.options = options
        self.input_shape = tuple(int(n) for n in input_shape)
        self.input_names = [INPUT_NAME]
        self.input_shapes = [self.input_shape]
        self.output_shape = (int(outputs),)
        self.a, self.b = coefficients(self.input_shape, outputs, seed)
        self.fingerprint = hashlib.sha256(b"fake-engine" + self.a.tobytes() + self.b.tobytes()).hexdigest()
        self._batch = options.batch_size if max_batch is None else max(1, min(options.batch_size, max_batch))
        self.calls = 0

    @property
    def batch_size(self) -> int:
        """Samples per ``compute`` call."""
        return self._batch

    @property
    def operands(self):
        raise ModelError(
            "FakeEngine: no self-check (it recomputes samples with TensorFlow from the real engine's model); "
            "set jacobian.self_check.samples: 0 (SelfCheck(samples=0)) for a run with the fake engine"
        )

    def compute(
        self, x: np.ndarray | Mapping[str, np.ndarray], labels: np.ndarray | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """``(datasets, full)`` as ``JacobianEngine.compute`` returns them.

        Args:
            x: ``(n, *input_shape)``.
            labels: ignored (``outputs: all`` only).

        Returns:
            ``datasets``: ``"output"`` ``(n, m)`` and ``"jacobian"`` ``(n, m, *input_shape)`` in the store
            dtype; ``full``: the Jacobians ``(n, m, d)`` in the store dtype where ``aggregate`` asks for
            them, else None.

        Raises:
            ModelError: ``x`` is a mapping, or its samples are not of ``input_shape``.
        """
        if isinstance(x, Mapping):
            raise ModelError(f"FakeEngine: one input only, got inputs {sorted(x)}")
        x = np.asarray(x)
        if x.shape[1:] != self.input_shape:
            raise ModelError(f"FakeEngine: samples of shape {x.shape[1:]}, expected {self.input_shape}")
        self.calls += 1
        n = len(x)
        flat = x.reshape(n, -1).astype(np.float64)
        jacobian = self.a[None] + self.b[None] * flat[:, None, :]  # (n, m, d), entrywise
        output = flat @ self.a.T + 0.5 * (flat * flat) @ self.b.T  # (n, m)
        store = store_dtype(self.options.store_dtype)
        stored = jacobian.astype(store)
        datasets = {"output": output.astype(store), JACOBIAN: stored.reshape(n, *self.output_shape, *self.input_shape)}
        return datasets, stored if self.options.aggregate else None

    def __call__(self, x: np.ndarray, labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
        return self.compute(x, labels)[0]

    def describe(self) -> dict[str, Any]:
        """The keys ``JacobianEngine.describe`` reports (metrics and the manifest read them)."""
        options = self.options
        return {
            "mode": "fake",
            "double_reverse": False,
            "layer_rules": False,
            "jit_compile": False,
            "requested": {"mode": options.mode, "jit_compile": options.jit_compile},
            "batch_size": self.batch_size,
            "block_rows": {INPUT_NAME: self.output_shape[0]},
            "reasons": ["fake engine: closed form in numpy (transforms.testing.fake_engine)"],
            "compute_dtype": "float64",
            "store_dtype": options.store_dtype,
            "retraces_after_setup": 0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "pfor_fallbacks": [],
            "oom_retries": 0,
            "setup_seconds": 0.0,
        }


@dataclasses.dataclass(frozen=True)
class FakeEngineFactory:
    """An ``EngineFactory`` (``transforms.compute``) building a ``FakeEngine``; picklable, and its value
    (hence its ``repr``) tells engines apart in a worker's shared cache.

    Args:
        outputs: ``m``, the fake model's number of outputs.
        seed: seeds ``A`` and ``B``.
        max_batch: at most this many samples per engine call (None: ``options.batch_size``).
    """

    outputs: int = 3
    seed: int = 0
    max_batch: int | None = None

    def __call__(
        self, model: ModelSource, input_shape, options: EngineOptions, tf_threads: int | None = None
    ) -> FakeEngine:
        return FakeEngine(input_shape, options, outputs=self.outputs, seed=self.seed, max_batch=self.max_batch)

    def coefficients(self, input_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``A`` and ``B`` of the engines this factory builds for samples of ``input_shape``."""
        return coefficients(input_shape, self.outputs, self.seed)
