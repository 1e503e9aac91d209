"""Several worker processes (Beam's multi_processing mode): same results, setup once per process."""

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import config, runner
from jacobeam.transforms.engine.models import build_cnn
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_pipeline import write_inputs

REPO = Path(__file__).resolve().parent.parent
TWO_PROCESSES = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]


def _config(data, out):
    return config.validate(
        {
            "model": {"factory": "tests.models:small_cnn"},
            "input": {"paths": [str(data)]},
            "jacobian": {"batch_size": 4},
            "output": {"path": str(out), "samples_per_shard": 5},
        }
    )


@pytest.mark.slow
def test_two_worker_processes_give_identical_shards_and_build_the_engine_once_each(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # worker processes import tests.models as the factory
    samples = write_inputs(tmp_path / "data", (8, 8, 1))
    single = runner.run(_config(tmp_path / "data" / "*.npy", tmp_path / "one"), [], show_progress=False).manifest

    multi = runner.run(_config(tmp_path / "data" / "*.npy", tmp_path / "two"), TWO_PROCESSES, show_progress=False)

    shards = multi.manifest["shards"]
    assert len(shards) == 8
    assert [s["crc32c"] for s in shards] == [s["crc32c"] for s in single["shards"]]
    pids = {s["worker_pid"] for s in shards}
    assert os.getpid() not in pids and len(pids) == 2
    # Every shard was computed by a process that had built its engine exactly once: no per-bundle or
    # per-element setup, however many shards that process handled.
    assert all(s["engine_builds"] == 1 for s in shards)
    assert multi.metrics["shards_written"] == 8 and multi.metrics["samples"] == 40
    with h5py.File(tmp_path / "two" / "jacobians.h5") as view:
        assert_close(view["jacobian"][:], tape_loop(test_models.small_cnn(), samples), rtol=1e-5)


@pytest.mark.slow
def test_demo_command_from_a_fresh_folder(tmp_path):
    """``python -m jacobeam demo`` as a user runs it, then ``inspect`` on its output."""
    demo = subprocess.run(
        [sys.executable, "-m", "jacobeam", "demo", "--root", "demo", "--set", "output.samples_per_shard=1024"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "done: 2,048 samples" in demo.stdout
    assert "jacobians.h5" in demo.stdout
    with h5py.File(tmp_path / "demo" / "out" / "jacobians.h5") as view:
        assert view["jacobian"].shape == (2048, 10, 28, 28, 1)
        ids = np.array([0, 699, 700, 1199, 1200, 2047])  # both sides of each file boundary
        np.testing.assert_array_equal(view["sample_id"][ids], ids)
        parts = [np.load(p) for p in sorted((tmp_path / "demo" / "inputs").glob("*.npy"))]
        samples = np.concatenate(parts)[ids]
        assert_close(view["jacobian"][ids], tape_loop(build_cnn(), samples), rtol=1e-5)
    inspect = subprocess.run(
        [sys.executable, "-m", "jacobeam", "inspect", "demo/out"], cwd=tmp_path, capture_output=True, text=True
    )
    assert inspect.returncode == 0 and "complete" in inspect.stdout, inspect.stdout + inspect.stderr
