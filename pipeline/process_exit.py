"""Ending a process that imported TensorFlow without Python's teardown of its modules.

Once the work is done, Python's finalization tears down every module, and TensorFlow's take seconds (2-4 s
measured on 2 shared cores after a ``jacobeam run``) that whoever waits for the process waits through: the
user at the terminal, or the launcher waiting for its worker processes. Nothing is left to finish by then
(every shard and the manifest were closed and renamed before the pipeline returned), so a process that owns
its end finishes what Python's own exit would (other threads, exit handlers, logging, the standard streams)
and then leaves with ``os._exit``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import NoReturn


def flush() -> None:
    """Logging's handlers and the standard streams, as Python's exit would flush them."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def end(status: int) -> NoReturn:
    """Exit with ``status`` as Python would (waiting for other non-daemon threads, running the exit
    handlers, flushing), but without tearing down the modules."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # runs each registered handler once, then forgets them
    flush()
    os._exit(status)
