"""The take-over scenario of issue 36, for a local, S3 or GCS output folder: run A is paused (SIGSTOP, its
whole process group) while writing its first shard, past the lease's stale time; run B, another model
with --overwrite, takes the folder over and finishes; A resumes and must commit nothing more."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jacobeam.pipeline import cli
from jacobeam.transforms.testing import faults
from tests.services import JacobeamRuns

QUICK_LEASE = {faults.LEASE_SECONDS: "0.2:2"}  # heartbeat every 0.2 s, stale after 2 s


def write_data(root: Path) -> None:
    folder = root / "data"
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for name, size in (("a", 7), ("b", 13)):
        np.save(folder / f"{name}.npy", rng.normal(size=(size, 12)).astype(np.float32))


def config(root: Path, name: str, out: str, factory: str) -> str:
    path = root / f"{name}.yaml"
    path.write_text(json.dumps({
        "model": {"factory": factory},
        "input": {"paths": [str(root / "data" / "*.npy")]},
        "jacobian": {"batch_size": 4},
        "output": {"path": out, "samples_per_shard": 8},
    }))
    return str(path)


def wait_for(path: Path, proc, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"ended ({proc.returncode}) before {path.name}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {path.name} in {timeout} s"
        time.sleep(0.05)


def pause(pid: int, out: str) -> None:
    """SIGSTOP the run's process group at a moment it does not hold the local folder's lock: its heartbeat
    holds it for the few ms of writing the lease, and a run paused there keeps every taker out (B then
    refuses, rightly, after the lock's patience), which is not this scenario."""
    for _ in range(100):
        os.killpg(pid, signal.SIGSTOP)
        if "://" in out or _lock_free(out):
            return
        os.killpg(pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError(f"run {pid} held the lock of {out} at every pause")


def _lock_free(folder: str) -> bool:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def paused_and_taken_over(
    root: Path, runs: JacobeamRuns, out: str, args: list[str], files: Callable[[], dict[str, bytes]],
    read_lease: Callable[[], dict],
) -> None:
    """A paused past the stale time, taken over by B (another model, --overwrite), resumed: A exits 76 with
    one line naming B; B's folder is byte for byte as B left it, names B's model and verifies."""
    write_data(root)
    go = root / "go"
    a = runs.start(["-q", "run", config(root, "a", out, "tests.models:small_mlp"), *args], root / "a",
                   {**QUICK_LEASE, faults.HOLD_AT: f"shard_write:{go}"})
    wait_for(root / "go.held", a, root / "a.err")
    a_id = read_lease()["holder"]
    pause(a.pid, out)  # a laptop lid, a VM migration: its heartbeat stops too
    while time.time() - read_lease()["heartbeat"] < 2.5:  # paused past the stale time
        time.sleep(0.1)
    b = runs.start(["-q", "run", config(root, "b", out, "tests.models:softmax_mlp"), "--overwrite", *args],
                   root / "b", QUICK_LEASE)
    assert b.wait(timeout=300) == 0, (root / "b.err").read_text()[-3000:]
    b_err = (root / "b.err").read_text()
    assert f"taking over the lease of run {a_id}" in b_err and "watched from here" in b_err, b_err
    done = files()
    manifest = json.loads(done["manifest.json"])
    assert manifest["config"]["model"]["factory"] == "tests.models:softmax_mlp"

    os.killpg(a.pid, signal.SIGCONT)
    go.touch()
    assert a.wait(timeout=300) == cli.LOST, (root / "a.err").read_text()[-3000:]
    lines = (root / "a.err").read_text().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"jacobeam: error: output folder {out.rstrip('/')}: this run ({a_id}) no longer "
                               "holds its lease"), lines[0]
    assert f"run {manifest['run']['id']} took it over and finished at {manifest['created_at']}" in lines[0]
    assert files() == done  # nothing of A's landed, nothing of B's went
    assert cli.main(["-q", "verify", out, *args]) == 0
