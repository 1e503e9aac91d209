"""The Jacobian engine: compiled per-sample Jacobians of a model, built once per worker. Pure TensorFlow,
never Beam. ``facade.JacobianEngine`` composes the other modules (see its docstring).

Importing the package is light: ``JacobianEngine`` (which imports TensorFlow) loads when first asked for;
``relative_error`` and ``store_dtype`` are numpy only.
"""

from typing import Any

from jacobeam.transforms.engine.diagnostics import relative_error
from jacobeam.transforms.spec import store_dtype

__all__ = ["JacobianEngine", "relative_error", "store_dtype"]


def __getattr__(name: str) -> Any:
    if name == "JacobianEngine":
        from jacobeam.transforms.engine import facade

        return facade.JacobianEngine
    raise AttributeError(f"module 'jacobeam.transforms.engine' has no attribute {name!r}")
