"""Paths in the plan: a glob without a folder part works, every local path is absolute, and a folder
written before paths were absolute (relative to the working directory) is still resumed.

Runs use the fake engine (``transforms.testing.fake_engine``): the point here is planning, not
differentiation.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing import test_pipeline

from jacobeam.pipeline import config, plan, runner
from jacobeam.transforms.output.inputs_table import folder_inputs
from jacobeam.transforms.output.layout import MANIFEST, SHARDS_DIR
from jacobeam.transforms.output.storage import crc32c
from jacobeam.transforms.testing.fake_engine import FakeEngineFactory

FACTORY = FakeEngineFactory(outputs=2, seed=3, max_batch=8)


def _config(paths: list[str], out: str):
    return config.validate(
        {
            "model": {"factory": "fake.model:closed_form"},  # never loaded: the fake engine stands in
            "input": {"paths": paths},
            "jacobian": {"batch_size": 8, "self_check": {"samples": 0}},
            "output": {"path": out, "samples_per_shard": 10},
        }
    )


def _write(folder: Path, sizes: dict[str, int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for name, size in sizes.items():
        np.save(folder / name, rng.normal(size=(size, 3)).astype(np.float32))


@pytest.mark.parametrize("pattern", ["*.npy", "digits-*.npy", "./digits-*.npy", "digits-1.npy"])
def test_a_glob_without_a_folder_part_matches_in_the_working_directory(tmp_path, monkeypatch, pattern):
    _write(tmp_path, {"digits-1.npy": 4, "digits-2.npy": 3})
    monkeypatch.chdir(tmp_path)
    spec = plan.make_job(_config([pattern], "out"), check_model=False, identify_model=False).spec
    expected = ["digits-1.npy"] if pattern == "digits-1.npy" else ["digits-1.npy", "digits-2.npy"]
    assert [f.path for f in spec.files] == [str(tmp_path / name) for name in expected]


def test_a_glob_that_matches_nothing_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match=rf"input.paths: '\*.npy' matches no files \(looked for {tmp_path}/\*.npy\)"):
        plan.make_job(_config(["*.npy"], "out"), check_model=False, identify_model=False)


def test_every_local_path_in_the_plan_is_absolute(tmp_path, monkeypatch):
    _write(tmp_path / "data", {"a.npy": 5, "b.npy": 6})
    monkeypatch.chdir(tmp_path)
    spec = plan.make_job(_config(["data/*.npy"], "out/run"), check_model=False, identify_model=False).spec
    assert [f.path for f in spec.files] == [str(tmp_path / "data" / "a.npy"), str(tmp_path / "data" / "b.npy")]
    assert spec.output_dir == str(tmp_path / "out" / "run")


def _run(cfg) -> dict:
    pipeline = test_pipeline.TestPipeline(runner=FnApiRunner())
    return runner.run(cfg, [], show_progress=False, pipeline=pipeline, engine_factory=FACTORY).manifest


def test_a_folder_written_with_relative_paths_is_resumed_not_refused(tmp_path, monkeypatch):
    """Folders written before this change list input paths relative to the working directory (in the
    manifest and in each shard's ``inputs`` attribute): a rerun from the same directory keeps every
    shard, and the rewritten manifest lists absolute paths."""
    _write(tmp_path / "data", {"a.npy": 12, "b.npy": 9})
    monkeypatch.chdir(tmp_path)
    cfg = _config(["data/*.npy"], "out")
    first = _run(cfg)
    assert first["num_samples"] == 21 and all(Path(e["path"]).is_absolute() for e in folder_inputs(first["output_dir"]))

    # Make the folder what an older jacobeam wrote: relative paths.
    manifest_path = tmp_path / "out" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["inputs"] = [{**entry, "path": str(Path(entry["path"]).relative_to(tmp_path))}
                          for entry in folder_inputs(tmp_path / "out")]
    del manifest["input_files"]  # and the files listed in the manifest itself, before inputs.h5
    (tmp_path / "out" / "inputs.h5").unlink()
    manifest_path.write_text(json.dumps(manifest))
    before = {}
    for shard in sorted((tmp_path / "out" / SHARDS_DIR).glob("shard-*.h5")):
        with h5py.File(shard, "a") as h5:
            inputs = json.loads(h5.attrs["inputs"])
            h5.attrs["inputs"] = json.dumps([[str(Path(p).relative_to(tmp_path)), *rest] for p, *rest in inputs])
            before[shard.name] = h5["jacobian"][:]
    for entry in manifest["shards"]:  # the checksums of the shards as that jacobeam wrote them
        entry["crc32c"] = crc32c(tmp_path / "out" / entry["file"])
    manifest_path.write_text(json.dumps(manifest))

    job = plan.make_job(cfg, check_model=False, identify_model=False)
    assert job.already_done == 21 and job.remove == []
    again = _run(cfg)
    assert [e["path"] for e in folder_inputs(tmp_path / "out")] == [str(tmp_path / "data" / n) for n in ("a.npy", "b.npy")]
    assert again["run"]["samples_computed"] == 0 and again["run"]["samples_kept"] == 21
    for name, jacobian in before.items():
        with h5py.File(tmp_path / "out" / SHARDS_DIR / name) as h5:
            np.testing.assert_array_equal(h5["jacobian"][:], jacobian)
