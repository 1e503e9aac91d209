"""Resuming, incremental runs, foreign output folders, --overwrite, and a transient DoFn failure."""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.inspect_output import format_report, inspect
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output.inputs_table import folder_inputs
from jacobeam.transforms.output.storage import sha256
from jacobeam.transforms.testing import faults
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_pipeline import folder_state


def _config(data: Path, out: Path, **jacobian):
    return config.validate(
        {
            "model": {"factory": "tests.models:small_mlp"},
            "input": {"paths": [str(data / "*.npy")]},
            "jacobian": {"batch_size": 4, **jacobian},
            "output": {"path": str(out), "samples_per_shard": 16},
        }
    )


def _write(folder: Path, sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, size in sizes.items():
        arrays[name] = rng.normal(size=(size, 12)).astype(np.float32)
        np.save(folder / f"{name}.npy", arrays[name])
    return arrays


def _run(data, out, beam_args=(), **jacobian):
    return runner.run(_config(data, out, **jacobian), list(beam_args), show_progress=False).manifest


def _shas(out: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in sorted((out / "shards").iterdir())}


def _view(out: Path) -> dict[str, np.ndarray]:
    with h5py.File(out / "jacobians.h5") as view:
        return {name: view[name][:] for name in view}


SIZES = {"a": 7, "b": 13, "c": 20}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A clean, uninterrupted run over a (7), b (13), c (20): the reference for bit-for-bit comparisons."""
    root = tmp_path_factory.mktemp("resume")
    arrays = _write(root / "data", SIZES, seed=0)
    manifest = _run(root / "data", root / "out")
    return root, arrays, manifest


def _own_run(tmp_path):
    """A run like ``clean`` over inputs of its own (ids are tied to input paths; these may be changed)."""
    arrays = _write(tmp_path / "data", SIZES, seed=0)
    _run(tmp_path / "data", tmp_path / "out")
    return tmp_path / "data", tmp_path / "out", arrays


# --- incremental runs ---------------------------------------------------------------------------------


def test_incremental_run_computes_only_new_files_and_ids_stay(clean, tmp_path):
    data, out, arrays = _own_run(tmp_path)
    old = {name: (sha, (out / "shards" / name).stat().st_mtime_ns) for name, sha in _shas(out).items()}
    # "0new" sorts before every old file: in sorted-path order it would shift every old id.
    new = _write(data, {"0new": 5, "d": 19}, seed=1)

    second = _run(data, out)

    ids = {Path(e["path"]).name: (e["first_id"], e["stop_id"]) for e in folder_inputs(second["output_dir"])}
    assert ids == {"a.npy": (0, 7), "b.npy": (7, 20), "c.npy": (20, 40), "0new.npy": (40, 45), "d.npy": (45, 64)}
    assert second["id_segments"] == [[0, 40], [40, 64]]
    assert [(s["start"], s["stop"], s["computed_in_this_run"]) for s in second["shards"]] == [
        (0, 16, False),
        (16, 32, False),
        (32, 40, False),
        (40, 56, True),
        (56, 64, True),
    ]
    assert second["run"]["samples_computed"] == 24
    for name, (sha, mtime) in old.items():  # old shards untouched
        assert (sha256(out / "shards" / name), (out / "shards" / name).stat().st_mtime_ns) == (sha, mtime)
    samples = np.concatenate([arrays["a"], arrays["b"], arrays["c"], new["0new"], new["d"]])
    view = _view(out)
    np.testing.assert_array_equal(view["sample_id"], np.arange(64))
    assert_close(view["jacobian"], tape_loop(test_models.small_mlp(), samples), rtol=1e-5)
    assert cli.main(["verify", str(out), "--samples", "4"]) == 0

    third = _run(data, out)
    assert third["run"]["samples_computed"] == 0 and third["id_segments"] == [[0, 40], [40, 64]]


def test_a_rerun_reads_only_new_or_changed_files_and_with_nothing_to_compute_no_worker_loads_the_model(
    tmp_path, monkeypatch
):
    """A resume trusts what the file system says of a file (size, time of its last change): the ranges of
    an unchanged file are not read again; a new file's are; a file changed in place has the shards it
    feeds computed again (a (7), b (13), c (20): b feeds ids 0..32, two shards of 16)."""
    from jacobeam.transforms import job
    from jacobeam.transforms.spec import ModelSource

    data, out, _ = _own_run(tmp_path)
    read, shard_batches = [], job.shard_batches

    def counted(spec, shard, *args, **kwargs):
        read.append((shard.start, shard.stop))
        return shard_batches(spec, shard, *args, **kwargs)

    monkeypatch.setattr(job, "shard_batches", counted)

    loads, load = [], ModelSource.load

    def counted_load(self):
        loads.append(self)
        return load(self)

    with monkeypatch.context() as patched:
        patched.setattr(ModelSource, "load", counted_load)
        again = _run(data, out)
    # Built once, by the launcher: a factory's identity is that of the model it builds; no worker loads it.
    assert read == [] and again["run"]["samples_computed"] == 0 and len(loads) == 1

    _write(data, {"d": 5}, seed=3)
    assert _run(data, out)["run"]["samples_computed"] == 5 and read == [(40, 45)]

    # b (ids 7..20) feeds the shards of ids 0..16 and 16..32; only its row 0 (id 7) changes: the shard of
    # ids 16..32 is read again, its samples are those it was computed from, and it is kept as it is.
    names = ("shard-000000000016-000000000032.h5", "shard-000000000032-000000000040.h5")
    kept = {name: (sha256(out / "shards" / name), (out / "shards" / name).stat().st_ino) for name in names}
    x = np.load(data / "b.npy")
    x[0, 0] += 1.0
    np.save(data / "b.npy", x)
    stat = (data / "b.npy").stat()
    os.utime(data / "b.npy", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock still tells
    changed = _run(data, out)
    assert changed["run"]["samples_computed"] == 16 and read[1:] == [(0, 16)]
    assert [s["computed_in_this_run"] for s in changed["shards"]] == [True, False, False, False]
    assert {name: (sha256(out / "shards" / name), (out / "shards" / name).stat().st_ino) for name in names} == kept
    assert verify(out, samples=4).ok


def test_incremental_run_with_a_shrunk_old_file_is_refused(clean, tmp_path, capsys):
    """A file that holds fewer samples than its ids is another run's inputs (a file gone is not:
    tests/test_deleted_inputs.py); one changed in place keeps its ids (its shards are computed again:
    the test above) and is no difference."""
    data, out, _ = _own_run(tmp_path)
    before = folder_state(out)
    x = np.load(data / "b.npy")
    x[0, 0] += 1.0
    np.save(data / "b.npy", x)  # same shape, other data
    np.save(data / "c.npy", np.load(data / "c.npy")[:10])
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(data, out).model_dump(mode="json")))

    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED
    err = capsys.readouterr().err
    assert "holds the result of a different run:\n  input file " in err and "b.npy changed" not in err, err
    assert re.search(r"input file .*/c.npy changed: samples 20 there, 10 now", err)
    assert "use --overwrite" in err
    assert folder_state(out) == before


# --- foreign folders and --overwrite ------------------------------------------------------------------


_SMALL_MLP = test_models.small_mlp


def _other_weights(dtype="float32"):
    """small_mlp with retrained (here: scaled) weights: same factory name, other fingerprint."""
    model = _SMALL_MLP(dtype)
    model.set_weights([w * 1.5 for w in model.get_weights()])
    return model


def test_a_factory_that_loads_other_weights_than_the_kept_shards_writes_no_shard_beside_them(tmp_path, monkeypatch):
    """The factory's source is unchanged, but it now builds other weights: its identity is that of the
    model it builds (the launcher builds it), so the folder is refused before any worker runs.
    (A worker that builds other weights than the launcher's: tests/test_factory_identity.py.)"""
    data, out, _ = _own_run(tmp_path)
    shards = _shas(out)
    monkeypatch.setattr(test_models, "small_mlp", _other_weights)
    _write(data, {"d": 5}, seed=3)
    with pytest.raises(Exception, match=r"manifest.json: model: the weights differ \(so do 3 shards\)"):
        _run(data, out)
    assert _shas(out) == shards  # nothing written beside them


@pytest.mark.parametrize(
    "change, message",
    [
        ("config", r"manifest.json: written by a different run: jacobian.jit_compile is false there, true in this run"),
        ("inputs", r"input file .*/a.npy changed: samples 7 there, 6 now"),
        (
            "unfinished",
            r"shards/shard-000000000000-000000000016.h5: written by a different run: jacobian.jit_compile "
            r"is false there, true in this run \(so do 2 more shards\)",
        ),
    ],
)
def test_a_foreign_folder_is_refused_saying_what_differs_and_overwrite_replaces_only_our_files(
    clean, tmp_path, capsys, monkeypatch, change, message
):
    data, out, _ = _own_run(tmp_path)
    (out / "notes.txt").write_text("mine")
    (out / "shards" / "README").write_text("mine too")
    overrides = []
    if change in ("config", "unfinished"):
        overrides = ["--set", "jacobian.jit_compile=true"]
    if change == "unfinished":
        (out / "manifest.json").unlink()  # shards only: the folder of an interrupted run
    if change == "inputs":
        x = np.load(data / "a.npy")
        np.save(data / "a.npy", x[:-1].copy())  # other ids (a file changed in place keeps them: not here)
    before = folder_state(out)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(data, out).model_dump(mode="json")))

    assert cli.main(["-q", "run", str(cfg), *overrides]) == cli.FAILED
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert folder_state(out) == before

    assert cli.main(["-q", "run", str(cfg), *overrides, "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "shards" / "README").read_text() == "mine too"
    fresh = tmp_path / "fresh"
    cli.main(["-q", "run", str(cfg), *overrides, "--set", f"output.path={fresh}"])
    assert {k: v for k, v in _shas(out).items() if k != "README"} == _shas(fresh)
    assert json.loads((out / "manifest.json").read_text())["run"]["samples_computed"] == (39 if change == "inputs" else 40)


def test_an_overwrite_that_fails_leaves_the_old_result_whole_and_the_same_command_then_replaces_it(
    clean, tmp_path, fail_once, caplog
):
    """The replacing run computes in a folder of its own: failed, it has not touched the old result (every
    file as it was, verified); run again, it keeps what it had computed, and then the folder holds
    exactly what a fresh run writes, the user's files still there."""
    root, _, _ = clean
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    (out / "notes.txt").write_text("mine")
    files = {p: sha256(p) for p in out.rglob("*") if p.is_file()}
    replacing = _config(root / "data", out, outputs=[0, 2])

    with pytest.raises(Exception, match=r"injected transient failure"):
        runner.run(replacing, [], show_progress=False, overwrite=True)

    assert {p: sha256(p) for p in out.rglob("*") if p.is_file() and ".jacobeam-overwrite" not in p.parts} == files
    assert verify(out, samples=2, inputs="all").ok
    staged = sorted(p.name for p in (out / ".jacobeam-overwrite" / "shards").iterdir())
    assert staged == ["shard-000000000000-000000000016.h5"]  # computed before the failure, in id order
    report = inspect(str(out))
    assert report.ok and report.unfinished_overwrite.startswith("an --overwrite stopped before its result was complete")
    assert "\n  overwrite   an --overwrite stopped" in format_report(report)
    with caplog.at_level(logging.WARNING, logger="jacobeam"):  # the old config: its result is complete
        assert runner.run(_config(root / "data", out), [], show_progress=False).manifest["run"]["samples_computed"] == 0
    assert "an --overwrite stopped before its result was complete left 1 file(s)" in caplog.text
    with pytest.raises(OutputError, match=r"holds the result of a different run:(.|\n)*\n\(an --overwrite stopped before "
                       r"its result was complete left 1 file\(s\) in .*/out/\.jacobeam-overwrite: run it again"):
        runner.run(_config(root / "data", out, outputs=[1]), [], show_progress=False)

    manifest = runner.run(replacing, [], show_progress=False, overwrite=True).manifest

    assert [s["computed_in_this_run"] for s in manifest["shards"]] == [False, True, True]
    fresh = tmp_path / "fresh"
    runner.run(_config(root / "data", fresh, outputs=[0, 2]), [], show_progress=False)
    assert _shas(out) == _shas(fresh)
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in fresh.iterdir()), "notes.txt"])
    assert manifest["output_dir"] == str(out) and manifest["config"]["output"]["path"] == str(out)
    for name, values in _view(out).items():
        np.testing.assert_array_equal(values, _view(fresh)[name])
    assert verify(out, samples=4).ok
    assert inspect(str(out)).unfinished_overwrite is None


