"""jacobeam's building blocks: reading samples, the Jacobian engine, computing and writing shards.

A planned job (``jacobeam run``) is its shard ranges ``| ComputeShards | Finalize`` (each range read,
computed and written in one step); a pipeline of your own can use ``ReadSamples`` to read a planned
job's samples, ``ComputeJacobians`` on samples and ``WriteShards`` (with ``pipeline_spec``) on the
results, or ``RunInference(JacobianModelHandler(...))``.

Importing this package is light: every name loads its module on first use. TensorFlow is imported
only where a worker needs it, and ``JacobianModelHandler`` only when it is asked for: its Beam module
(``apache_beam.ml.inference``) imports PyTorch and SciPy where they are installed, start-up that the
pipeline never needs.

The DoFns' element types are declared to Beam (``with_input_types``/``with_output_types``): Beam cannot
resolve their modules' annotations (strings, by ``from __future__ import annotations``), so their
methods are marked ``no_annotations`` and the annotations are for readers only.
"""

import importlib
from typing import Any

# Each public name and the module that defines it; a module is imported when one of its names is first
# used (PEP 562), so that importing a light part (``transforms.spec``, ``transforms.errors``) does not
# import Beam, and nothing here imports TensorFlow.
_EXPORTS = {
    "ComputeJacobians": "compute",
    "ComputeJacobiansFn": "compute",
    "ComputeShards": "job",
    "EngineOptions": "spec",
    "Finalize": "finalize",
    "JacobianBatch": "elements",
    "JacobianModelHandler": "inference",
    "JobSpec": "spec",
    "ModelSource": "spec",
    "OutputSelection": "spec",
    "ReadSamples": "read",
    "Reduction": "spec",
    "SampleBatch": "elements",
    "ShardRange": "spec",
    "WriteShards": "write_shards",
    "pipeline_spec": "write_shards",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jacobeam.transforms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jacobeam.transforms.{_EXPORTS[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
