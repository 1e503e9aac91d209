"""The configuration reference, docs/configuration.md, generated from the config models.

Every key of ``pipeline.config.Config`` with its type, default and description (each field's
``pydantic.Field(description=...)``), one table per section, each section introduced by its model's
docstring. The models are the one source: the page is never edited by hand.

``python -m jacobeam.pipeline.config_reference`` writes the page; with ``--check`` it writes nothing and
exits 1 when the page on disk differs from what the models give (``tests/test_config_reference.py``
fails then too).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo

from jacobeam.pipeline.config import Config

COMMAND = "python -m jacobeam.pipeline.config_reference"
# The repository's docs/configuration.md (this module is pipeline/config_reference.py).
DEFAULT_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# Google-style docstring sections: for readers of the code, not of the reference.
_DOCSTRING_SECTION = re.compile(r"^(Args|Arguments|Attributes|Raises|Returns|Yields|Examples?|Notes?):\s*$")


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: ``dotted`` (``jacobian.self_check.samples``), its ``type`` and ``default`` as the
    reference shows them, its ``description``, and ``section``, the model of a key that is a section."""

    dotted: str
    type: str
    default: str
    description: str
    section: type[BaseModel] | None = None


def keys(model: type[BaseModel] = Config, prefix: str = "") -> list[Key]:
    """Every key of ``model`` and of its sections, depth first, in declaration order."""
    found = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        section = _section_model(field.annotation)
        found.append(Key(dotted, _type(field, dotted), _default(field), _one_line(field.description or ""), section))
        if section is not None:
            found.extend(keys(section, f"{dotted}."))
    return found


def leaf_keys() -> list[Key]:
    """The keys that hold values (every key but the sections)."""
    return [key for key in keys() if key.section is None]


def models(model: type[BaseModel] = Config) -> list[type[BaseModel]]:
    """``model`` and every model its fields use (sections, and models inside unions such as ``TopK``)."""
    found = [model]
    for field in model.model_fields.values():
        for inner in _models_in(field.annotation):
            found.extend(m for m in models(inner) if m not in found)
    return found


def render() -> str:
    """The text of docs/configuration.md."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from pipeline/config/ by `{COMMAND}`: edit the models there, not this file. -->",
        "",
        *_intro(Config, ""),
        "",
        *_table(Config, ""),
    ]
    for key in keys():
        if key.section is not None:
            lines += ["", f"## `{key.dotted}`", "", *_intro(key.section, key.dotted), "", *_table(key.section, f"{key.dotted}.")]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write docs/configuration.md, or with ``--check`` only compare it; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Generate the configuration reference from the config models (pipeline/config/)."
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file differs from the models")
    parser.add_argument("--output", type=Path, default=DEFAULT_PATH, help="the file (default: %(default)s)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        try:
            current = args.output.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != text:
            state = "is missing" if current is None else "is out of date"
            print(f"{args.output} {state}: regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {args.output}")
    return 0


# -- sections ------------------------------------------------------------------------------------------


def _intro(model: type[BaseModel], dotted: str) -> list[str]:
    """The model's docstring up to its first Google-style section, as Markdown: one line per paragraph.
    A leading ``dotted``: (the section's own name, which its heading shows) is dropped."""
    lines = []
    for line in inspect.cleandoc(model.__doc__ or "").splitlines():
        if _DOCSTRING_SECTION.match(line):
            break
        lines.append(line)
    paragraphs = [_one_line(part) for part in re.split(r"\n\s*\n", "\n".join(lines)) if part.strip()]
    text = re.sub(r"``([^`]+)``", r"`\1`", "\n\n".join(paragraphs))
    if dotted and text.startswith(f"`{dotted}`: "):
        text = text[len(dotted) + 4 :]
        text = text[:1].upper() + text[1:]
    return text.splitlines()


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key in keys(model, prefix):
        if key.dotted.count(".") == prefix.count("."):  # this section's own keys; deeper ones get their own table
            cells = [f"`{key.dotted}`", key.type, key.default, key.description]
            rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def _anchor(heading: str) -> str:
    """The link target GitHub gives a heading (lower case; punctuation but ``-`` and ``_`` dropped)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- types ---------------------------------------------------------------------------------------------


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section key: a field whose type is one model, or one model or null."""
    options = [arg for arg in _union_args(annotation) if arg is not type(None)]
    return options[0] if len(options) == 1 and _is_model(options[0]) else None


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if _is_model(annotation):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


def _union_args(tp: Any) -> tuple[Any, ...]:
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)


def _type(field: FieldInfo, dotted: str = "") -> str:
    """The type of the key ``dotted``, as the reference shows it."""
    return _either(_alternatives(field.annotation, field.metadata, dotted if _section_model(field.annotation) else ""))


def _either(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else ", ".join(alternatives[:-1]) + " or " + alternatives[-1]


def _alternatives(tp: Any, metadata: Sequence[Any] = (), section: str = "") -> list[str]:
    """What a value of type ``tp`` may be, one phrase per alternative (each literal value its own);
    ``section``: the dotted name of a section key, whose model is linked to rather than spelled out."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _alternatives(args[0], [*args[1:], *metadata], section)
    if origin in (Union, types.UnionType):
        return [phrase for arg in args for phrase in _alternatives(arg, metadata, section)]
    if origin is Literal:
        return [f"`{_yaml(value)}`" for value in args]
    if tp is type(None):
        return ["`null`"]
    if _is_model(tp):
        if section:
            return [f"section ([`{section}`](#{_anchor(section)}))"]
        return ["{" + ", ".join(f"{name}: {_type(field)}" for name, field in tp.model_fields.items()) + "}"]
    if origin is list:
        inner = _either(_alternatives(args[0]))
        least = next((m.min_length for m in metadata if isinstance(m, annotated_types.MinLen)), 0)
        return [f"list of {inner}" + (f" (at least {least})" if least else "")]
    if origin is tuple:
        return ["[" + ", ".join(_either(_alternatives(arg)) for arg in args) + "]"]
    if origin is dict:
        return [f"mapping {_either(_alternatives(args[0]))} → {_either(_alternatives(args[1]))}"]
    if isinstance(tp, type) and issubclass(tp, ByteSize):
        return ["byte size (a number of bytes, or `512MiB`, `2GB`, ...)"]
    name = getattr(tp, "__name__", str(tp))
    for bound in metadata:
        if isinstance(bound, annotated_types.Gt):
            name += f" > {bound.gt}"
        elif isinstance(bound, annotated_types.Ge):
            name += f" ≥ {bound.ge}"
    return [name]


# -- values --------------------------------------------------------------------------------------------


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its keys' defaults"
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    """A value as one writes it in the YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ByteSize):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value and value % size == 0:
                return f"{value // size}{unit}"
        return str(int(value))
    if isinstance(value, float):
        fraction = Fraction(value).limit_denominator(10**6)
        if len(repr(value)) > 8 and float(fraction) == value:
            return f"{fraction.numerator}/{fraction.denominator}"  # as the config accepts it: 1/255
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
