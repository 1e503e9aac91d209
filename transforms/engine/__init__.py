"""The Jacobian engine: compiled per-sample Jacobians of a model, built once per worker. Pure TensorFlow,
never Beam. ``facade.JacobianEngine`` composes the other modules (see its docstring).

Importing the package is light: ``JacobianEngine`` (which imports TensorFlow) and ``store_dtype`` load
when first asked for; ``relative_error`` is numpy only.
"""

from typing import Any

from jacobeam.transforms.engine.diagnostics import relative_error

__all__ = ["JacobianEngine", "relative_error", "store_dtype"]


def __getattr__(name: str) -> Any:
    if name == "JacobianEngine":
        from jacobeam.transforms.engine import facade

        return facade.JacobianEngine
    if name == "store_dtype":
        from jacobeam.transforms.spec import store_dtype

        return store_dtype
    raise AttributeError(f"module 'jacobeam.transforms.engine' has no attribute {name!r}")