def test_overwrite_on_this_runs_own_partial_result_resumes_it(clean, tmp_path):
    root, _, first = clean
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    (out / "shards" / "shard-000000000016-000000000032.h5").unlink()
    (out / "manifest.json").unlink()
    manifest = runner.run(_config(root / "data", out), [], show_progress=False, overwrite=True).manifest
    assert [s["computed_in_this_run"] for s in manifest["shards"]] == [False, True, False]
    assert [s["crc32c"] for s in manifest["shards"]] == [s["crc32c"] for s in first["shards"]]


def test_a_folder_written_before_crc32c_resumes_and_its_manifest_then_lists_crc32c(clean, tmp_path):
    """A folder whose manifest lists sha256 (as before CRC32C), its run cut short: the complete shards are
    kept (locally their names prove them), the missing one computed, and every shard is then listed with
    its crc32c; the folder verifies."""
    from jacobeam.pipeline.verify import verify

    root, _, first = clean
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["sha256"] = sha256(out / entry["file"])
        del entry["crc32c"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "shards" / "shard-000000000016-000000000032.h5").unlink()

    resumed = _run(root / "data", out)

    assert [s["computed_in_this_run"] for s in resumed["shards"]] == [False, True, False]
    assert [s["crc32c"] for s in resumed["shards"]] == [s["crc32c"] for s in first["shards"]]
    assert not any("sha256" in s for s in resumed["shards"])
    assert verify(out, samples=0, inputs="all").ok


