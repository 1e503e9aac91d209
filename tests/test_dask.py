"""``jacobeam run ... --runner DaskRunner`` on a real Dask ``distributed`` cluster: a scheduler and two
workers on loopback, each a process of its own as ``dask scheduler`` and ``dask worker`` start them
(one thread each, no nanny). The launcher is ``python -m jacobeam run`` in a process group of its own.

Each run is compared with the in-process runner's bit for bit (every shard, every dataset of
``jacobians.h5`` and ``aggregates.h5``, ``rejected.jsonl``), also after a worker is killed mid-run;
a killed launcher's work stops on the cluster within a bound, and the same command then resumes.

The workers pause at each shard's commit (``JACOBEAM_TEST_DELAY_AT``, with the shard complete in its
temporary file), so that a kill lands while shards are under way and a worker can die holding a
temporary file.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli
from jacobeam.transforms.testing import faults
from tests.services import dask_cluster
from tests.test_faults import assert_same_as

pytest.importorskip("distributed")

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PAUSE = 0.3  # seconds each worker waits at each shard's commit
SHARDS = 14  # 320 ids in shards of 24
STOP_WITHIN = 30.0  # seconds: a killed launcher's tasks must be gone from the cluster by then


def _write_data(folder: Path) -> None:
    """320 ids in four files and a truncated one, plus a corrupt file: under
    ``on_bad_sample: skip`` rejected rows (NaN, Inf, truncated) and a rejected file."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    for name, size in (("a", 70), ("b", 130), ("c", 100), ("d", 20)):
        x = rng.normal(size=(size, 12)).astype(np.float32)
        if name == "b":
            x[4, 2], x[90, 0] = np.nan, np.inf
        np.save(folder / f"{name}.npy", x)
    d = folder / "d.npy"
    d.write_bytes(d.read_bytes()[: -4 * 12 * 3 - 5])  # its last rows incomplete
    (folder / "e.npy").write_bytes(b"\x93NUMPY garbage that is not a header")


def _config(root: Path, out: Path) -> Path:
    path = root / f"{out.name}.json"
    cfg = {
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": [str(root / "data" / "*.npy")], "on_bad_sample": "skip"},
        # One thread per process, however many processes: a shard records its threads.
        "jacobian": {"batch_size": 8, "threads": 1, "aggregate": ["mean", "mean_abs", "jtj"]},
        "output": {"path": str(out), "samples_per_shard": 24},
    }
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The data, and the same job's output from the in-process runner."""
    root = tmp_path_factory.mktemp("dask")
    _write_data(root / "data")
    clean = root / "clean"
    assert cli.main(["-q", "run", str(_config(root, clean))]) == 0
    return root, clean


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", faults.DELAY_AT: f"shard_commit:{PAUSE}"}
    for name in (faults.KILL_AT, faults.FAIL_SHARD_ONCE):
        env.pop(name, None)
    with dask_cluster(str(tmp_path_factory.mktemp("cluster")), workers=2, env=env) as cluster:
        yield cluster


