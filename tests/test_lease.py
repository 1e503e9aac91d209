"""The one-writer lease of an output folder (transforms/output/lease.py), in one process: a live holder
refuses a second writer, a dead or silent holder is taken over, release removes only its own lease."""

import json
import os
import socket
import subprocess
import sys

import pytest

from jacobeam.transforms.output import lease
from jacobeam.transforms.output.layout import LEASE


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    with lease.Lease(str(tmp_path)).acquire() as first:
        holder = rf"run {first.run_id} \({socket.gethostname()}, pid {os.getpid()}, since "
        with pytest.raises(lease.LeaseBusy, match=rf"{tmp_path} is being written by {holder}"):
            lease.Lease(str(tmp_path)).acquire()
        assert json.loads((tmp_path / LEASE).read_text())["holder"] == first.run_id
    assert not (tmp_path / LEASE).exists()


def test_a_lease_whose_process_is_gone_is_taken_over(tmp_path, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / LEASE).write_text(json.dumps(
        {"holder": "dead", "host": socket.gethostname(), "pid": gone.pid, "started_at": 0, "heartbeat": 9e12}))
    with lease.Lease(str(tmp_path)).acquire() as taken:
        assert json.loads((tmp_path / LEASE).read_text())["holder"] == taken.run_id
    assert "taking over the lease of run dead" in caplog.text and "is gone" in caplog.text


def test_a_lease_without_a_recent_heartbeat_is_taken_over(tmp_path, caplog):
    (tmp_path / LEASE).write_text(json.dumps(
        {"holder": "far", "host": "another-host", "pid": 1, "started_at": 0, "heartbeat": 0}))
    with lease.Lease(str(tmp_path)).acquire():
        pass
    assert "no heartbeat for" in caplog.text


def test_release_never_removes_another_runs_lease(tmp_path):
    held = lease.Lease(str(tmp_path)).acquire()
    other = {"holder": "other", "host": socket.gethostname(), "pid": os.getpid(), "started_at": 0, "heartbeat": 9e12}
    (tmp_path / LEASE).write_text(json.dumps(other))  # as if taken over meanwhile
    held.release()
    assert json.loads((tmp_path / LEASE).read_text())["holder"] == "other"
