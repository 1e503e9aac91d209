"""The errors jacobeam raises for things a user can fix; each message names the file, key or sample."""


class JacobeamError(Exception):
    """Base class: the command-line tool prints these as one clear line instead of a traceback."""


class InputError(JacobeamError, ValueError):
    """An input file that cannot be used; the message names the file and what was expected."""


class ModelError(JacobeamError, ValueError):
    """A model that cannot be loaded or differentiated; the message names its source."""


class OutputError(JacobeamError, RuntimeError):
    """An output folder that cannot take this run's results, or shards that do not fit together."""
