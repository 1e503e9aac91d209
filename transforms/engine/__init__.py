"""The Jacobian engine: compiled per-sample Jacobians of a model, built once per worker. Pure TensorFlow,
never Beam. ``facade.JacobianEngine`` composes the other modules (see its docstring).

Importing the package is light: ``JacobianEngine`` and ``store_dtype`` (which import TensorFlow) load
when first asked for; ``relative_error`` is numpy only.
"""

from typing import Any

from jacobeam.transforms.engine.diagnostics import relative_error

__all__ = ["JacobianEngine", "relative_error", "store_dtype"]


def __getattr__(name: str) -> Any:
    if name in ("JacobianEngine", "store_dtype"):
        from jacobeam.transforms.engine import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'jacobeam.transforms.engine' has no attribute {name!r}")