def test_files_with_jacobeams_names_but_not_its_content_are_never_touched(clean, tmp_path, capsys):
    root, _, _ = clean
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"my": "own manifest"}')
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(root / "data", out).model_dump(mode="json")))
    assert cli.main(["-q", "run", str(cfg), "--overwrite"]) == cli.FAILED
    assert re.search(
        r"out/manifest.json — jacobeam uses these names, but did not write these files", capsys.readouterr().err
    )
    assert (out / "manifest.json").read_text() == '{"my": "own manifest"}'
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def test_leftover_temporary_manifest_and_view_are_removed_and_never_read(clean, tmp_path):
    root, _, first = clean
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    (out / "manifest.json").unlink()
    (out / "jacobians.h5").unlink()
    (out / ".manifest.json.tmp-4242").write_text('{"half": ')
    (out / ".jacobians.h5.tmp-4242").write_bytes(b"\x89HDF half a file")
    (out / ".rejected.jsonl.tmp-4242").write_text('{"id": 1')
    (out / ".engine-plan.json.tmp-4242").write_text('{"key": ')
    (out / "shards" / ".shard-000000000016-000000000032.h5.tmp-0123456789ab").write_bytes(b"half a shard")

    manifest = _run(root / "data", out)

    assert [s["crc32c"] for s in manifest["shards"]] == [s["crc32c"] for s in first["shards"]]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["engine-plan.json", "inputs.h5", "jacobians.h5", "manifest.json", "rejected.jsonl", "shards"]
    assert all(not p.name.startswith(".") for p in (out / "shards").iterdir())


