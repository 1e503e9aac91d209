"""A config from a YAML file (or a base mapping) and ``--set`` overrides, validated once; and back to
plain data."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from jacobeam.pipeline.config.messages import describe
from jacobeam.pipeline.config.run import Config
from jacobeam.transforms.errors import JacobeamError


class ConfigError(JacobeamError, ValueError):
    """A configuration that cannot be run; the message names the offending key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=VALUE`` into its key path and its YAML-parsed value.

    Args:
        text: one ``--set`` argument, ``KEY=VALUE`` with a dotted key.

    Returns:
        The key's parts (``["a", "b"]``) and the value as YAML reads it.

    Raises:
        ConfigError: ``text`` is not ``KEY=VALUE``, or VALUE is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE (e.g. output.path=out/), got {text!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {_yaml_problem(err)}") from err
    return key.strip().split("."), value


def apply_override(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``value`` at the key path ``keys`` of the raw config ``raw`` (in place), creating sections.

    Raises:
        ConfigError: a key on the path holds a value, not a section.
    """
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def validate(raw: dict[str, Any], source: str = "config", overridden: Sequence[str] = ()) -> Config:
    """Validate a raw config (plain data, as YAML reads it).

    Args:
        raw: the config as a mapping.
        source: what the config came from, for the error message (a file name).
        overridden: the dotted keys that ``--set`` overrides gave, whose problems the message blames on them.

    Returns:
        The validated ``Config``, with every default filled in.

    Raises:
        ConfigError: ``raw`` is not a mapping, or not a valid config; the message names every offending
            key.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a YAML mapping at the top level, got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe(err, source, overridden)) from None


def load(path: str | Path | None, overrides: list[str] = (), base: dict[str, Any] | None = None) -> Config:
    """Read a YAML config (or start from ``base``), apply ``--set`` overrides, validate.

    Args:
        path: the YAML file; None starts from ``base`` alone.
        overrides: ``--set`` arguments, ``KEY=VALUE``, applied in order after the file is read.
        base: the raw config to start from (copied) when ``path`` is None; a file replaces it.

    Returns:
        The validated ``Config``.

    Raises:
        ConfigError: the file cannot be read or is not a YAML mapping, an override is malformed, or the
            result is not a valid config.
    """
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
            raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    overridden = []
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(raw, keys, value)
        overridden.append(".".join(keys))
    return validate(raw, source, overridden)


def to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data (for the manifest)."""
    return config.model_dump(mode="json")


def _yaml_problem(err: Exception) -> str:
    """PyYAML's error in one line: what it expected and where (its message quotes the text over several lines,
    with a caret under the place)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if problem is None:
        return " ".join(str(err).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")
