"""Ctrl-C (or SIGTERM: a scheduler's stop, a preemption) in the ``jacobeam`` command: its process tree (the
worker processes, the shells Beam starts them through) killed at once, the output folder's lease released,
one line saying what is kept, and the exit status the command gives an interrupt."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from jacobeam.pipeline import quiet
from jacobeam.transforms.output import storage


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (worker processes, the shells Beam starts them through), from /proc or
    ``ps``."""
    parents: dict[int, int] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    else:
        import subprocess

        try:
            listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        for line in listing.splitlines():
            child, _, parent = line.strip().partition(" ")
            if child.isdigit() and parent.strip().isdigit():
                parents[int(child)] = int(parent.strip())
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


class CtrlC:
    """What Ctrl-C and SIGTERM do to the command: stop at once, its worker processes with it, and say in one
    line what is kept. A shard is complete once renamed into place (as after a kill, the next run keeps every
    complete shard and computes the rest), so nothing needs to wind down; the lease is released, so that a
    rerun elsewhere (a rescheduled job) need not wait for it to go stale."""

    def __init__(self, status: int, terminated: int) -> None:
        # cli.INTERRUPTED, cli.TERMINATED: cli.py keeps every exit status next to the help text listing them
        self.status, self.terminated = status, terminated
        self.signal = signal.SIGINT
        self.spec = None
        self.native: quiet.NativeStderrFilter | None = None

    def planned(self, spec) -> None:
        self.spec = spec

    def install(self, native: quiet.NativeStderrFilter | None) -> None:
        self.native, self.spec = native, None
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)

    def message(self) -> str:
        what = "interrupted" if self.signal == signal.SIGINT else "terminated (SIGTERM)"
        if self.spec is None:
            return f"jacobeam: {what}"
        from jacobeam.transforms.output.layout import OVERWRITE_DIR, SHARDS_DIR, shard_name

        replacing = ""
        if storage.name_of(self.spec.output_dir) == OVERWRITE_DIR:
            moved = self._moved_in(what)
            if moved:
                return moved
            # An --overwrite computes in a folder of its own (pipeline.overwrite): the old result is still whole.
            replacing = "; the result it replaces is untouched"
        expected = {shard_name(r.start, r.stop) for r in self.spec.ranges() if r.rows}
        try:
            done = len(expected & set(storage.listdir(storage.join(self.spec.output_dir, SHARDS_DIR))))
        except Exception:  # the message must come out whatever the folder does
            return f"jacobeam: {what}; complete shards are kept: run the same command again to finish{replacing}"
        return (
            f"jacobeam: {what}: {done} of {len(expected)} shards complete and kept; "
            f"run the same command again to finish{replacing}"
        )

    def _moved_in(self, what: str) -> str | None:
        """Where an ``--overwrite`` was stopped once its result was committed (``pipeline.overwrite.finish``):
        moving it in, or moved (and being verified). None: it was still computing."""
        from jacobeam.transforms.output.layout import MANIFEST

        staged = self.spec.output_dir
        root = staged.rstrip("/").rsplit("/", 1)[0]
        try:
            if storage.exists(storage.join(staged, MANIFEST)):
                return (f"jacobeam: {what} while this run's result replaced the one in {root}: the next run of the "
                        "folder finishes replacing it")
            manifest = json.loads(storage.read_text(storage.join(root, MANIFEST)))
            if manifest["run"]["id"] == self.spec.run_id:
                return f"jacobeam: {what}: this run's result has replaced the one in {root}"
        except Exception:  # the message must come out whatever the folder does
            pass
        return None

    def __call__(self, signum, frame) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.signal = signum
        logging.disable(logging.CRITICAL)  # Beam's threads would log the failure the interrupt causes
        threading.excepthook = lambda args: None
        if self.native is not None:
            self.native.mute()
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:  # os._exit below skips every finally: the output folder's lease is released here
            from jacobeam.transforms.output import lease

            lease.release_held()
        except Exception:
            pass
        fd = self.native.fileno if self.native is not None else 2
        try:
            sys.stdout.flush()
        except Exception:  # inside a write that the signal interrupted
            pass
        try:
            os.write(fd, (("\n" if os.isatty(fd) else "") + self.message() + "\n").encode())
        finally:
            # no clean-up: Beam's threads would only print what they were doing
            os._exit(self.status if signum == signal.SIGINT else self.terminated)