# --- a transient failure inside the DoFn --------------------------------------------------------------


@pytest.fixture
def fail_once(tmp_path, monkeypatch):
    """The shard starting at id 16 fails once, after part of it was written."""
    marker = tmp_path / "failed-once"
    monkeypatch.setenv(faults.FAIL_SHARD_ONCE, "16")
    monkeypatch.setenv(faults.FAIL_MARKER, str(marker))
    return marker


def test_in_process_runner_does_not_retry_a_failed_bundle_it_fails_cleanly_and_a_rerun_completes(
    clean, tmp_path, fail_once
):
    """Beam's FnApiRunner (the local default) has no bundle retries: the job fails. What it leaves must
    be safe: no half shard, no temporary file, no manifest; the same command then completes the run."""
    root, _, first = clean
    out = tmp_path / "out"
    with pytest.raises(Exception, match=r"injected transient failure while writing the shard starting at id 16"):
        _run(root / "data", out)
    assert fail_once.exists()
    names = sorted(p.name for p in (out / "shards").iterdir())
    assert "shard-000000000016-000000000032.h5" not in names
    assert all(not n.startswith(".") for n in names)  # the failed attempt removed its temporary file
    assert not (out / "manifest.json").exists()

    manifest = _run(root / "data", out)

    assert _shas(out) == _shas(root / "out")
    assert [s["crc32c"] for s in manifest["shards"]] == [s["crc32c"] for s in first["shards"]]
    assert _view(out).keys() == _view(root / "out").keys()
    for name, values in _view(out).items():
        np.testing.assert_array_equal(values, _view(root / "out")[name])


def test_a_runner_that_retries_bundles_completes_the_run_without_duplicates(clean, tmp_path, fail_once):
    """Beam's BundleBasedDirectRunner retries a failed bundle (as distributed runners do): the retried
    range finds no half shard, writes its shard once, and the one run completes bit for bit."""
    root, _, first = clean
    out = tmp_path / "out"
    # The clean run's threads (shards record them; this runner is not one whose cores jacobeam splits).
    manifest = _run(root / "data", out, ["--runner", "BundleBasedDirectRunner"], threads=os.cpu_count())
    assert fail_once.exists()  # it did fail once
    assert [(s["start"], s["crc32c"]) for s in manifest["shards"]] == [
        (s["start"], s["crc32c"]) for s in first["shards"]
    ]
    assert _shas(out) == _shas(root / "out")
    assert sorted(os.listdir(out)) == [
        "engine-plan.json", "inputs.h5", "jacobians.h5", "manifest.json", "rejected.jsonl", "shards"]
    np.testing.assert_array_equal(_view(out)["sample_id"], np.arange(40))
