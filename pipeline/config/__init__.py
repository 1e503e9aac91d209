"""The run configuration: one YAML file plus ``--set`` overrides, validated once at the edge.

The key names are a contract with users (see README, "Configuration"): add keys, never rename.

The sections are pydantic models: ``inputs`` (``model``, ``input``), ``jacobian`` (``jacobian`` and its
sub-sections) and ``run`` (``output``, and ``Config``, which holds them all). ``loading`` reads and
validates a config, and ``messages`` words what is wrong with one.
"""

from jacobeam.pipeline.config.inputs import ImageConfig, InputConfig, ModelConfig
from jacobeam.pipeline.config.jacobian import (
    BasisConfig,
    JacobianConfig,
    LabelsConfig,
    ProjectConfig,
    SelfCheckConfig,
    TopK,
)
from jacobeam.pipeline.config.loading import ConfigError, apply_override, load, parse_override, to_dict, validate
from jacobeam.pipeline.config.run import Config, OutputConfig

__all__ = [
    "BasisConfig",
    "Config",
    "ConfigError",
    "ImageConfig",
    "InputConfig",
    "JacobianConfig",
    "LabelsConfig",
    "ModelConfig",
    "OutputConfig",
    "ProjectConfig",
    "SelfCheckConfig",
    "TopK",
    "apply_override",
    "load",
    "parse_override",
    "to_dict",
    "validate",
]
