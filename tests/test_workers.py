"""Several worker processes (Beam's multi_processing mode): same results, setup once per process."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from jacobeam.pipeline import checks, config, runner
from jacobeam.transforms.engine.models import build_cnn
from jacobeam.transforms.spec import ShardRange
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_pipeline import write_inputs

REPO = Path(__file__).resolve().parent.parent
TWO_PROCESSES = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]


def _config(data, out, threads="auto"):
    return config.validate(
        {
            "model": {"factory": "tests.models:small_cnn"},
            "input": {"paths": [str(data)]},
            "jacobian": {"batch_size": 4, "threads": threads},
            "output": {"path": str(out), "samples_per_shard": 5},
        }
    )


def rescaled_cnn():
    """small_cnn with its weights scaled by ``$JACOBEAM_TEST_WEIGHT_SCALE`` in every process that builds it,
    worker processes included (``pid``: by a number of the process's own, as an unseeded initializer
    would): the same factory name, other weights."""
    model = test_models.small_cnn()
    scale = os.environ.get("JACOBEAM_TEST_WEIGHT_SCALE", "1")
    factor = 1 + os.getpid() / 1e6 if scale == "pid" else float(scale)
    model.set_weights([w * factor for w in model.get_weights()])
    return model


def _never_in_the_launcher(*args, **kwargs):
    raise AssertionError("the launcher loaded the model that its worker processes load")


@pytest.mark.parametrize(
    "beam_args, processes",
    [
        ([], 1),
        (["--direct_running_mode", "multi_threading"], 1),
        (TWO_PROCESSES, 2),
        (["--direct_running_mode", "multi_processing"], 1),  # Beam's default: one worker process
        (["--direct_running_mode=multi_processing", "--direct_num_workers=0"], 4),  # 0: one per core
    ],
)
def test_tensorflow_threads_are_the_cores_split_between_worker_processes(tmp_path, monkeypatch, beam_args, processes):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    options = PipelineOptions(beam_args)
    cfg = _config(tmp_path / "*.npy", tmp_path / "out")
    assert runner.local_worker_processes(options) == processes
    assert runner.tf_threads(cfg, options) == 4 // processes
    assert runner.engine_in_workers(options) == any("multi_processing" in arg for arg in beam_args)
    threads = config.validate({**config.to_dict(cfg), "jacobian": {"threads": 3}})
    assert runner.tf_threads(threads, options) == 3  # the config's number, however many processes


@pytest.mark.parametrize(
    "sizes, processes, runs",
    [
        ([4096, 4096, 4096, 4096, 3616], 2, [2, 3]),  # 20,000 samples: 8,192 and 11,808, not 12,288 and 7,712
        ([5] * 8, 2, [4, 4]),
        ([5] * 5, 4, [1, 1, 2, 1]),  # every process gets a run
        ([5] * 3, 4, [1, 1, 1]),
        ([16, 16, 16, 4], None, [1, 1, 1, 1]),  # a runner that spreads single ranges
    ],
)
def test_each_worker_process_gets_one_run_of_consecutive_shards_of_about_equal_samples(sizes, processes, runs):
    starts = np.cumsum([0, *sizes])
    ranges = [ShardRange(int(start), int(stop)) for start, stop in zip(starts, starts[1:])]
    items = runner.work_items(SimpleNamespace(ranges=lambda: ranges), processes)
    if processes is None:
        assert items == ranges
        return
    assert [len(item) for item in items] == runs
    assert [r for item in items for r in item] == ranges  # each range once, in order


@pytest.mark.slow
def test_two_worker_processes_give_identical_shards_and_build_the_engine_once_each(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # worker processes import tests.models as the factory
    samples = write_inputs(tmp_path / "data", (8, 8, 1))
    # One thread in every process, however many there are: a shard records its threads.
    single = runner.run(_config(tmp_path / "data" / "*.npy", tmp_path / "one", 1), [], show_progress=False).manifest

    monkeypatch.setattr(checks, "check_model", _never_in_the_launcher)
    multi = runner.run(_config(tmp_path / "data" / "*.npy", tmp_path / "two", 1), TWO_PROCESSES, show_progress=False)

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
    assert multi.manifest["model_fingerprint"] == single["model_fingerprint"]  # the workers' engine's


def _rescaled_config(tmp_path):
    raw = config.to_dict(_config(tmp_path / "data" / "*.npy", tmp_path / "out"))
    return config.validate({**raw, "model": {"factory": f"{__name__}:rescaled_cnn"}})


@pytest.mark.slow
def test_worker_processes_resuming_a_folder_of_other_weights_write_no_shard_beside_it(tmp_path, monkeypatch):
    """The launcher compares the model by its identity, that of the model the factory builds in the
    launcher's process (here the weights the kept shards recorded); worker processes that load other
    weights than those refuse before writing a shard beside them."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # worker processes import this module's factory
    monkeypatch.setenv("JACOBEAM_TEST_WEIGHT_SCALE", "pid")  # this process's weights, the workers' their own
    write_inputs(tmp_path / "data", (8, 8, 1))
    cfg = _rescaled_config(tmp_path)
    runner.run(cfg, [], show_progress=False)  # in this process
    (tmp_path / "out" / "manifest.json").unlink()  # the folder of an interrupted run: shards only
    kept = {p.name: p.read_bytes() for p in (tmp_path / "out" / "shards").glob("*.h5")}

    np.save(tmp_path / "data" / "z.npy", np.zeros((3, 8, 8, 1), np.float32))  # something to compute
    with pytest.raises(Exception, match=r"model weights changed since the run was planned"):
        runner.run(cfg, TWO_PROCESSES, show_progress=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out" / "shards").glob("*.h5")} == kept


@pytest.mark.slow
def test_worker_processes_that_load_other_weights_leave_no_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("JACOBEAM_TEST_WEIGHT_SCALE", "pid")  # each worker process its own weights
    write_inputs(tmp_path / "data", (8, 8, 1))
    # Each worker process's model is another than the launcher's (the identity it was planned with): the
    # first refuses before writing; Finalize's check of the shards' weights is the last line behind it.
    with pytest.raises(Exception, match=r"the model changed since the run was planned|computed with 2 different model weights"):
        runner.run(_rescaled_config(tmp_path), TWO_PROCESSES, show_progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


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


def test_worker_processes_that_cannot_all_help_are_named(tmp_path, caplog):
    """Two worker processes ran slower than one here without a word: fewer shards to compute than
    processes, or more threads than cores, are said in one line each."""
    import dataclasses

    from jacobeam.transforms.spec import ModelSource
    from jacobeam.transforms.write_shards import pipeline_spec

    spec = pipeline_spec(str(tmp_path / "out"), ModelSource(factory="tests.models:small_mlp"), (5,), samples_per_shard=4096)
    spec = dataclasses.replace(spec, open_ended=False, files=(dataclasses.replace(spec.files[0], num_samples=1000),),
                               tf_threads=os.cpu_count() or 1)
    options = PipelineOptions(["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    runner._warn_idle_workers(spec, options)
    assert "1 shard(s) to compute for 2 worker processes: 1 will idle" in caplog.text
    assert f"2 worker processes x {os.cpu_count() or 1} TensorFlow threads (jacobian.threads) on" in caplog.text

    caplog.clear()
    runner._warn_idle_workers(dataclasses.replace(spec, tf_threads=1), PipelineOptions([]))  # one process
    assert caplog.text == ""
