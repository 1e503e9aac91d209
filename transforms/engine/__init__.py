"""The Jacobian engine: compiled per-sample Jacobians of a model, built once per worker. Pure TensorFlow,
never Beam. ``facade.JacobianEngine`` composes the other modules (see its docstring)."""

from transforms.engine.diagnostics import relative_error
from transforms.engine.facade import JacobianEngine, store_dtype

__all__ = ["JacobianEngine", "relative_error", "store_dtype"]
