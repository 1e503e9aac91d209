"""The one-writer lease of an output folder (transforms/output/lease.py), in one process: a live holder
refuses a second writer, a dead or silent holder is taken over, release removes only its own lease."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jacobeam.transforms.output import lease
from jacobeam.transforms.output.layout import LEASE
from jacobeam.transforms.testing import faults
from tests.services import JacobeamRuns


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    with lease.Lease(str(tmp_path)).acquire() as first:
        holder = rf"run {first.run_id} \({socket.gethostname()}, pid {os.getpid()}, since "
        with pytest.raises(lease.LeaseBusy, match=rf"{tmp_path} is being written by {holder}"):
            lease.Lease(str(tmp_path)).acquire()
        assert json.loads((tmp_path / LEASE).read_text())["holder"] == first.run_id
    assert not (tmp_path / LEASE).exists()


def _dead_pid():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _record(holder, pid, heartbeat=9e12, **machine):
    return json.dumps({"holder": holder, "host": socket.gethostname(), "pid": pid, "started_at": 0,
                       "heartbeat": heartbeat, **machine})


@pytest.mark.skipif(lease._machine()["boot_id"] is None, reason="no /proc: the taker cannot know a process is gone")
def test_a_lease_whose_process_is_gone_on_this_machine_is_taken_over_at_once(tmp_path, caplog):
    (tmp_path / LEASE).write_text(_record("dead", _dead_pid(), **lease._machine()))
    with lease.Lease(str(tmp_path)).acquire() as taken:
        assert json.loads((tmp_path / LEASE).read_text())["holder"] == taken.run_id
    assert "taking over the lease of run dead" in caplog.text and "is gone" in caplog.text


def test_a_pid_that_now_names_another_process_is_gone(tmp_path, caplog):
    if lease._machine()["boot_id"] is None:
        pytest.skip("no /proc")
    record = _record("reused", os.getpid(), **lease._machine(), process_start="1")  # our pid, another start
    (tmp_path / LEASE).write_text(record)
    with lease.Lease(str(tmp_path)).acquire():
        pass
    assert "the pid is another process's now" in caplog.text


@pytest.mark.parametrize("elsewhere", [
    {"boot_id": "another-boot", "pid_namespace": None},  # fields as another boot of this host wrote them
    {"pid_namespace": "pid:[1]"},  # another PID namespace (a container with this host name)
    {},  # a record that does not say (an older jacobeam, or a system without /proc)
])
def test_a_dead_pid_is_no_evidence_where_the_pid_means_something_else(tmp_path, elsewhere):
    """The pid is not visible here, but the holder ran in another boot or PID namespace: it may well be
    alive, and its heartbeat is fresh: refused."""
    machine = {**lease._machine(), **elsewhere} if elsewhere else {}
    (tmp_path / LEASE).write_text(_record("other", _dead_pid(), heartbeat=time.time(), **machine))
    with pytest.raises(lease.LeaseBusy, match="is being written by run other"):
        lease.Lease(str(tmp_path)).acquire()
    assert json.loads((tmp_path / LEASE).read_text())["holder"] == "other"


def test_a_lease_that_does_not_change_while_watched_is_taken_over(tmp_path, caplog):
    """No heartbeat for the stale time, as this process watched it on its own monotonic clock."""
    (tmp_path / LEASE).write_text(json.dumps(
        {"holder": "far", "host": "another-host", "pid": 1, "started_at": 0, "heartbeat": 0}))
    began = time.monotonic()
    with lease.Lease(str(tmp_path), stale_seconds=0.6).acquire():
        assert time.monotonic() - began >= 0.6  # it watched before taking over
    assert "watching it for 1 s" in caplog.text and "did not change for 1 s, watched from here" in caplog.text


def test_a_heartbeat_that_looks_old_by_the_clocks_but_changes_is_a_live_holder(tmp_path, monkeypatch, caplog):
    """A taker whose clock is 400 s ahead: the holder's heartbeat looks stale by the clocks, so the taker
    watches it, sees it change, and is refused. (Two processes: ``test_..._clock_400_s_ahead_exits_75``.)"""
    monkeypatch.setenv(faults.LEASE_SECONDS, "0.05:2")
    holder = lease.Lease(str(tmp_path)).acquire()
    try:
        monkeypatch.setenv(faults.CLOCK_OFFSET, "400")  # the heartbeat thread's clock too: it writes a time
        began = time.monotonic()  # 400 s ahead at its next beat, but the taker read the one before
        with pytest.raises(lease.LeaseBusy, match=f"is being written by run {holder.run_id} "):
            lease.Lease(str(tmp_path)).acquire()
        assert time.monotonic() - began < 2  # refused at the first change, not after the stale time
        assert f"run {holder.run_id}" in caplog.text and "looks old by the clocks; watching it for 2 s" in caplog.text
    finally:
        holder.release()


def test_a_take_over_waits_for_a_commit_under_way(tmp_path):
    """The folder's lock: a taker that finds it held (a commit of the holder under way) does not take over."""
    (tmp_path / LEASE).write_text(_record("busy", 0, heartbeat=0))
    file = lease.lease_file(str(tmp_path), "busy")
    with file.locked():
        taker = lease.Lease(str(tmp_path), stale_seconds=0.2)
        assert not taker._file.take_over(file.read()[1])
    assert json.loads((tmp_path / LEASE).read_text())["holder"] == "busy"


