"""What a run shows while it runs: the time it reports covers start-up, engine set-up shows progress when
it is slow, and progress counts the rows of shards under way, batch by batch."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jacobeam.pipeline import config, runner
from tests import first_hour_models

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_reported_time_covers_start_up(tmp_path):
    """The model sleeps in its first construction, which ``jacobeam run`` does while planning (the model
    check), before the pipeline starts: the time reported must include it."""
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "x.npy", np.random.default_rng(0).normal(size=(8, 12)).astype(np.float32))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps({
        "model": {"factory": "tests.first_hour_models:slow_first_load"},
        "input": {"paths": [str(tmp_path / "data" / "x.npy")]},
        "output": {"path": str(tmp_path / "out")},
    }))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "jacobeam", "-q", "run", str(cfg)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lived = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("done:")]
    reported = float(re.search(r"shard\(s\), ([\d.]+) s", line).group(1))
    assert first_hour_models.SLEEP <= reported <= lived + 0.1, line
    pipeline = json.loads((tmp_path / "out" / "manifest.json").read_text())["run"]["wall_seconds"]
    assert f"pipeline {pipeline:.1f} s" in line  # the pipeline's own time is still shown


def _fake_config(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    np.save(data / "x.npy", np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32))
    return config.validate({
        "model": {"factory": "fake.model:closed_form"},  # never loaded: the engine factory stands in
        "input": {"paths": [str(data / "x.npy")]},
        "jacobian": {"self_check": {"samples": 0}},
        "output": {"path": str(tmp_path / "out")},
    })


def test_engine_set_up_shows_progress_when_it_is_slow(tmp_path, capsys):
    from jacobeam.transforms.testing.fake_engine import FakeEngineFactory

    runner.run(_fake_config(tmp_path), [], show_progress=True, engine_factory=first_hour_models.SlowFakeEngineFactory(sleep=3.5))
    shown = capsys.readouterr().err.splitlines()
    assert "jacobeam: setting up the engine (loading model, choosing how to differentiate)..." in shown
    assert any(re.fullmatch(r"jacobeam: engine ready after \d+\.\d s", line) for line in shown), shown

    shutil.rmtree(tmp_path / "out")
    runner.run(_fake_config(tmp_path), [], show_progress=True, engine_factory=FakeEngineFactory())
    assert "setting up the engine" not in capsys.readouterr().err  # a quick set-up says nothing


def test_progress_counts_the_rows_of_shards_under_way_batch_by_batch(tmp_path):
    """Between two complete shards, an in-process run's progress moves with each batch written."""
    import io

    from jacobeam.pipeline.progress import ShardProgress
    from jacobeam.transforms.elements import JacobianBatch
    from jacobeam.transforms.metrics import ShardMetrics, rows_in_progress
    from jacobeam.transforms.spec import ModelSource, ShardRange
    from jacobeam.transforms.write import ShardOutput
    from jacobeam.transforms.write_shards import pipeline_spec

    spec = pipeline_spec(str(tmp_path / "out"), ModelSource(factory="tests.models:small_mlp"), (5,),
                         samples_per_shard=16)
    spec = dataclasses.replace(spec, open_ended=False, files=(dataclasses.replace(spec.files[0], num_samples=32),))
    progress = ShardProgress(spec, 0, stream=io.StringIO())
    shard = ShardRange(0, 16)
    with ShardOutput(spec, shard, ShardMetrics()) as output:
        for start in (0, 8):
            ids = np.arange(start, start + 8)
            output.add(JacobianBatch(ids=ids, datasets={"jacobian": np.zeros((8, 3, 5), np.float32),
                                                        "output": np.zeros((8, 3), np.float32)}, shard=shard))
            assert progress.done() == start + 8  # the shard is not complete: its rows so far count
        output.commit()
    assert rows_in_progress() == {} and progress.done() == 16  # complete: counted once, by its file
