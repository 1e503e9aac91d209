"""The Jacobian engine: compiled per-sample Jacobians of a model, built once per worker. Pure TensorFlow."""

from transforms.engine.facade import JacobianEngine, relative_error

__all__ = ["JacobianEngine", "relative_error"]
