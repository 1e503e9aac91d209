"""End to end: files in, the Beam pipeline (in-process runner), HDF5 shards and jacobians.h5 out."""

import json
import os
import re
from pathlib import Path

import google_crc32c
import h5py
import ml_dtypes
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.transforms.output.inputs_table import folder_inputs
from tests import models as test_models
from tests.reference import assert_close, tape_loop

FILE_SIZES = {"b": 13, "a": 7, "c": 20}  # written out of order: ids follow sorted path order


def write_inputs(folder: Path, sample_shape, suffix=".npy", key="x", seed=0):
    """Files of unequal length; returns the samples in id order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, size in FILE_SIZES.items():
        array = rng.normal(size=(size, *sample_shape)).astype(np.float32)
        path = folder / f"{name}{suffix}"
        if suffix == ".npy":
            np.save(path, array)
        elif suffix == ".npz":
            np.savez(path, **{key: array})
        else:
            with h5py.File(path, "w") as h5:
                h5[key] = array
        arrays[name] = array
    return np.concatenate([arrays[name] for name in sorted(arrays)])


def job_config(data: str, out: Path, factory="tests.models:small_cnn", key=None, compression="none"):
    return config.validate(
        {
            "model": {"factory": factory},
            "input": {"paths": [data], "key": key},
            # One TensorFlow thread per process, however many processes: a shard records its threads, and
            # runs compared byte for byte (local and remote, one process and several) must agree on them.
            "jacobian": {"batch_size": 8, "threads": 1},
            "output": {"path": str(out), "samples_per_shard": 16, "compression": compression},
        }
    )


def run(cfg, beam_args=()):
    return runner.run(cfg, list(beam_args), show_progress=False).manifest


def folder_state(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    """One complete run of the small CNN over three .npy files; tests below must not modify it."""
    root = tmp_path_factory.mktemp("cnn")
    samples = write_inputs(root / "data", (8, 8, 1))
    manifest = run(job_config(str(root / "data" / "*.npy"), root / "out"))
    return root, samples, manifest


@pytest.mark.parametrize(
    "suffix, key, factory, compression",
    [(".npy", None, "small_cnn", "none"), (".npz", "x", "grid_model", "gzip"), (".h5", "x", "small_mlp", "lzf")],
)
def test_end_to_end_per_format(tmp_path, suffix, key, factory, compression):
    build = getattr(test_models, factory)
    model = build()
    samples = write_inputs(tmp_path / "data", model.input_shape[1:], suffix=suffix)

    data = str(tmp_path / "data" / f"*{suffix}")
    manifest = run(job_config(data, tmp_path / "out", f"tests.models:{factory}", key, compression))

    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], np.arange(40))
        assert_close(view["output"][:], model(samples).numpy(), rtol=1e-6)
        assert_close(view["jacobian"][:], tape_loop(model, samples), rtol=1e-5)
    assert [(f["path"].rsplit("/", 1)[1], f["first_id"], f["stop_id"]) for f in folder_inputs(manifest["output_dir"])] == [
        (f"a{suffix}", 0, 7), (f"b{suffix}", 7, 20), (f"c{suffix}", 20, 40)
    ]
    assert [(s["start"], s["stop"]) for s in manifest["shards"]] == [(0, 16), (16, 32), (32, 40)]
    with h5py.File(tmp_path / "out" / manifest["shards"][0]["file"]) as shard:
        assert shard["jacobian"].compression == (None if compression == "none" else compression)


def test_shards_layout_and_manifest(cnn_run):
    root, samples, manifest = cnn_run
    out = root / "out"
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "shard-000000000000-000000000016.h5", "shard-000000000016-000000000032.h5", "shard-000000000032-000000000040.h5"
    ]
    with h5py.File(out / "shards" / "shard-000000000016-000000000032.h5") as shard:
        assert shard["jacobian"].shape == (16, 3, 8, 8, 1)
        assert shard["output"].shape == (16, 3)
        assert shard["sample_id"].dtype == np.int64
        np.testing.assert_array_equal(shard["sample_id"][:], np.arange(16, 32))
        assert shard["jacobian"].chunks[0] >= 1 and shard["jacobian"].chunks[1:] == (3, 8, 8, 1)
        assert tuple(shard.attrs["input_shape"]) == (8, 8, 1) and tuple(shard.attrs["output_shape"]) == (3,)
        assert shard.attrs["model_fingerprint"] == manifest["model_fingerprint"]
        assert shard.attrs["jacobeam_version"] == manifest["jacobeam_version"]
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    for shard in manifest["shards"]:
        assert shard["crc32c"] == f"{google_crc32c.value((out / shard['file']).read_bytes()):08x}"
        assert "sha256" not in shard
    assert manifest["config"]["model"] == {"factory": "tests.models:small_cnn", "path": None, "builtin": None, "logits": False}
    assert manifest["num_samples"] == 40 and manifest["run"]["samples_computed"] == 40
    assert set(manifest["versions"]) >= {"tensorflow", "apache_beam", "h5py", "numpy", "python", "jacobeam"}


def test_engine_settings_reach_shards_and_manifest(cnn_run, tmp_path):
    root, samples, _ = cnn_run
    cfg = job_config(str(root / "data" / "*.npy"), tmp_path / "out").model_dump(mode="json")
    cfg["jacobian"].update(mode="forward", compute_dtype="float64", store_dtype="bfloat16", memory_budget="40KiB")
    manifest = run(config.validate(cfg))

    engine = manifest["engine"]
    assert (engine["mode"], engine["compute_dtype"], engine["store_dtype"]) == ("forward", "float64", "bfloat16")
    assert engine["block_rows"]["x"] < 64 and engine["retraces_after_setup"] == 0
    assert manifest["dtype"] == "bfloat16"
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        stored = view["jacobian"][:]  # bfloat16 on disk, read back as float32
        expected = tape_loop(test_models.small_cnn(), samples)
        eps = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
        np.testing.assert_allclose(stored, expected, rtol=eps, atol=eps * np.abs(expected).max())
    with h5py.File(tmp_path / "out" / manifest["shards"][0]["file"]) as shard:
        assert shard["jacobian"].id.get_type().get_size() == 2


def test_view_reads_from_a_moved_folder(cnn_run, tmp_path, monkeypatch):
    root, samples, _ = cnn_run
    moved = tmp_path / "moved"
    os.system(f"cp -r {root / 'out'} {moved}")
    monkeypatch.chdir("/")
    with h5py.File(moved / "jacobians.h5") as view:
        assert_close(view["jacobian"][:], tape_loop(test_models.small_cnn(), samples), rtol=1e-5)


def test_resume_after_interruption_equals_a_clean_run(cnn_run, tmp_path):
    root, _, clean = cnn_run
    data = str(root / "data" / "*.npy")
    out = tmp_path / "out"
    run(job_config(data, out))
    # What an interrupted run leaves: some shards missing, a killed writer's temp file, no manifest.
    (out / "shards" / "shard-000000000016-000000000032.h5").unlink()
    (out / "shards" / ".shard-000000000016-000000000032.h5.tmp-0123456789ab").write_bytes(b"half a shard")
    (out / "manifest.json").unlink()
    (out / "jacobians.h5").unlink()

    resumed = run(job_config(data, out))

    assert [s["crc32c"] for s in resumed["shards"]] == [s["crc32c"] for s in clean["shards"]]
    assert [s["computed_in_this_run"] for s in resumed["shards"]] == [False, True, False]
    assert resumed["run"]["samples_computed"] == 16
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted(s["file"][7:] for s in clean["shards"])
    with h5py.File(out / "jacobians.h5") as a, h5py.File(root / "out" / "jacobians.h5") as b:
        for name in ("jacobian", "output", "sample_id"):
            np.testing.assert_array_equal(a[name][:], b[name][:])


def test_rerun_of_a_complete_folder_computes_nothing(cnn_run, tmp_path):
    root, _, clean = cnn_run
    out = tmp_path / "out"
    os.system(f"cp -r {root / 'out'} {out}")
    again = run(job_config(str(root / "data" / "*.npy"), out))
    assert again["run"]["samples_computed"] == 0
    assert [s["crc32c"] for s in again["shards"]] == [s["crc32c"] for s in clean["shards"]]


def _bad_run_cases(root: Path):
    odd = root / "odd"
    odd.mkdir(exist_ok=True)
    np.save(odd / "a.npy", np.zeros((3, 8, 8, 1), np.float32))
    np.save(odd / "b.npy", np.zeros((3, 8, 9, 1), np.float32))
    ints = root / "ints"
    ints.mkdir(exist_ok=True)
    np.save(ints / "a.npy", np.zeros((3, 8, 8, 1), np.int64))
    (root / "empty").mkdir(exist_ok=True)
    return {
        "missing glob": ([f"input.paths=['{root}/nowhere/*.npy']"], r"nowhere/\*.npy' matches no files"),
        "empty glob": ([f"input.paths=['{root}/empty/*.npy']"], r"empty/\*.npy' matches no files"),
        "shape differs": ([f"input.paths=['{odd}/*.npy']"], r"b.npy: samples of shape \(8, 9, 1\); expected \(8, 8, 1\)"),
        "non-float": ([f"input.paths=['{ints}/*.npy']"], r"a.npy: dtype int64; expected a float array"),
        "missing model": (["model={path: /no/such/model.keras}"], r"model.path /no/such/model.keras: no such file"),
        "unknown key": (["jacobian.batchsize=4"], r"jacobian.batchsize: unknown key"),
        "other run": (["jacobian.jit_compile=true"], r"shard-000000000000-000000000016.h5: written by a different run"),
    }


@pytest.mark.parametrize(
    "case", ["missing glob", "empty glob", "shape differs", "non-float", "missing model", "unknown key", "other run"]
)
def test_bad_input_is_a_clear_error_and_leaves_output_as_it_was(cnn_run, case, tmp_path, capsys):
    root, _, _ = cnn_run
    out = tmp_path / "out"
    os.system(f"cp -a {root / 'out'} {out}")
    (out / "manifest.json").unlink()  # an unfinished folder must be left alone too
    before = folder_state(out)
    overrides, message = _bad_run_cases(tmp_path)[case]
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text(json.dumps(job_config(str(root / "data" / "*.npy"), out).model_dump(mode="json")))

    status = cli.main(["-q", "run", str(cfg_file), *[arg for o in overrides for arg in ("--set", o)]])

    assert status == (cli.USAGE if case == "unknown key" else cli.FAILED)
    err = capsys.readouterr().err
    assert err.startswith("jacobeam: error:"), err
    assert re.search(message, err), err
    assert folder_state(out) == before


def test_inspect_reports_complete_and_missing_sources(cnn_run, tmp_path, capsys):
    root, _, _ = cnn_run
    assert cli.main(["inspect", str(root / "out")]) == 0
    shown = capsys.readouterr().out
    engine = json.loads((root / "out" / "manifest.json").read_text())["engine"]
    assert "complete" in shown and f"engine      {engine['mode']}, batch {engine['batch_size']}" in shown
    broken = tmp_path / "broken"
    os.system(f"cp -r {root / 'out'} {broken}")
    (broken / "shards" / "shard-000000000016-000000000032.h5").unlink()
    assert cli.main(["inspect", "--json", str(broken)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["complete"]
    assert any("jacobians.h5:jacobian reads from shards/shard-000000000016-000000000032.h5, which is missing" in p
               for p in report["problems"])
    (broken / "manifest.json").unlink()
    assert cli.main(["inspect", str(broken)]) == 1
    assert "no manifest.json: the run did not finish" in capsys.readouterr().out


def test_rows_with_a_sample_shape_the_model_rejects(tmp_path):
    write_inputs(tmp_path / "data", (7,))
    expected = r"factory:tests.models:small_cnn expects samples of shape \(8, 8, 1\); the inputs hold samples of shape \(7,\)"
    with pytest.raises(Exception, match=expected):
        run(job_config(str(tmp_path / "data" / "*.npy"), tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("folder", ["cnn", "grid"])
def test_inspect_plot_draws_a_png_of_the_promised_size(cnn_run, tmp_path, folder, capsys):
    from PIL import Image

    root, _, _ = cnn_run
    out = root / "out"
    if folder == "grid":
        write_inputs(tmp_path / "data", (4, 3))
        run(job_config(str(tmp_path / "data" / "*.npy"), tmp_path / "out", "tests.models:grid_model"))
        out = tmp_path / "out"
    picture = tmp_path / "plot.png"
    assert cli.main(["inspect", str(out), "--plot", str(picture), "--samples", "0,7,39"]) == 0
    with Image.open(picture) as image:
        assert image.format == "PNG"
        assert image.size[0] == 640 and image.size[1] >= 3 * 3 * 80  # three sample rows and the histogram
    assert cli.main(["inspect", str(out), "--plot", str(picture), "--samples", "40"]) == cli.USAGE  # not 1: incomplete
    assert "--samples [40]: ids run from 0 to 39" in capsys.readouterr().err