def test_a_retried_claim_of_the_same_run_takes_its_own_lease_again(tmp_path):
    """A runner that retries ``WriteShards``' claim (the same run id) finds the lease its first attempt
    took: it is this run's, not another holder's."""
    first = lease.Lease(str(tmp_path), run_id="0123456789ab").acquire()
    first._stop.set()  # the first attempt's worker is gone, its record stays
    again = lease.Lease(str(tmp_path), run_id="0123456789ab").acquire()
    try:
        assert json.loads((tmp_path / LEASE).read_text())["holder"] == "0123456789ab"
        assert again._file.refresh(again._record())  # its heartbeat writes the record it adopted
    finally:
        again.release()
        first.release()  # removes nothing: the record is no longer the one it wrote
    assert not (tmp_path / LEASE).exists()


def test_release_never_removes_another_runs_lease(tmp_path):
    held = lease.Lease(str(tmp_path)).acquire()
    other = {"holder": "other", "host": socket.gethostname(), "pid": os.getpid(), "started_at": 0, "heartbeat": 9e12}
    (tmp_path / LEASE).write_text(json.dumps(other))  # as if taken over meanwhile
    held.release()
    assert json.loads((tmp_path / LEASE).read_text())["holder"] == "other"


# ``jacobeam run`` holding the lease: two commands at one folder (issue 23), --wait, a killed holder.


def _write_data(folder):
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, size in (("a", 7), ("b", 13)):
        np.save(folder / f"{name}.npy", rng.normal(size=(size, 12)).astype(np.float32))


def _config(root, out):
    path = root / f"{out.name}.yaml"
    path.write_text(json.dumps({
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": [str(root / "data" / "*.npy")]},
        "jacobian": {"batch_size": 4},
        "output": {"path": str(out), "samples_per_shard": 8},
    }))
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    from jacobeam.pipeline import cli

    root = tmp_path_factory.mktemp("lease")
    _write_data(root / "data")
    assert cli.main(["-q", "run", str(_config(root, root / "clean"))]) == 0
    return root, root / "clean"


@pytest.fixture
def runs():
    started = JacobeamRuns()
    yield started
    started.stop()


