"""Input formats by file name. Each format is a module with the functions of ``types.Format``
(``describe``, ``open_samples``) and its file name suffixes (``SUFFIXES``); a new format is a new
module listed here."""

from __future__ import annotations

from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs import arrays, images, tfrecords
from jacobeam.transforms.inputs.types import Format

_MODULES: tuple[Format, ...] = (arrays, tfrecords, images)
# file name suffix (lower case) -> format name
FORMATS: dict[str, str] = {suffix: name for module in _MODULES for suffix, name in module.SUFFIXES.items()}
_BY_NAME: dict[str, Format] = {name: module for module in _MODULES for name in module.SUFFIXES.values()}
IMAGE_SUFFIXES = tuple(images.SUFFIXES)


def file_format(path: str) -> str:
    """The format name of a file (``npy``, ``npz``, ``h5``, ``tfrecord``, ``image``), by its name."""
    lower = path.lower()
    for suffix, name in FORMATS.items():
        if lower.endswith(suffix):
            return name
    raise InputError(f"{path}: unsupported file type; expected one of {', '.join(FORMATS)}")


def format_of(path: str) -> Format:
    """The module that reads a file of this name."""
    return _BY_NAME[file_format(path)]
