"""Input files that changed since an output folder was computed (issue 36): a stale shard stays until its
replacement is committed, a file whose stamp changed but whose samples did not keeps its shards, paths
are compared resolved (other spellings, a folder copied with its inputs), and rows appended to a file are
computed alone. Each case checks which shards were kept (``computed_in_this_run``, inodes) and the stored
Jacobians against a per-sample ``tf.GradientTape`` reference."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.inspect_output import inspect
from jacobeam.pipeline.verify import verify
from jacobeam.transforms import job
from jacobeam.transforms.output.inputs_table import folder_inputs
from jacobeam.transforms.output.storage import crc32c
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.services import jacobeam_process

SIZES = {"a": 7, "b": 13, "c": 12}  # 32 samples; shards of 8: b (ids 7..20) feeds ids 0..8, 8..16, 16..24


def _cfg(data: str, out: str, model: dict | None = None, policy: str = "error", key: str | None = None) -> dict:
    return {
        "model": model or {"factory": "tests.models:small_mlp"},
        "input": {"paths": [data], "on_bad_sample": policy, **({"key": key} if key else {})},
        "jacobian": {"batch_size": 4},
        "output": {"path": out, "samples_per_shard": 8},
    }


def _run(cfg: dict) -> dict:
    return runner.run(config.validate(cfg), [], show_progress=False).manifest


def _save(path: Path, x: np.ndarray, key: str = "x") -> None:
    """``x`` as the file ``path`` (.npy, .npz or .h5, the array ``key`` in the last two), its time of the
    last change a second later than before (a coarse clock still tells)."""
    before = path.stat().st_mtime_ns if path.exists() else None
    if path.suffix == ".npy":
        np.save(path, x)
    elif path.suffix == ".npz":
        np.savez(path, **{key: x})
    else:
        with h5py.File(path, "w") as h5:
            h5[key] = x
    if before is not None:
        os.utime(path, ns=(before, before + 10**9))


def _write(data: Path, suffix: str = ".npy", seed: int = 0) -> dict[str, np.ndarray]:
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {name: rng.normal(size=(size, 12)).astype(np.float32) for name, size in SIZES.items()}
    for name, x in arrays.items():
        _save(data / f"{name}{suffix}", x)
    return arrays


def _view(out: Path) -> dict[str, np.ndarray]:
    with h5py.File(out / "jacobians.h5") as view:
        return {name: view[name][:] for name in view}


def _inodes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in sorted((out / "shards").iterdir())}


def _reference(samples: np.ndarray) -> np.ndarray:
    return tape_loop(test_models.small_mlp(), samples)


def _computed(manifest: dict) -> list[bool]:
    return [shard["computed_in_this_run"] for shard in manifest["shards"]]


# --- replace after commit ---------------------------------------------------------------------------------


def test_a_rerun_that_fails_after_an_input_changed_keeps_the_old_result_readable_and_inspect_names_the_stale_shards(
    tmp_path, capsys
):
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data)
    cfg = _cfg(str(data / "*.npy"), str(out))
    _run(cfg)
    manifest_text, before = (out / "manifest.json").read_text(), _view(out)

    # b's rows 0 (id 7, shard 0..8), 3 (id 10, shard 8..16) and 10 (id 17, shard 16..24) change; in the
    # first rewrite row 10 is NaN.
    b = arrays["b"].copy()
    b[0] += 1.0
    b[3] -= 1.0
    b[10] += 0.5
    bad = b.copy()
    bad[10, 4] = np.nan
    _save(data / "b.npy", bad)
    with pytest.raises(Exception, match=r"b.npy: row 10: non-finite input: holds NaN"):
        _run(cfg)

    # The last complete result stays whole: its manifest, every shard it names, a view without a gap.
    assert (out / "manifest.json").read_text() == manifest_text
    manifest = json.loads(manifest_text)
    assert all((out / shard["file"]).exists() for shard in manifest["shards"])
    view = _view(out)
    assert np.isfinite(view["jacobian"]).all() and not view["nonfinite"].any()
    np.testing.assert_array_equal(view["sample_id"], np.arange(32))
    assert (np.abs(view["jacobian"]).reshape(32, -1).max(axis=1) > 0).all()  # no row reads zeros
    # The stale shard of the bad sample was not replaced: its rows read the old values; the shards before
    # it were replaced, each in one rename, by those of the new samples.
    np.testing.assert_array_equal(view["jacobian"][16:], before["jacobian"][16:])
    new = np.concatenate([arrays["a"], b, arrays["c"]])
    assert_close(view["jacobian"][:16], _reference(new[:16]))
    assert not np.allclose(view["jacobian"][:16], before["jacobian"][:16])

    report = inspect(str(out))
    assert report.ok and report.stale == ["shards/shard-000000000016-000000000024.h5"]
    assert cli.main(["inspect", str(out)]) == 0
    assert ("stale       1 shard(s) computed from input files changed since (another stamp): "
            "shards/shard-000000000016-000000000024.h5;") in capsys.readouterr().out

    # Fixed: only the stale shard is computed (the replaced ones hold b's rows as they are now).
    _save(data / "b.npy", b)
    inodes = _inodes(out)
    fixed = _run(cfg)
    assert _computed(fixed) == [False, False, True, False] and fixed["run"]["samples_computed"] == 8
    assert {k: v for k, v in _inodes(out).items() if "000016-" not in k} == {
        k: v for k, v in inodes.items() if "000016-" not in k}
    assert_close(_view(out)["jacobian"], _reference(new))
    assert verify(out, samples=4).ok
    assert inspect(str(out)).stale == []


def test_a_run_killed_while_it_replaces_a_stale_shard_leaves_the_old_one_and_the_rerun_completes(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data)
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(_cfg(str(data / "*.npy"), str(out))))
    assert cli.main(["-q", "run", str(path)]) == 0
    manifest_text, before = (out / "manifest.json").read_text(), _view(out)
    c = arrays["c"][::-1].copy()  # ids 20..32: shards 16..24 and 24..32
    _save(data / "c.npy", c)

    # Killed with the first new shard complete under its temporary name, not yet renamed over the old one.
    status, _ = jacobeam_process(["-q", "run", str(path)], tmp_path / "killed.stderr", kill_at="shard_commit")
    assert status == -9
    assert (out / "manifest.json").read_text() == manifest_text
    for name, values in _view(out).items():
        np.testing.assert_array_equal(values, before[name])
    assert inspect(str(out)).stale == ["shards/shard-000000000016-000000000024.h5",
                                      "shards/shard-000000000024-000000000032.h5"]

    assert cli.main(["-q", "run", str(path)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert _computed(manifest) == [False, False, True, True]
    assert_close(_view(out)["jacobian"], _reference(np.concatenate([arrays["a"], arrays["b"], c])))
    assert verify(out, samples=4).ok and not any(p.name.startswith(".") for p in (out / "shards").iterdir())


# --- files identified by content, paths compared resolved ------------------------------------------------


def test_data_copied_removed_and_moved_back_is_read_once_and_recomputes_nothing(tmp_path, monkeypatch):
    """``cp -r data data.copy && rm -r data && mv data.copy data``: every stamp changed, no sample did. The
    rerun reads each stale shard's samples once, keeps every shard, and records the new stamps: the run
    after it reads nothing."""
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data)
    cfg = _cfg(str(data / "*.npy"), str(out))
    first = _run(cfg)
    first_stamps = [e["stamp"] for e in folder_inputs(out)]
    inodes = _inodes(out)
    subprocess.run("cp -r data data.copy && rm -r data && mv data.copy data", shell=True, cwd=tmp_path, check=True)
    read, checked_slices = [], job.checked_slices

    def counted(files, start, stop, *args, **kwargs):
        read.append((start, stop))
        return checked_slices(files, start, stop, *args, **kwargs)

    monkeypatch.setattr(job, "checked_slices", counted)

    again = _run(cfg)
    assert again["run"]["samples_computed"] == 0 and _computed(again) == [False] * 4
    assert sorted(read) == [(0, 8), (8, 16), (16, 24), (24, 32)]  # once each
    assert _inodes(out) == inodes
    assert [s["crc32c"] for s in again["shards"]] == [s["crc32c"] for s in first["shards"]]
    assert [e["stamp"] for e in folder_inputs(again["output_dir"])] != first_stamps
    assert inspect(str(out)).stale == []

    read.clear()
    assert _run(cfg)["run"]["samples_computed"] == 0 and read == []  # the stamps the manifest records
    assert_close(_view(out)["jacobian"], _reference(np.concatenate([arrays[n] for n in SIZES])))
    assert verify(out, samples=2).ok


def test_the_model_and_inputs_spelled_relative_with_dot_or_absolute_are_one_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arrays = _write(tmp_path / "data")
    test_models.small_mlp().save(tmp_path / "m.keras")
    first = _run(_cfg("data/*.npy", "out", {"path": "m.keras"}))
    inodes = _inodes(tmp_path / "out")
    for model, data, out in (("./m.keras", "./data/*.npy", "./out"), (str(tmp_path / "m.keras"), str(tmp_path / "data/*.npy"),
                                                                        str(tmp_path / "out"))):
        again = _run(_cfg(data, out, {"path": model}))
        assert again["run"]["samples_computed"] == 0 and again["run_key"] == first["run_key"], model
    assert _inodes(tmp_path / "out") == inodes
    assert_close(_view(tmp_path / "out")["jacobian"], _reference(np.concatenate([arrays[n] for n in SIZES])))


def test_a_folder_whose_identity_spelled_the_model_path_keeps_its_run_key(tmp_path, monkeypatch):
    """A folder written by a jacobeam that kept ``model.path`` as written in the run identity (and hashed it
    into the run key): the same model under another spelling is the same run, and the run writes under
    the folder's key."""
    from jacobeam.transforms.spec import run_key

    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "data")
    test_models.small_mlp().save(tmp_path / "m.keras")
    cfg = _cfg("data/*.npy", "out", {"path": "./m.keras"})
    first = _run(cfg)
    old = {**first["run_identity"], "model.path": "./m.keras"}  # as an older jacobeam recorded it
    key = run_key(old)
    assert key != first["run_key"]
    for shard in first["shards"]:
        with h5py.File(tmp_path / "out" / shard["file"], "r+") as h5:
            h5.attrs.update(run_key=key, run_identity=json.dumps(old, sort_keys=True))
        shard["crc32c"] = crc32c(tmp_path / "out" / shard["file"])  # as that run's manifest listed them
    manifest = {**first, "run_identity": old, "run_key": key}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "out" / "shards" / "shard-000000000024-000000000032.h5").unlink()

    again = _run(_cfg("data/*.npy", "out", {"path": str(tmp_path / "m.keras")}))

    assert _computed(again) == [False, False, False, True] and again["run_key"] == key
    with h5py.File(tmp_path / "out" / "shards" / "shard-000000000024-000000000032.h5") as h5:
        assert h5.attrs["run_key"] == key
    assert verify(tmp_path / "out", samples=2).ok