def _launch(config: Path, cluster) -> subprocess.Popen:
    """``python -m jacobeam -q run CONFIG --runner DaskRunner --dask_client_address ...`` in its own
    process group; its output goes to files beside the config."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(config.with_suffix(".out"), "w") as out, open(config.with_suffix(".err"), "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "jacobeam", "-q", "run", str(config),
             "--runner", "DaskRunner", "--dask_client_address", cluster.address],
            cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True,
        )


def _finish(process: subprocess.Popen, config: Path, timeout: float = 600) -> str:
    """Wait for the launcher to exit 0; its standard output."""
    try:
        status = process.wait(timeout=timeout)
    finally:
        _kill_group(process)
    assert status == 0, config.with_suffix(".err").read_text()[-3000:]
    return config.with_suffix(".out").read_text()


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _shards(out: Path) -> list[str]:
    folder = out / "shards"
    return sorted(p.name for p in folder.glob("shard-*.h5")) if folder.exists() else []


def _wait_for_first_shard(out: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not _shards(out):
        assert process.poll() is None, "the run ended before its first shard was complete"
        assert time.monotonic() < deadline, "no shard within the timeout"
        time.sleep(0.02)


def _busy(cluster) -> tuple[int, int]:
    """Tasks the scheduler knows, and tasks running in a worker thread (a task whose result nobody
    wants any more runs on until it returns: Dask does not interrupt a thread)."""
    tasks = cluster.client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))
    running = cluster.client.run(lambda dask_worker: len(dask_worker.active_threads))
    return tasks, sum(running.values())


def _assert_same_aggregates(out: Path, clean: Path) -> None:
    with h5py.File(out / "aggregates.h5") as ours, h5py.File(clean / "aggregates.h5") as theirs:
        assert sorted(ours) == sorted(theirs) == ["count", "jtj", "mean", "mean_abs"]
        for name in theirs:
            np.testing.assert_array_equal(ours[name][()], theirs[name][()])


def test_a_run_on_dask_equals_the_in_process_run_bit_for_bit(reference, cluster):
    root, clean = reference
    out = root / "plain"
    config = _config(root, out)
    began = time.monotonic()

    summary = _finish(_launch(config, cluster), config)

    print(f"run on Dask: {time.monotonic() - began:.1f} s")
    assert_same_as(out, clean)
    _assert_same_aggregates(out, clean)
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert {line["file"].rsplit("/", 1)[-1] for line in rejected} == {"b.npy", "d.npy", "e.npy"}
    manifest = json.loads((out / "manifest.json").read_text())
    shards = manifest["shards"]
    assert len(shards) == SHARDS and all(s["computed_in_this_run"] for s in shards)
    workers = cluster.worker_pids()
    assert {s["worker_pid"] for s in shards} == workers and len(workers) == 2  # spread over both
    assert all(s["engine_builds"] == 1 for s in shards)  # once per worker process and run
    assert manifest["self_check"]["shards_checked"] == SHARDS and not manifest["self_check"]["mismatches"]
    # No Beam metrics on Dask: the summary counts from the manifest.
    assert f"samples={manifest['num_rows']}" in summary and f"shards_written={SHARDS}" in summary, summary


def test_a_second_run_on_the_same_workers_builds_its_engine_once_again(reference, cluster):
    root, clean = reference
    out = root / "again"
    config = _config(root, out)
    _finish(_launch(config, cluster), config)
    assert_same_as(out, clean)
    assert all(s["engine_builds"] == 1 for s in json.loads((out / "manifest.json").read_text())["shards"])


def test_a_worker_killed_mid_run_is_survived_with_identical_output(reference, cluster):
    """SIGKILL a worker once the first shard is complete: Dask runs its ranges again elsewhere (and
    the ranges whose records it held: those find their shard complete and keep it); the temporary
    file it may have left is never counted and is removed by the run's end."""
    root, clean = reference
    out = root / "worker-killed"
    config = _config(root, out)
    launcher = _launch(config, cluster)
    victim = cluster.workers[-1]
    try:
        _wait_for_first_shard(out, launcher)
        cluster.kill(victim)
        cluster.workers.remove(victim)
        cluster.start_worker()  # the module's later tests want two workers again
        _finish(launcher, config)
    finally:
        _kill_group(launcher)

    assert_same_as(out, clean)  # every shard once, no temporary file, the same bytes
    _assert_same_aggregates(out, clean)
    assert victim.pid not in {s.get("worker_pid") for s in json.loads((out / "manifest.json").read_text())["shards"]}


def test_a_killed_launcher_stops_the_cluster_working_on_its_run_and_the_rerun_resumes(reference, cluster):
    root, clean = reference
    out = root / "launcher-killed"
    config = _config(root, out)
    launcher = _launch(config, cluster)
    try:
        _wait_for_first_shard(out, launcher)
    finally:
        _kill_group(launcher)
    killed = time.monotonic()

    while _busy(cluster) != (0, 0):
        assert time.monotonic() - killed < STOP_WITHIN, f"still busy: {_busy(cluster)}"
        time.sleep(0.1)
    stopped = time.monotonic() - killed
    print(f"cluster idle {stopped:.2f} s after the launcher was killed")
    done = _shards(out)
    time.sleep(3 * PAUSE + 1)
    assert _shards(out) == done  # nothing more is written for the dead launcher
    assert 0 < len(done) < SHARDS and not (out / "manifest.json").exists()

    _finish(_launch(config, cluster), config)

    assert_same_as(out, clean)
    _assert_same_aggregates(out, clean)
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    assert sorted(s["file"].rsplit("/", 1)[-1] for s in shards if not s["computed_in_this_run"]) == done
