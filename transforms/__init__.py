"""jacobeam's building blocks: reading samples, the Jacobian engine, the compute DoFn, shards, finalize.

Importing this package is light; TensorFlow is imported only where a worker needs it.
"""

from transforms.compute import ComputeShardFn, ComputeShards
from transforms.finalize import Finalize
from transforms.spec import JobSpec, ModelSource, ShardRange

__all__ = ["ComputeShardFn", "ComputeShards", "Finalize", "JobSpec", "ModelSource", "ShardRange"]