def _copied_project(tmp_path: Path, monkeypatch) -> tuple[Path, dict[str, np.ndarray]]:
    """Model, data and output in one project folder, named relative in the config, run there, then copied
    with ``cp -a`` to ``copy`` beside it, which becomes the working directory; the project and its arrays."""
    project = tmp_path / "project"
    arrays = _write(project / "data")
    test_models.small_mlp().save(project / "m.keras")
    (project / "job.yaml").write_text(json.dumps(_cfg("data/*.npy", "out", {"path": "m.keras"})))
    monkeypatch.chdir(project)
    assert cli.main(["-q", "run", "job.yaml"]) == 0
    subprocess.run(["cp", "-a", "project", "copy"], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path / "copy")
    return project, arrays


def test_a_folder_copied_with_cp_a_and_run_from_the_copy_is_the_same_run(tmp_path, monkeypatch):
    """Model, data and output in one project folder, named relative in the config; the folder copied with
    ``cp -a`` (and the original removed: moved) and the same command run from the copy keeps every shard."""
    project, arrays = _copied_project(tmp_path, monkeypatch)
    shutil.rmtree(project)
    inodes = _inodes(tmp_path / "copy" / "out")

    assert cli.main(["-q", "run", "job.yaml"]) == 0

    manifest = json.loads((tmp_path / "copy" / "out" / "manifest.json").read_text())
    assert manifest["run"]["samples_computed"] == 0 and _computed(manifest) == [False] * 4
    assert _inodes(tmp_path / "copy" / "out") == inodes
    assert [Path(e["path"]).parent for e in folder_inputs(manifest["output_dir"])] == [tmp_path / "copy" / "data"] * 3
    assert_close(_view(tmp_path / "copy" / "out")["jacobian"], _reference(np.concatenate([arrays[n] for n in SIZES])))
    assert verify(tmp_path / "copy" / "out", samples=2).ok


