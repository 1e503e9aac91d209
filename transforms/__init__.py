"""jacobeam's building blocks: reading samples, the Jacobian engine, computing and writing shards.

A planned job (``jacobeam run``) is ``ReadSamples | ComputeJacobians | WriteShards``; a pipeline of
your own can use ``ComputeJacobians`` on its samples and ``WriteShards`` (with ``pipeline_spec``) on
the results, or ``RunInference(JacobianModelHandler(...))``.

Importing this package is light; TensorFlow is imported only where a worker needs it.
"""

from transforms.aggregates import Aggregate
from transforms.compute import ComputeJacobians, ComputeJacobiansFn
from transforms.elements import JacobianBatch, SampleBatch
from transforms.finalize import Finalize
from transforms.inference import JacobianModelHandler
from transforms.read import ReadSamples
from transforms.spec import EngineOptions, JobSpec, ModelSource, OutputSelection, Reduction, ShardRange
from transforms.write import WriteShards, pipeline_spec

__all__ = [
    "Aggregate",
    "ComputeJacobians",
    "ComputeJacobiansFn",
    "EngineOptions",
    "Finalize",
    "JacobianBatch",
    "JacobianModelHandler",
    "JobSpec",
    "ModelSource",
    "OutputSelection",
    "ReadSamples",
    "Reduction",
    "SampleBatch",
    "ShardRange",
    "WriteShards",
    "pipeline_spec",
]
