"""Imported by each local worker process of the ``jacobeam`` command as it starts (Beam imports the
modules named in ``--beam_plugins``; ``runner.py`` names this one for local runners): see
``quiet.start_worker``. Importing it elsewhere changes nothing unless the command's environment
variable ``JACOBEAM_WORKERS`` is set."""

from jacobeam.pipeline.quiet import start_worker

start_worker()
