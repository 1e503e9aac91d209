"""What every section of the run configuration shares."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def one_string_is_a_list(value: Any) -> Any:
    """A list key given one string (``--set jacobian.aggregate=mean``) means a list of that one string,
    validated as any list."""
    return [value] if isinstance(value, str) else value
