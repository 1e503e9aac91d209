"""A failed validation as the user reads it: one line per offending key, naming the closest known key
for an unknown one and blaming the ``--set`` override that gave a key."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from jacobeam.pipeline.config.run import Config

# What a key of several forms accepts, said once instead of one pydantic error per member of its union.
_FORMS = {
    "input.sample_shape": "a shape such as [8, 8, 1], or a mapping {input name: shape}",
    "input.image.mean": "a number, or a list of one number per channel",
    "input.image.std": "a positive number, or a list of one per channel",
    "jacobian.jit_compile": "true, false or auto",
    "jacobian.wrt": "all, a list of input names, parameters or {parameters: [layer names]}",
    "jacobian.objective": "outputs, margin, or {loss: sparse_categorical_crossentropy} (or categorical_crossentropy)",
    "jacobian.outputs": "all, argmax, label, a list of output indices such as [3, 7], or {top_k: K}",
    "jacobian.threads": "auto, or a positive integer",
}


def _section_keys(path: tuple[Any, ...]) -> list[str]:
    """The keys of the section at ``path`` (keys from the top level), for a did-you-mean; none when
    ``path`` does not lead to a single section."""
    section: type[BaseModel] = Config
    for part in path:
        field = section.model_fields.get(part)
        models = [kind for kind in _member_types(field.annotation) if issubclass(kind, BaseModel)] if field else []
        if len(models) != 1:
            return []
        section = models[0]
    return list(section.model_fields)


def _member_types(annotation: Any) -> list[type]:
    """The classes an annotation names, through ``X | None`` and the like."""
    if isinstance(annotation, type):
        return [annotation]
    return [kind for arg in get_args(annotation) for kind in _member_types(arg)]


def _did_you_mean(word: Any, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1) if isinstance(word, str) else []
    return f"; did you mean {close[0]}?" if close else ""


def _problems(error: ValidationError) -> list[tuple[str, str]]:
    """``(dotted key, what is wrong with it)`` for each problem of ``error``."""
    problems = []
    for item in error.errors():
        loc, given = item["loc"], item.get("input")
        key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "(top level)"
        union = next((name for name in _FORMS if key.startswith(name + ".")), None)
        if union:
            # The first error of the union is its first member's, which was given the whole value.
            if all(known != union for known, _ in problems):
                words = re.findall(r"[a-z_]+", _FORMS[union])
                problems.append((union, f"{given!r} is not one of {_FORMS[union]}{_did_you_mean(given, words)}"))
        elif item["type"] == "extra_forbidden":
            problems.append((key, "unknown key" + _did_you_mean(loc[-1], _section_keys(loc[:-1]))))
        elif item["type"] == "missing":
            problems.append((key, "required key is missing"))
        elif item["type"] == "literal_error":
            choices = re.findall(r"'([^']*)'", item["ctx"]["expected"])
            problems.append((key, f"{item['msg']} (got {given!r}){_did_you_mean(given, choices)}"))
        elif item["type"] == "value_error" and isinstance(given, dict):
            # A section-level check, whose message may start with the key inside the section (or, at
            # the top level, with the dotted key).
            message = item["msg"].removeprefix("Value error, ")
            inner = re.match(r"^([\w.]+): (.*)$" if not loc else r"^(\w+): (.*)$", message)
            if inner and not loc:
                problems.append(inner.groups())
            elif inner:
                problems.append((f"{key}.{inner[1]}", inner[2]))
            else:
                problems.append((key, message))
        else:
            problems.append((key, f"{item['msg']} (got {given!r})"))
    return problems


def describe(error: ValidationError, source: str, overridden: Sequence[str]) -> str:
    """One line per problem, a problem under a key that ``--set`` gave blamed on that override (it
    replaced what the file said), any other on ``source``."""

    def by_override(key: str) -> bool:
        return any(key == set_key or key.startswith((set_key + ".", set_key + "[")) for set_key in overridden)

    lines = [(f"--set {key}" if by_override(key) else key) + f": {message}" for key, message in _problems(error)]
    if len(lines) == 1:
        return lines[0] if lines[0].startswith("--set ") else f"{source}: {lines[0]}"
    header = source if any(not line.startswith("--set ") for line in lines) else "the --set overrides"
    return f"{header} {'is' if header == source else 'are'} not valid:\n" + "\n".join(f"  {line}" for line in lines)

