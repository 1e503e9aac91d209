"""What every section of the run configuration shares."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def home_expanded(value: Any) -> Any:
    """A path (or each of a list) that starts with ``~`` is in the user's home, as a shell would have it: in a
    config file or a quoted ``--set`` no shell expands it."""
    if isinstance(value, list):
        return [home_expanded(each) for each in value]
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


def one_string_is_a_list(value: Any) -> Any:
    """A list key given one string (``--set jacobian.aggregate=mean``) means a list of that one string,
    validated as any list."""
    return [value] if isinstance(value, str) else value
