"""The run configuration: one YAML file plus ``--set`` overrides, validated once at the edge.

The key names are a contract with users (see README, "Configuration"): add keys, never rename.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from transforms.errors import JacobeamError
from transforms.spec import EngineOptions


class ConfigError(JacobeamError, ValueError):
    """A configuration that cannot be run; the message names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """Where the model comes from: exactly one of ``path``, ``factory`` or ``builtin``."""

    path: str | None = None
    factory: str | None = None
    builtin: Literal["mlp", "cnn"] | None = None

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        given = [name for name in ("path", "factory", "builtin") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, factory or builtin (got {given or 'none'})")
        return self

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str | None) -> str | None:
        if value is not None and value.count(":") != 1:
            raise ValueError(f"expected 'package.module:callable', got {value!r}")
        return value


class InputConfig(_Section):
    paths: list[str] = Field(min_length=1)
    key: str | None = None

    @field_validator("paths", mode="before")
    @classmethod
    def _one_glob_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class JacobianConfig(_Section):
    batch_size: PositiveInt = 256
    mode: Literal["auto", "reverse", "reverse_loop", "forward", "autotune"] = "auto"
    jit_compile: bool | Literal["auto"] = False
    memory_budget: ByteSize = ByteSize(2 * 2**30)
    wrt: Literal["all"] | list[str] = "all"
    compute_dtype: Literal["float32", "float64"] = "float32"
    store_dtype: Literal["float16", "bfloat16", "float32", "float64"] = "float32"
    check_batch_independence: bool = True
    # TensorFlow intra-op threads per worker process; "auto" shares the machine's cores
    # between the local worker processes so that they do not oversubscribe the CPU.
    threads: PositiveInt | Literal["auto"] = "auto"

    @field_validator("memory_budget")
    @classmethod
    def _positive_budget(cls, value: ByteSize) -> ByteSize:
        if value <= 0:
            raise ValueError("must be a positive size such as 2GiB or 512MB")
        return value

    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            batch_size=self.batch_size,
            mode=self.mode,
            jit_compile=self.jit_compile,
            memory_budget=int(self.memory_budget),
            wrt=None if self.wrt == "all" else tuple(self.wrt),
            compute_dtype=self.compute_dtype,
            store_dtype=self.store_dtype,
            check_batch_independence=self.check_batch_independence,
        )


class OutputConfig(_Section):
    path: str
    samples_per_shard: PositiveInt = 4096
    compression: Literal["none", "lzf", "gzip"] = "none"


class Config(_Section):
    model: ModelConfig
    input: InputConfig
    jacobian: JacobianConfig = JacobianConfig()
    output: OutputConfig


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=VALUE`` into its key path and its YAML-parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE (e.g. output.path=out/), got {text!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {err}") from err
    return key.strip().split("."), value


def apply_override(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


def validate(raw: dict[str, Any], source: str = "config") -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a YAML mapping at the top level, got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source} is not valid:\n{_describe(err)}") from None


def load(path: str | Path | None, overrides: list[str] = (), base: dict[str, Any] | None = None) -> Config:
    """Read a YAML config (or start from ``base``), apply ``--set`` overrides, validate."""
    raw: dict[str, Any] = copy.deepcopy(base or {})
    source = "config"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    for text in overrides:
        apply_override(raw, *parse_override(text))
    return validate(raw, source)


def to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data (for the manifest)."""
    return config.model_dump(mode="json")
