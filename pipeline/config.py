"""The run configuration: one YAML file plus ``--set`` overrides, validated once at the edge.

The key names are a contract with users (see README, "Configuration"): add keys, never rename.
"""

from __future__ import annotations

import copy
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from jacobeam.transforms.errors import JacobeamError
from jacobeam.transforms.inputs.images import ImageOptions
from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction, SelfCheck


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


class ImageConfig(_Section):
    """How PNG/JPEG images become samples: decoded to 8-bit values, resized, then ``x * scale``, then
    ``(x - mean) / std`` (per channel when lists)."""

    size: tuple[PositiveInt, PositiveInt] | None = None  # [height, width]; None: every image keeps its own
    channels: Literal[1, 3] | None = None  # 1: grayscale, 3: RGB; None: as stored in the files
    scale: float = 1 / 255
    mean: float | list[float] | None = None
    std: float | list[float] | None = None

    @field_validator("scale", mode="before")
    @classmethod
    def _fraction(cls, value: Any) -> Any:
        """``1/255`` is how people write it; YAML reads it as a string."""
        if isinstance(value, str):
            try:
                return float(Fraction(value.replace(" ", "")))
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"expected a number such as 0.5 or 1/255, got {value!r}") from None
        return value

    @model_validator(mode="after")
    def _usable(self) -> ImageConfig:
        if not math.isfinite(self.scale) or self.scale == 0:
            raise ValueError(f"scale: must be a finite number other than 0, got {self.scale}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [] if value is None else [value]
            if value == []:
                raise ValueError(f"{name}: an empty list; give one number, or one per channel")
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"{name}: must be finite numbers, got {value}")
            if name == "std" and any(v <= 0 for v in values):
                raise ValueError(f"std: must be positive, got {value}")
            if isinstance(value, list) and len(value) > 1 and self.channels is not None and len(value) != self.channels:
                raise ValueError(f"{name}: {len(value)} values for {self.channels} channel(s)")
        return self

    def options(self) -> ImageOptions:
        return ImageOptions.from_config(self.model_dump(mode="json"))


class InputConfig(_Section):
    paths: list[str] = Field(min_length=1)
    # The array of samples (name in .npz, dataset path in .h5), or for a model with several inputs a
    # mapping {model input name: array} that reads one array per input from each file.
    key: str | dict[str, str] | None = None
    # One sample's shape, for TFRecord files (their features are flat lists); a mapping by input name
    # when key is one. For other files, a check: their samples must have this shape.
    sample_shape: list[PositiveInt] | dict[str, list[PositiveInt]] | None = None
    image: ImageConfig | None = None  # PNG/JPEG inputs; None: the defaults of ImageConfig
    # What a NaN/Inf sample or a truncated, corrupt or unreadable file does: stop the run before any
    # output is touched ("error"), or leave those samples out and list them in rejected.jsonl ("skip").
    on_bad_sample: Literal["error", "skip"] = "error"

    @field_validator("paths", mode="before")
    @classmethod
    def _one_glob_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("key", mode="before")
    @classmethod
    def _key_form(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"expected an array name, or a mapping {{input name: array name}}, got {value!r}")
        if not value:
            raise ValueError("an empty mapping names no input; give {input name: array name, ...}")
        for name, array in value.items():
            if not isinstance(name, str) or not isinstance(array, str) or not array:
                raise ValueError(f"input {name!r}: expected the name of an array, got {array!r}")
        return value

    @model_validator(mode="after")
    def _shapes_match_keys(self) -> InputConfig:
        several, shapes = isinstance(self.key, dict), self.sample_shape
        if isinstance(shapes, dict) and not several:
            raise ValueError("sample_shape: a mapping by input name needs input.key to map the same inputs")
        if several and shapes is not None and (not isinstance(shapes, dict) or set(shapes) != set(self.key)):
            raise ValueError(f"sample_shape: give one shape per input of input.key, {{{', '.join(self.key)}: [...]}}")
        return self

    def image_options(self) -> ImageOptions:
        return (self.image or ImageConfig()).options()

    def shape(self) -> tuple[int, ...] | dict[str, tuple[int, ...]] | None:
        """``sample_shape`` as the readers take it."""
        if isinstance(self.sample_shape, dict):
            return {name: tuple(dims) for name, dims in self.sample_shape.items()}
        return None if self.sample_shape is None else tuple(self.sample_shape)


class TopK(_Section):
    top_k: PositiveInt


class LabelsConfig(_Section):
    key: str


class ProjectConfig(_Section):
    dim: PositiveInt = 256
    kind: Literal["rademacher", "gaussian"] = "rademacher"
    seed: int = 0


class BasisConfig(_Section):
    input: str | None = None
    output: str | None = None


class SelfCheckConfig(_Section):
    """``jacobian.self_check``: every shard recomputes a few of its samples one at a time, independently
    of the engine's batched computation, and records the relative error (shard attribute ``self_check``
    and the manifest). A kink of the model at the sample (ReLU, max-pool: the derivative is not unique
    there) is recorded as a note, not a mismatch."""

    samples: NonNegativeInt = Field(
        1,
        description="samples recomputed per shard (chosen by a generator seeded with the shard's first id); "
        "0 turns the self-check off",
    )
    on_mismatch: Literal["fail", "warn"] = Field(
        "fail",
        description="a relative error above the tolerance of the compute dtype (1e-4 float32, 1e-9 float64, "
        "at least twice the epsilon of the store dtype): fail stops the run naming shard, sample and dataset; "
        "warn logs it and records it in the shard and the manifest",
    )

    def spec(self) -> SelfCheck:
        return SelfCheck(samples=self.samples, on_mismatch=self.on_mismatch)


