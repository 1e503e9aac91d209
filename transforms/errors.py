"""The errors jacobeam raises for things a user can fix; each message names the file, key or sample.

``first_line`` gives the gist of a library's error (TensorFlow's, say) for such a message.
"""

import re


class JacobeamError(Exception):
    """Base class: the command-line tool prints these as one clear line instead of a traceback."""


class MissingExtra(JacobeamError):
    """An optional dependency the command needs is not installed (the command's exit status 3); the
    message says what to install."""


class InputError(JacobeamError, ValueError):
    """An input file that cannot be used; the message names the file and what was expected."""


class CorruptInputError(InputError):
    """A file, or rows of it, that cannot be read: truncated, corrupt or unreadable.

    Unlike other input errors (a wrong dtype or sample shape, a missing key: mistakes in the config or
    the data set), these are bad data that ``input.on_bad_sample: skip`` may skip. ``reason`` is the
    short, file-independent cause recorded in ``rejected.jsonl``.
    """

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def first_line(err: Exception) -> str:
    """The gist of an error: its first line, without TensorFlow's op decorations."""
    text = (str(getattr(err, "message", None) or err).strip().splitlines() or [type(err).__name__])[0][:300]
    return re.sub(r"\s*\[Op:\w+\]( name:.*)?$", "", re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text))


class ModelError(JacobeamError, ValueError):
    """A model that cannot be loaded or differentiated; the message names its source."""


class OutputError(JacobeamError, RuntimeError):
    """An output folder that cannot take this run's results, or shards that do not fit together."""


class SelfCheckError(JacobeamError, RuntimeError):
    """The run's self-check: a sample recomputed on its own does not reproduce what the engine computed
    for it in its batch; the message names the shard, the sample, the dataset and the error."""


class LostLeaseError(OutputError):
    """This run no longer holds its output folder's lease (it was paused past the stale time and another
    run took the folder over): it commits nothing more (the command's exit status 76)."""


def span(start: int, stop: int, noun: str = "id") -> str:
    """The ids (or rows, records) ``start`` up to ``stop``, ``stop`` excluded, in words, as every message
    writes them: ``ids 8 to 15``, ``id 8`` for one, ``no ids`` for none (never ``8..9`` or ``11..11``)."""
    if stop <= start:
        return f"no {noun}s"
    if stop - start == 1:
        return f"{noun} {start}"
    return f"{noun}s {start} to {stop - 1}"