def test_a_copied_project_whose_old_inputs_are_deleted_from_the_copy_takes_their_samples_out(tmp_path, monkeypatch, capsys):
    """The copy's files gone, the original's still there: they were named as files the glob no longer
    matched (a narrowed glob), and the run refused. A file still in the copy but not matched is that."""
    project, arrays = _copied_project(tmp_path, monkeypatch)
    copy = tmp_path / "copy"
    capsys.readouterr()  # c.npy still in the copy, no longer matched: refused
    assert cli.main(["-q", "run", "job.yaml", "--set", "input.paths=['data/[ab].npy']"]) == cli.FAILED
    assert "c.npy is no longer matched by input.paths but is still there" in capsys.readouterr().err
    for path in (copy / "data").iterdir():
        path.unlink()
    new = np.random.default_rng(5).normal(size=(6, 12)).astype(np.float32)
    np.save(copy / "data" / "z.npy", new)

    assert cli.main(["-q", "run", "job.yaml"]) == 0

    manifest = json.loads((copy / "out" / "manifest.json").read_text())
    assert manifest["removed"]["count"] == sum(len(a) for a in arrays.values()) and manifest["num_rows"] == 6
    assert_close(_view(copy / "out")["jacobian"], _reference(new))
    assert verify(copy / "out", samples=2).ok
    assert sorted(p.name for p in (project / "data").iterdir()) == sorted(f"{n}.npy" for n in arrays)  # untouched


