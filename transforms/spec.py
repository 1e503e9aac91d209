"""The plain, picklable description of a job that the transforms share.

Beam pickles every DoFn and ships it to workers, so what they hold is plain data: this module
imports neither TensorFlow nor Beam.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import Any, Literal

from transforms.readers import SourceFile


def version() -> str:
    try:
        return metadata.version("jacobeam")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Exactly one of a model file/directory, a ``"pkg.module:callable"`` factory, or a built-in name."""

    path: str | None = None
    factory: str | None = None
    builtin: str | None = None

    def load(self):
        from transforms import models

        return models.load(path=self.path, factory=self.factory, builtin=self.builtin)


@dataclasses.dataclass(frozen=True)
class OutputSelection:
    """Which output rows to differentiate: all, fixed flat ``indices``, each sample's ``argmax``,
    its ``label``, or its ``top_k`` outputs (largest first)."""

    rule: Literal["all", "indices", "argmax", "label", "top_k"] = "all"
    indices: tuple[int, ...] = ()
    k: int = 1

    @property
    def count(self) -> int | None:
        """Rows per sample; None for all rows."""
        return {"all": None, "indices": len(self.indices), "argmax": 1, "label": 1, "top_k": self.k}[self.rule]


@dataclasses.dataclass(frozen=True)
class Reduction:
    """What to keep of each sample's Jacobian (``jacobian.reduce`` and its parameters)."""

    kind: str = "none"
    vectors: str | None = None  # .npy of fixed vectors for vjp (over outputs) / jvp (over inputs)
    project_dim: int = 256
    project_kind: Literal["rademacher", "gaussian"] = "rademacher"
    project_seed: int = 0
    basis_input: str | None = None  # .npy (d, q): V in U^T J V
    basis_output: str | None = None  # .npy (m, p): U in U^T J V


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the engine computes Jacobians (see ``transforms.engine.JacobianEngine``)."""

    batch_size: int = 256
    mode: Literal["auto", "reverse", "reverse_loop", "forward", "autotune"] = "auto"
    jit_compile: bool | Literal["auto"] = False
    memory_budget: int = 2 * 2**30  # bytes for one block's working set, results included
    wrt: tuple[str, ...] | None = None  # model inputs to differentiate by; None: all
    compute_dtype: Literal["float32", "float64"] = "float32"
    store_dtype: Literal["float16", "bfloat16", "float32", "float64"] = "float32"
    check_batch_independence: bool = True
    outputs: OutputSelection = OutputSelection()
    reduce: Reduction = Reduction()
    aggregate: tuple[str, ...] = ()  # any of mean, mean_abs, jtj


@dataclasses.dataclass(frozen=True)
class ShardRange:
    """Sample ids ``[start, stop)``: one Beam element, one shard."""

    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class JobSpec:
    model: ModelSource
    files: tuple[SourceFile, ...]
    output_dir: str
    run_key: str  # identifies what the shards hold; shards from another run are never mixed in
    engine: EngineOptions = EngineOptions()
    samples_per_shard: int = 4096
    compression: str = "none"
    tf_threads: int | None = None  # TensorFlow threads per worker process; None keeps TF's default
    label_key: str | None = None  # the array of per-sample labels in each input file (outputs: label)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the resolved config, for the manifest
    started_at: float = 0.0

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.files[0].sample_shape

    @property
    def num_samples(self) -> int:
        return self.files[-1].stop_id

    def ranges(self) -> list[ShardRange]:
        step = self.samples_per_shard
        return [ShardRange(lo, min(lo + step, self.num_samples)) for lo in range(0, self.num_samples, step)]
