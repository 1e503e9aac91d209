"""jacobeam's building blocks: reading samples, the Jacobian engine, computing and writing shards.

A planned job (``jacobeam run``) is ``ReadSamples | ComputeJacobians | WriteShards``; a pipeline of
your own can use ``ComputeJacobians`` on its samples and ``WriteShards`` (with ``pipeline_spec``) on
the results, or ``RunInference(JacobianModelHandler(...))``.

Importing this package is light; TensorFlow is imported only where a worker needs it, and
``JacobianModelHandler`` only when it is asked for: its Beam module (``apache_beam.ml.inference``)
imports PyTorch and SciPy where they are installed, 1.5 s of start-up that the pipeline never needs.
"""

from typing import Any

from transforms.aggregates import Aggregate
from transforms.compute import ComputeJacobians, ComputeJacobiansFn
from transforms.elements import JacobianBatch, SampleBatch
from transforms.finalize import Finalize
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


def __getattr__(name: str) -> Any:
    if name == "JacobianModelHandler":
        from transforms.inference import JacobianModelHandler

        return JacobianModelHandler
    raise AttributeError(f"module 'transforms' has no attribute {name!r}")