# --- appended rows -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".h5"])
def test_five_rows_appended_to_a_file_compute_five_samples_and_equal_a_clean_run(tmp_path, suffix):
    data, out = tmp_path / "data", tmp_path / "out"
    key = None if suffix == ".npy" else "x"
    arrays = _write(data, suffix)
    cfg = _cfg(str(data / f"*{suffix}"), str(out), key=key)
    _run(cfg)
    inodes = _inodes(out)
    grown = np.concatenate([arrays["b"], np.random.default_rng(9).normal(size=(5, 12)).astype(np.float32)])
    _save(data / f"b{suffix}", grown)

    manifest = _run(cfg)

    assert manifest["run"]["samples_computed"] == 5 and manifest["num_samples"] == 37
    assert _computed(manifest) == [False, False, False, False, True]  # the old shards read as before: kept
    assert {k: v for k, v in _inodes(out).items() if k in inodes} == inodes
    assert manifest["id_segments"] == [[0, 32], [32, 37]]
    pieces = [(Path(e["path"]).name, e["first_id"], e["num_samples"], e.get("first_row", 0)) for e in folder_inputs(out)]
    assert pieces == [(f"a{suffix}", 0, 7, 0), (f"b{suffix}", 7, 13, 0), (f"c{suffix}", 20, 12, 0), (f"b{suffix}", 32, 5, 13)]
    view = _view(out)
    by_id = np.concatenate([arrays["a"], grown[:13], arrays["c"], grown[13:]])
    assert_close(view["jacobian"], _reference(by_id))
    assert verify(out, samples=4).ok

    clean = _run(_cfg(str(data / f"*{suffix}"), str(tmp_path / "clean"), key=key))  # a, b (18), c: other ids
    order = [*range(0, 20), *range(25, 37), *range(20, 25)]  # the clean run's ids of the samples in id order here
    assert clean["num_samples"] == 37
    np.testing.assert_allclose(view["jacobian"], _view(tmp_path / "clean")["jacobian"][order], rtol=1e-6, atol=1e-7)


