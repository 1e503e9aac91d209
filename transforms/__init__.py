"""jacobeam's building blocks: reading samples, the Jacobian engine, computing and writing shards.

A planned job (``jacobeam run``) is ``ReadSamples | ComputeJacobians | WriteShards``; a pipeline of
your own can use ``ComputeJacobians`` on its samples and ``WriteShards`` (with ``pipeline_spec``) on
the results, or ``RunInference(JacobianModelHandler(...))``.

Importing this package is light; TensorFlow is imported only where a worker needs it, and
``JacobianModelHandler`` only when it is asked for: its Beam module (``apache_beam.ml.inference``)
imports PyTorch and SciPy where they are installed, 1.5 s of start-up that the pipeline never needs.
"""

from typing import Any

from jacobeam.transforms.aggregates import Aggregate
from jacobeam.transforms.compute import ComputeJacobians, ComputeJacobiansFn
from jacobeam.transforms.elements import JacobianBatch, SampleBatch
from jacobeam.transforms.finalize import Finalize
from jacobeam.transforms.read import ReadSamples
from jacobeam.transforms.spec import EngineOptions, JobSpec, ModelSource, OutputSelection, Reduction, ShardRange
from jacobeam.transforms.write import WriteShards, pipeline_spec

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
        from jacobeam.transforms.inference import JacobianModelHandler

        return JacobianModelHandler
    raise AttributeError(f"module 'transforms' has no attribute {name!r}")
