"""A quiet terminal: jacobeam's own lines only, unless ``-v``.

Three sources of noise, three remedies:

- **Python logging** (Beam, TensorFlow, absl, warnings): the handler the command line installs passes
  only the ``jacobeam`` loggers' records (``jacobeam_handler``); ``-v`` passes everything.
- **Native code writing to file descriptor 2**: TensorFlow's and gRPC's C++ logging (Abseil's
  ``WARNING: All log messages before absl::InitializeLog() ...``, then ``I...`` lines such as
  ``port.cc: oneDNN custom operations are on``, ``cudart_stub.cc: Could not find cuda drivers``,
  ``failed call to cuInit``). TensorFlow 2.21 prints the Abseil lines while its libraries load, before it
  reads ``TF_CPP_MIN_LOG_LEVEL`` and whatever that variable, ``ABSL_MIN_LOG_LEVEL`` or
  ``GRPC_VERBOSITY`` say; the oneDNN line is printed whenever oneDNN is on, also with
  ``TF_ENABLE_ONEDNN_OPTS=1`` (and ``=0`` would change the numerics). So ``NativeStderrFilter`` routes
  descriptor 2 of the command and of the worker processes it starts (which inherit it) through a pipe
  and drops those lines (``is_noise``); everything else is passed on. Python's own ``sys.stderr`` goes
  to the terminal directly (a progress bar still sees a terminal). ``TF_CPP_MIN_LOG_LEVEL=3`` is set
  (unless already set) for what TensorFlow does filter itself.
- **Local worker processes** (``--direct_running_mode multi_processing``): each imports
  ``jacobeam.pipeline.worker_start`` as it starts (``runner.py`` lists it in ``--beam_plugins``), which
  calls ``start_worker``: the worker's Python logging keeps to jacobeam's records as in the command,
  and the worker ignores Ctrl-C and SIGTERM, which the command handles for all of them (``interrupt.py``).

The command tells its workers how to behave in the environment variable ``JACOBEAM_WORKERS``
(``quiet`` or ``verbose``); without it (a user's own pipeline calling ``runner.run``), ``start_worker``
changes nothing.
"""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import sys
import threading
import traceback

WORKERS_ENV = "JACOBEAM_WORKERS"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"

_NOISE = re.compile(
    "|".join(
        [
            # Abseil / glog lines of severity INFO and WARNING; an ERROR line (E...) only where it is the
            # known complaint of a machine without a GPU. Other errors, and FATAL lines, reach the user.
            r"[IW]\d{4} [\d:.]+ +\d+ [^ \]]+:\d+\] .*",
            r"E\d{4} [\d:.]+ +\d+ [^ \]]+:\d+\] (?:failed call to cuInit|Unable to register cu\w+ factory).*",
            r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
            # the second line of TensorFlow's cpu_feature_guard message
            r"To enable the following instructions: .* in other operations, rebuild TensorFlow .*",
            # a worker process's Python log lines before it has imported worker_start (Beam's default
            # format): "WARNING:root:apitools not found ...", "INFO:__main__:Logging handler created."
            r"(?:DEBUG|INFO|WARNING):(?!jacobeam\b)[\w.]+:.*",
        ]
    )
)


def is_noise(line: str) -> bool:
    """Whether a line written to descriptor 2 by native code or a starting worker is noise."""
    return _NOISE.fullmatch(line.rstrip("\r\n")) is not None


def is_jacobeam(record: logging.LogRecord) -> bool:
    return record.name == "jacobeam" or record.name.startswith("jacobeam.")


class _CurrentStderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is emitted, like logging's last resort: ``cli.main``
    called in a process (a notebook, a test) must not keep a stream that its caller later closes."""

    def __init__(self):
        super().__init__(None)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def jacobeam_handler(stream, verbose: bool) -> logging.Handler:
    """The log handler of the command and its workers: jacobeam's format; without ``verbose``, only the
    ``jacobeam`` loggers' records. ``stream=None``: the process's ``sys.stderr`` of the moment."""
    handler = _CurrentStderr() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt=DATEFMT))
    if not verbose:
        handler.addFilter(is_jacobeam)
    return handler


def prepare_environment(verbose: bool) -> None:
    """Environment variables to set before TensorFlow is imported, here or in worker processes (which
    inherit them)."""
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ[WORKERS_ENV] = "verbose" if verbose else "quiet"


class NativeStderrFilter:
    """Descriptor 2 of this process (and so of the processes it starts) through a pipe whose reader
    drops ``is_noise`` lines; ``sys.stderr`` keeps writing to the real stream, unfiltered.

    ``mute()`` drops everything from then on (the command stops its workers on Ctrl-C: what they print
    while dying is not news). ``close()`` puts descriptor 2 back.
    """

    def __init__(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)  # the real stderr; not inherited by child processes (PEP 446)
        read, write = os.pipe()
        os.dup2(write, 2)  # inheritable: worker processes write here
        os.close(write)
        self._read = read
        self._muted = False
        self._old_stderr = sys.stderr
        self.stderr = io.TextIOWrapper(
            io.FileIO(self._saved, "w", closefd=False), encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
            errors="backslashreplace", line_buffering=True,
        )
        sys.stderr = self.stderr
        self._thread = threading.Thread(target=self._forward, name="jacobeam-stderr", daemon=True)
        self._thread.start()

    @property
    def fileno(self) -> int:
        """The real stderr's descriptor (for a signal handler's ``os.write``)."""
        return self._saved

    def mute(self) -> None:
        self._muted = True

    def _forward(self) -> None:
        with open(self._read, "rb", buffering=0, closefd=True) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._emit(line + b"\n")
            if pending:
                self._emit(pending)

    def _emit(self, line: bytes) -> None:
        if self._muted or is_noise(line.decode("utf-8", "replace")):
            return
        try:
            os.write(self._saved, line)
        except OSError:
            pass

    def close(self) -> None:
        """Descriptor 2 back to the real stderr; waits briefly for the lines still in the pipe."""
        try:
            self.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved, 2)  # closes this process's end of the pipe: the reader sees its end once
        self._thread.join(timeout=2.0)  # the workers' ends are closed too (they have exited)
        sys.stderr = self._old_stderr


def start_worker() -> None:
    """In a local worker process of the command (see the module's docstring); nothing elsewhere."""
    mode = os.environ.get(WORKERS_ENV)
    if mode not in ("quiet", "verbose"):
        return
    if threading.current_thread() is threading.main_thread():
        # The command stops its workers on Ctrl-C and SIGTERM (sent to the whole group by a terminal, by
        # Slurm): a worker dying first would make Beam print its failure before the command's one line.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "quiet":
        real = sys.stderr
        root = logging.getLogger()
        for handler in list(root.handlers):
            if type(handler) is logging.StreamHandler:  # Beam's default one; not its FnApi log handler
                root.removeHandler(handler)
        root.addHandler(jacobeam_handler(real, verbose=False))
        logging.captureWarnings(True)
        # Beam prints the traceback of an error it reports to the runner (whose error the command shows,
        # with the traceback under -v): the worker's own uncaught exceptions still reach the terminal.
        sys.stderr = open(os.devnull, "w")  # for the life of the process
        sys.excepthook = lambda *exc: traceback.print_exception(*exc, file=real)