def test_under_outputs_label_a_rewritten_file_keeps_its_shards_unless_its_labels_changed(tmp_path):
    """The labels decide the values too: a stale shard is kept when its samples and labels read as before
    (``labels_sha256``), computed again when a label changed."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    rng = np.random.default_rng(4)
    arrays = {name: (rng.normal(size=(size, 12)).astype(np.float32), rng.integers(0, 5, size)) for name, size in SIZES.items()}
    for name, (x, y) in arrays.items():
        np.savez(data / f"{name}.npz", x=x, y=y)
    cfg = _cfg(str(data / "*.npz"), str(out), key="x")
    cfg["jacobian"].update(outputs="label", labels={"key": "y"})
    _run(cfg)
    inodes = _inodes(out)
    subprocess.run("cp -r data data.copy && rm -r data && mv data.copy data", shell=True, cwd=tmp_path, check=True)
    assert _run(cfg)["run"]["samples_computed"] == 0 and _inodes(out) == inodes

    x, y = arrays["c"]
    y = y.copy()
    y[7] = (y[7] + 1) % 5  # c's row 7: id 27, shard 24..32
    np.savez(data / "c.npz", x=x, y=y)
    manifest = _run(cfg)
    assert _computed(manifest) == [False, False, False, True]
    samples = np.concatenate([arrays[n][0] for n in SIZES])
    labels = np.concatenate([arrays["a"][1], arrays["b"][1], y])
    expected = _reference(samples)[np.arange(32), labels][:, None]
    assert_close(_view(out)["jacobian"], expected)
    assert verify(out, samples=2).ok


def test_the_manifest_vouches_only_for_the_shard_it_lists_by_its_digest():
    """A shard kept by its content records the old stamps; the manifest lists the new ones and the shard's
    digest. A shard computed later under the same name (another digest) is not vouched for: its file
    changed back to the manifest's stamp, it is stale, not trusted."""
    from jacobeam.pipeline.folder import Folder, stale_names

    def shard(stamp: str, digest: str) -> dict:
        return {"input_stamps": json.dumps({"/d/b.npy": stamp}), "samples_sha256": digest}

    listed = [{"file": "shards/kept.h5", "samples_sha256": "d0"}, {"file": "shards/later.h5", "samples_sha256": "d1"}]
    manifest = {"inputs": [{"path": "/d/b.npy", "stamp": "S1"}], "shards": listed}
    folder = Folder("/out", manifest, {"kept.h5": shard("S0", "d0"), "later.h5": shard("S2", "d2")})
    assert stale_names(folder, {"/d/b.npy": "S1"}) == ["later.h5"]  # kept.h5: vouched for under S1
    assert stale_names(folder, {"/d/b.npy": "S2"}) == ["kept.h5"]  # later.h5: its own stamps
    assert stale_names(folder, {"/d/b.npy": "S3"}) == ["kept.h5", "later.h5"]
    assert stale_names(folder, {}) == []  # a file gone (inspect): not judged
