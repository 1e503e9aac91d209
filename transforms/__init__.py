"""jacobeam's building blocks: reading samples, the Jacobian engine, the compute DoFn, shards, finalize.

Importing this package is light; TensorFlow is imported only where a worker needs it, and
``JacobianModelHandler`` only when it is asked for: its Beam module (``apache_beam.ml.inference``)
imports PyTorch and SciPy where they are installed, 1.5 s of start-up that the pipeline never needs.
"""

from typing import Any

from transforms.aggregates import Aggregate
from transforms.compute import ComputeShardFn, ComputeShards
from transforms.finalize import Finalize
from transforms.spec import EngineOptions, JobSpec, ModelSource, OutputSelection, Reduction, ShardRange

__all__ = [
    "Aggregate",
    "ComputeShardFn",
    "ComputeShards",
    "EngineOptions",
    "Finalize",
    "JacobianModelHandler",
    "JobSpec",
    "ModelSource",
    "OutputSelection",
    "Reduction",
    "ShardRange",
]


def __getattr__(name: str) -> Any:
    if name == "JacobianModelHandler":
        from transforms.inference import JacobianModelHandler

        return JacobianModelHandler
    raise AttributeError(f"module 'transforms' has no attribute {name!r}")