# Reductions that need every row of the Jacobian, and so cannot follow a per-sample row selection.
_NEEDS_ALL_ROWS = ("diagonal", "trace", "slogdet", "vjp", "jvp", "basis")
_PRODUCTS = ("vjp", "jvp", "project", "basis")


class JacobianConfig(_Section):
    batch_size: PositiveInt = 256
    mode: Literal["auto", "reverse", "reverse_loop", "forward", "autotune"] = "auto"
    jit_compile: bool | Literal["auto"] = False
    memory_budget: ByteSize = ByteSize(2 * 2**30)
    wrt: Literal["all"] | list[str] = "all"
    compute_dtype: Literal["float32", "float64"] = "float32"
    store_dtype: Literal["float16", "bfloat16", "float32", "float64"] = "float32"
    check_batch_independence: bool = True
    outputs: Literal["all", "argmax", "label"] | list[NonNegativeInt] | TopK = "all"
    labels: LabelsConfig | None = None
    reduce: Literal[
        "none", "frobenius", "diagonal", "slogdet", "trace", "max_abs_over_outputs",
        "sum_abs_over_channels", "vjp", "jvp", "project", "basis",
    ] = "none"
    vectors: str | None = None
    project: ProjectConfig = ProjectConfig()
    basis: BasisConfig = BasisConfig()
    aggregate: list[Literal["mean", "mean_abs", "jtj"]] = []
    # TensorFlow intra-op threads per worker process; "auto" shares the machine's cores
    # between the local worker processes so that they do not oversubscribe the CPU.
    threads: PositiveInt | Literal["auto"] = "auto"
    # Each shard recomputes a few samples independently and records the error (see SelfCheckConfig).
    self_check: SelfCheckConfig = SelfCheckConfig()

    @model_validator(mode="after")
    def _consistent_products(self) -> JacobianConfig:
        rule = self.outputs if isinstance(self.outputs, str) else "selection"
        if self.outputs == []:
            raise ValueError("outputs: an empty list selects nothing; use all or give indices")
        if rule == "label" and self.labels is None:
            raise ValueError("outputs: label needs labels: {key: <array of labels in the input files>}")
        if rule != "all" and self.reduce in _NEEDS_ALL_ROWS:
            raise ValueError(f"reduce: {self.reduce} needs every output row; it cannot follow outputs: {self.outputs}")
        if self.reduce in ("vjp", "jvp") and self.vectors is None:
            raise ValueError(f"reduce: {self.reduce} needs vectors: <.npy file of fixed vectors>")
        if self.reduce == "basis" and self.basis.input is None and self.basis.output is None:
            raise ValueError("reduce: basis needs basis.input and/or basis.output (.npy files)")
        if self.aggregate and self.reduce in _PRODUCTS:
            raise ValueError(f"aggregate: needs the Jacobian, which reduce: {self.reduce} never forms")
        return self

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
            outputs=self._selection(),
            reduce=Reduction(
                kind=self.reduce,
                vectors=self.vectors,
                project_dim=self.project.dim,
                project_kind=self.project.kind,
                project_seed=self.project.seed,
                basis_input=self.basis.input,
                basis_output=self.basis.output,
            ),
            aggregate=tuple(self.aggregate),
        )

    def _selection(self) -> OutputSelection:
        if isinstance(self.outputs, TopK):
            return OutputSelection("top_k", k=self.outputs.top_k)
        if isinstance(self.outputs, list):
            return OutputSelection("indices", indices=tuple(self.outputs))
        return OutputSelection(self.outputs)


class OutputConfig(_Section):
    path: str
    samples_per_shard: PositiveInt = 4096
    compression: Literal["none", "lzf", "gzip"] = "none"


class Config(_Section):
    model: ModelConfig
    input: InputConfig
    jacobian: JacobianConfig = JacobianConfig()
    output: OutputConfig

    @model_validator(mode="after")
    def _several_inputs(self) -> Config:
        """What a mapping ``input.key`` (a model with several inputs) allows in ``jacobian``."""
        names, jacobian = self.input.key, self.jacobian
        if not isinstance(names, dict):
            return self
        if jacobian.reduce != "none":
            raise ValueError(f"jacobian.reduce: {jacobian.reduce} is for one-input models; input.key names inputs {list(names)}")
        if jacobian.aggregate:
            raise ValueError(f"jacobian.aggregate: aggregates are for one-input models; input.key names inputs {list(names)}")
        unknown = [name for name in jacobian.wrt if name not in names] if jacobian.wrt != "all" else []
        if unknown:
            raise ValueError(f"jacobian.wrt: {unknown} not among the inputs that input.key names, {list(names)}")
        return self


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
        elif item["type"] == "value_error" and isinstance(item.get("input"), dict):
            # A section-level check, whose message may start with the key inside the section (or, at
            # the top level, with the dotted key).
            message = item["msg"].removeprefix("Value error, ")
            if not item["loc"] and re.match(r"^[\w.]+: ", message):
                lines.append(f"  {message}")
            else:
                lines.append(f"  {key}.{message}" if re.match(r"^\w+: ", message) else f"  {key}: {message}")
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
