"""Beam's portable path, as on Flink, Spark and Dataflow: DoFns pickled and run in SDK worker processes
started by a worker pool, with the job service embedded in the launching process."""

import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import config, runner
from tests.services import beam_service
from tests.test_pipeline import write_inputs

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def worker_pool():
    """A worker pool on loopback; it starts workers as bare ``python``, so this project's Python
    comes first on PATH (a worker without Beam would hang the job without an error)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    with beam_service("apache_beam.runners.worker.worker_pool_main", "--service_port", env) as port:
        yield port


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_portable_runner_with_an_external_worker_pool_equals_the_in_process_runner(tmp_path, worker_pool):
    write_inputs(tmp_path / "data", (8, 8, 1))

    def job(out):
        return config.validate(
            {
                "model": {"factory": "tests.models:small_cnn"},
                "input": {"paths": [str(tmp_path / "data" / "*.npy")]},
                "jacobian": {"batch_size": 8, "threads": 1},  # a shard records its threads; compared byte for byte
                "output": {"path": str(tmp_path / out), "samples_per_shard": 16},
            }
        )

    local = runner.run(job("local"), [], show_progress=False).manifest
    portable_args = [
        "--runner=PortableRunner", "--job_endpoint=embed",
        "--environment_type=EXTERNAL", f"--environment_config=localhost:{worker_pool}",
    ]
    portable = runner.run(job("portable"), portable_args, show_progress=False).manifest

    assert [s["crc32c"] for s in portable["shards"]] == [s["crc32c"] for s in local["shards"]]
    assert all(s["worker_pid"] != os.getpid() for s in portable["shards"])
    with h5py.File(tmp_path / "portable" / "jacobians.h5") as a, h5py.File(tmp_path / "local" / "jacobians.h5") as b:
        np.testing.assert_array_equal(a["jacobian"][:], b["jacobian"][:])