def _wait_for_lease(out, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not (out / LEASE).exists():
        assert proc.poll() is None, f"the first run ended ({proc.returncode}) before taking the lease"
        assert time.monotonic() < deadline, "the first run took no lease"
        time.sleep(0.1)
    return json.loads((out / LEASE).read_text())


def _assert_same_as_clean(out, clean_out):
    import h5py
    import numpy as np

    from jacobeam.pipeline.verify import verify

    with h5py.File(out / "jacobians.h5") as ours, h5py.File(clean_out / "jacobians.h5") as theirs:
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            np.testing.assert_array_equal(ours[name][:], theirs[name][:])
    assert not (out / LEASE).exists()
    report = verify(out, samples=2)
    assert report.ok, report.problems


@pytest.mark.slow
def test_a_second_run_at_a_folder_being_written_exits_75_naming_the_holder(clean, runs):
    root, clean_out = clean
    out = root / "twice"
    config = _config(root, out)
    # The first run holds once planned (the lease taken) until the second has started and exited.
    go = root / "go-twice"
    first = runs.start(["-q", "run", str(config)], root / "first", {faults.HOLD_AT: f"plan:{go}"})
    holder = _wait_for_lease(out, first)
    second = runs.start(["-q", "run", str(config)], root / "second")
    assert second.wait(timeout=120) == 75
    assert first.poll() is None  # the second ended while the first was still writing
    go.touch()
    lines = (root / "second.err").read_text().strip().splitlines()
    assert lines[-1].startswith(f"jacobeam: error: output folder {out} is being written by run {holder['holder']} "
                                f"({socket.gethostname()}, pid {first.pid}, since ")
    assert lines[-1].endswith("retry later or pass --wait")
    assert first.wait(timeout=300) == 0, (root / "first.err").read_text()[-2000:]
    _assert_same_as_clean(out, clean_out)


@pytest.mark.slow
def test_with_wait_the_second_run_waits_then_computes_nothing(clean, runs):
    root, clean_out = clean
    out = root / "waited"
    config = _config(root, out)
    go = root / "go-waited"  # the first run holds, the lease taken, until the second is waiting for it
    first = runs.start(["-q", "run", str(config)], root / "first-w", {faults.HOLD_AT: f"plan:{go}"})
    _wait_for_lease(out, first)
    second = runs.start(["-q", "run", str(config), "--wait"], root / "second-w")
    deadline = time.monotonic() + 120
    while "waiting" not in (root / "second-w.err").read_text():
        assert second.poll() is None and time.monotonic() < deadline, (root / "second-w.err").read_text()[-2000:]
        time.sleep(0.1)
    go.touch()
    assert first.wait(timeout=300) == 0, (root / "first-w.err").read_text()[-2000:]
    assert second.wait(timeout=300) == 0, (root / "second-w.err").read_text()[-2000:]
    assert "(0 computed, 20 already complete)" in (root / "second-w.out").read_text()
    _assert_same_as_clean(out, clean_out)


@pytest.mark.slow
def test_the_lease_of_a_killed_run_is_taken_over_by_the_next(clean, capsys):
    from jacobeam.pipeline import cli
    from tests.services import jacobeam_process

    root, clean_out = clean
    out = root / "killed"
    config = _config(root, out)
    status, pid = jacobeam_process(["-q", "run", str(config)], root / "killed.err", kill_at="plan")
    assert status == -9, (root / "killed.err").read_text()[-2000:]
    assert json.loads((out / LEASE).read_text())["pid"] == pid  # kill -9 left its lease
    capsys.readouterr()
    assert cli.main(["-q", "run", str(config)]) == 0
    assert "taking over the lease of run" in capsys.readouterr().err
    _assert_same_as_clean(out, clean_out)


@pytest.mark.slow
def test_ctrl_c_releases_the_lease(clean, runs):
    import signal

    root, _ = clean
    out = root / "interrupted"
    run = runs.start(["-q", "run", str(_config(root, out))], root / "interrupted", {"JACOBEAM_TEST_DELAY_AT": "plan:30"})
    _wait_for_lease(out, run)
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=60) == 130, (root / "interrupted.err").read_text()[-2000:]
    assert not (out / LEASE).exists()


def test_three_daily_increments_with_an_overlapping_second_firing_equal_a_clean_run(tmp_path):
    """A scheduler fires the same command daily over a growing set of files; on day 2 it fires twice at
    once: the second firing finds the folder held and is refused (LeaseBusy: exit status 75), then, fired
    again, has nothing left to do. The folder ends as the same schedule without the overlap leaves its
    own: the same ids and values, bit for bit; and it verifies (samples recomputed by a tape)."""
    import h5py
    import numpy as np

    from jacobeam.pipeline import config, runner
    from jacobeam.pipeline.verify import verify

    data, rng = tmp_path / "data", np.random.default_rng(0)
    data.mkdir()

    def cfg(out):
        return config.validate({
            "model": {"factory": "tests.models:small_mlp"},
            "input": {"paths": [str(data / "*.npy")]},
            "jacobian": {"batch_size": 4, "threads": 1},
            "output": {"path": str(out), "samples_per_shard": 8},
        })

    def run(out):
        return runner.run(cfg(out), [], show_progress=False).manifest["run"]["samples_computed"]

    computed = []
    for day, size in enumerate((11, 6, 9), start=1):
        np.save(data / f"day{day}.npy", rng.normal(size=(size, 12)).astype(np.float32))
        if day == 2:  # the first firing holds the folder while the second one starts
            with lease.Lease(str(tmp_path / "daily")).acquire():
                with pytest.raises(lease.LeaseBusy, match=r"is being written by run .*retry later or pass --wait"):
                    run(tmp_path / "daily")
            computed.append(run(tmp_path / "daily"))
            computed.append(run(tmp_path / "daily"))  # the retried second firing: nothing left
        else:
            computed.append(run(tmp_path / "daily"))
        computed.append(run(tmp_path / "clean"))  # the same schedule, never overlapping
    assert computed == [11, 11, 6, 0, 6, 9, 9]
    with h5py.File(tmp_path / "daily" / "jacobians.h5") as daily, h5py.File(tmp_path / "clean" / "jacobians.h5") as clean:
        assert set(daily) == set(clean)
        for name in clean:
            np.testing.assert_array_equal(daily[name][:], clean[name][:])
    assert verify(tmp_path / "daily", samples=3).ok
