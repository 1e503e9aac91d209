"""Imported by each local worker process as it starts (Beam imports the modules named in
``--beam_plugins``; ``runner.py`` names this one for local runners, whose ``multi_processing`` workers
are Beam's ``sdk_worker_main`` processes). In such a process it:

- makes the worker as quiet as the command, under the command's ``JACOBEAM_WORKERS``
  (``quiet.start_worker``);
- starts importing TensorFlow on a thread: the import (seconds) then overlaps Beam's start of the
  worker and the job's first steps, before ``ComputeShards`` builds the engine;
- ends the process without Python's finalization once Beam's harness has returned: tearing down the
  modules of TensorFlow takes seconds (2-4 s measured on 2 shared cores), and the launcher's run waits
  for every worker process to exit. Nothing is left to flush by then: each shard and the manifest were
  closed and renamed before the pipeline finished.

Importing it in any other process changes nothing unless ``JACOBEAM_WORKERS`` is set (then only
``quiet.start_worker``)."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from jacobeam.pipeline import process_exit
from jacobeam.pipeline.quiet import start_worker

BEAM_WORKER_MAIN = "apache_beam.runners.worker.sdk_worker_main"

_failed = False  # an exception reached the top of the worker process: exit with status 1


def in_beam_worker() -> bool:
    """Whether this process is a worker process of Beam's local runner (``python -m ...sdk_worker_main``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == BEAM_WORKER_MAIN


def _import_tensorflow() -> None:
    try:
        import tensorflow  # noqa: F401
    except Exception:  # the engine's own import reports it
        pass


def _note_failure(hook):
    def excepthook(*exc) -> None:
        global _failed
        _failed = True
        hook(*exc)

    return excepthook


def _exit_now() -> None:
    """The last exit handler that matters (registered before TensorFlow's, so it runs after theirs)."""
    process_exit.flush()
    os._exit(1 if _failed else 0)


def prepare() -> None:
    start_worker()
    if not in_beam_worker():
        return
    sys.excepthook = _note_failure(sys.excepthook)
    atexit.register(_exit_now)
    threading.Thread(target=_import_tensorflow, name="jacobeam-import-tf", daemon=True).start()


prepare()
