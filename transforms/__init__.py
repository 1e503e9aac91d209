"""jacobeam's building blocks: reading samples, the Jacobian engine, the compute DoFn, shards, finalize.

Importing this package is light; TensorFlow is imported only where a worker needs it.
"""

from transforms.aggregates import Aggregate
from transforms.compute import ComputeShardFn, ComputeShards
from transforms.finalize import Finalize
from transforms.inference import JacobianModelHandler
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
