"""Input files that go (issue 37): a deleted file's samples leave the result and the rest is kept as it
was. Its ids stay taken, marked removed (``manifest["removed"]``, ``"removed": true`` in the inputs
table); the shards that held its rows are written again without them, their other rows copied (not
computed: compared here byte for byte with the previous run's rows and with a per-sample
``tf.GradientTape`` reference); the shards it did not feed are not touched; ``verify`` passes. A file no
shard stored a row of (unreadable, or every sample rejected) just goes, its shard's rows untouched. A
file put back later is a new file: its samples come back under new ids."""

import ast
import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.folder import read_folder
from jacobeam.pipeline.verify import verify
from jacobeam.transforms import trim
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.services import jacobeam_process
from tests.test_images import as_samples, write_images


def _run(raw: dict) -> dict:
    return runner.run(config.validate(raw), [], show_progress=False).manifest


def _rows(out: Path) -> dict[int, dict[str, np.ndarray]]:
    """Each stored sample's row of ``jacobians.h5``, by sample id."""
    with h5py.File(out / "jacobians.h5") as view:
        ids = view["sample_id"][:]
        columns = {name: view[name][:] for name in ("jacobian", "output", "nonfinite")}
    return {int(i): {name: values[row] for name, values in columns.items()} for row, i in enumerate(ids)}


def _shards(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted((out / "shards").iterdir())}


def _assert_kept(before: dict, after: dict, gone: set[int]) -> None:
    """The rows of ``after`` are those of ``before`` but the ids ``gone``, bit for bit."""
    assert sorted(after) == sorted(set(before) - gone)
    for sample_id, row in after.items():
        for name, values in row.items():
            assert values.tobytes() == before[sample_id][name].tobytes(), (sample_id, name)


# --- an image folder: one PNG per sample ----------------------------------------------------------------


IMAGES = [f"img{i:02d}.png" for i in range(10)]  # ids 0..9; shards of 4: 0..4, 4..8, 8..10


def _image_job(images: Path, out: Path, policy: str) -> dict:
    return {
        "model": {"factory": "tests.models:small_cnn"},
        "input": {"paths": [str(images)], "on_bad_sample": policy},
        "jacobian": {"batch_size": 4},
        "output": {"path": str(out), "samples_per_shard": 4},
    }


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_deleted_image_leaves_only_its_row(tmp_path, policy):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, IMAGES)
    raw = _image_job(images, out, policy)
    _run(raw)
    before, shards = _rows(out), _shards(out)
    (images / "img05.png").unlink()

    manifest = _run(raw)

    assert manifest["removed"] == {"count": 1, "ids": [[5, 6]], "files": 1}
    assert manifest["rejected"]["count"] == 0 and manifest["num_samples"] == 10 and manifest["num_rows"] == 9
    assert manifest["run"]["samples_computed"] == 0  # the shard of id 5 was copied without it, not computed
    assert [(s["start"], s["num_samples"], s["computed_in_this_run"]) for s in manifest["shards"]] == [
        (0, 4, False), (4, 3, False), (8, 2, False),
    ]
    after = _shards(out)
    for name in ("shard-000000000000-000000000004.h5", "shard-000000000008-000000000010.h5"):
        assert after[name] == shards[name]  # the shards it did not feed: the same file, untouched
    _assert_kept(before, _rows(out), {5})
    kept = {path: values for path, values in pixels.items() if not path.endswith("img05.png")}
    with h5py.File(out / "jacobians.h5") as view:
        assert_close(view["jacobian"][:], tape_loop(test_models.small_cnn(), as_samples(kept)), rtol=1e-5)
        names = [name.decode() if isinstance(name, bytes) else name for name in view["source_files"][:]]
        assert "img05.png" not in names and len(names) == 9
    entries = read_folder(str(out)).manifest["inputs"]
    assert [(Path(e["path"]).name, e["first_id"]) for e in entries if e.get("removed")] == [("img05.png", 5)]
    report = verify(out, samples=3, inputs="all")
    assert report.ok, report.problems

    again = _run(raw)  # a rerun: nothing to copy or compute again, the removed id stays removed
    assert again["removed"] == manifest["removed"] and again["run"]["samples_computed"] == 0
    assert _shards(out) == after


# --- .npy files of many rows ----------------------------------------------------------------------------


SIZES = {"a": 7, "b": 13, "c": 12}  # ids a 0..7, b 7..20, c 20..32; shards of 8


def _npy_job(data: Path, out: Path, policy: str = "error", samples_per_shard: int = 8) -> dict:
    return {
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": [str(data / "*.npy")], "on_bad_sample": policy},
        "jacobian": {"batch_size": 4},
        "output": {"path": str(out), "samples_per_shard": samples_per_shard},
    }


def _write(data: Path, sizes: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {name: rng.normal(size=(size, 12)).astype(np.float32) for name, size in sizes.items()}
    for name, x in arrays.items():
        np.save(data / f"{name}.npy", x)
    return arrays


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_deleted_npy_file_of_many_rows_leaves_its_rows_across_shards(tmp_path, policy, capsys):
    """b's ids 7..20 span three shards: 0..8 keeps a's rows, 8..16 keeps none, 16..24 keeps c's; 24..32
    is not touched. The run says how many went: its log, its summary, ``inspect``."""
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data, SIZES)
    raw = _npy_job(data, out, policy)
    _run(raw)
    before, shards = _rows(out), _shards(out)
    (data / "b.npy").unlink()
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(raw))
    capsys.readouterr()

    assert cli.main(["run", str(cfg)]) == cli.OK

    said = capsys.readouterr()
    assert "1 input file(s) gone since the last run: their 13 sample(s) leave the result" in said.err
    assert "in 2 file(s) (13 of them removed: 1 input file(s) gone) -> 4 shard(s)" in said.err
    assert "removed: 13 sample(s) of 1 input file(s) gone" in said.out and ", 13 removed)" in said.out
    assert cli.main(["inspect", str(out)]) == cli.OK
    assert "removed     13 sample(s) of 1 input file(s) deleted" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())

    assert manifest["removed"] == {"count": 13, "ids": [[7, 20]], "files": 1}
    assert manifest["num_rows"] == 19 and manifest["run"]["samples_computed"] == 0
    assert [(s["start"], s["num_samples"]) for s in manifest["shards"]] == [(0, 7), (8, 0), (16, 4), (24, 8)]
    assert _shards(out)["shard-000000000024-000000000032.h5"] == shards["shard-000000000024-000000000032.h5"]
    _assert_kept(before, _rows(out), set(range(7, 20)))
    with h5py.File(out / "jacobians.h5") as view:
        samples = np.concatenate([arrays["a"], arrays["c"]])
        assert_close(view["jacobian"][:], tape_loop(test_models.small_mlp(), samples), rtol=1e-5)
        assert view["source_row"][:].tolist() == [*range(7), *range(12)]
    report = verify(out, samples=4, inputs="all")
    assert report.ok, report.problems


def test_inspect_calls_a_folder_whose_shards_a_killed_run_shortened_not_complete(tmp_path, capsys):
    """A run killed after it renamed the shards written again without a deleted file's rows, before the view
    and the manifest (here: those put back): the view maps more rows of those shards than they hold, and
    HDF5 cannot read past a source's end. inspect said complete; it names each such shard, and the rerun
    completes the folder."""
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    before = {name: (out / name).read_bytes() for name in ("manifest.json", "jacobians.h5")}
    (data / "b.npy").unlink()
    _run(raw)
    for name, content in before.items():
        (out / name).write_bytes(content)
    with h5py.File(out / "jacobians.h5") as view, pytest.raises(OSError):
        view["jacobian"][:]
    capsys.readouterr()

    assert cli.main(["inspect", str(out)]) == cli.FAILED
    said = capsys.readouterr().out
    assert "NOT COMPLETE" in said
    for name, rows in (("shard-000000000000-000000000008.h5", 7), ("shard-000000000008-000000000016.h5", 0),
                       ("shard-000000000016-000000000024.h5", 4)):
        assert f"shards/{name} holds {rows} row(s) where the manifest and jacobians.h5 have 8: a run that did not " \
               "finish replaced it" in said, said
    assert "shard-000000000024" not in said

    _run(raw)
    assert cli.main(["inspect", str(out)]) == cli.OK
    with h5py.File(out / "jacobians.h5") as view:
        assert len(view["jacobian"][:]) == 19


def test_a_file_deleted_then_put_back_after_a_run_that_did_not_finish_is_computed_again(tmp_path):
    """A run killed after it wrote shards again without a deleted file (its manifest and view not yet
    written), then the file put back: the manifest's ids are still the file's, and the shortened shards
    were refused as computed from other input data, a folder only --overwrite could mend."""
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    top = {name: (out / name).read_bytes() for name in ("manifest.json", "jacobians.h5", "inputs.h5", "rejected.jsonl")}
    (data / "a.npy").unlink()
    _run(raw)
    for name, content in top.items():  # as the run killed before its view and manifest left them
        (out / name).write_bytes(content)
    np.save(data / "a.npy", arrays["a"])

    manifest = _run(raw)

    assert manifest["run"]["samples_computed"] == 8 and manifest["removed"]["count"] == 0  # shard 0..8 again, with a
    fresh = tmp_path / "fresh"
    _run(_npy_job(data, fresh))
    assert _rows(out).keys() == _rows(fresh).keys() == set(range(32))
    for sample_id, row in _rows(fresh).items():
        for name, values in row.items():
            np.testing.assert_array_equal(_rows(out)[sample_id][name], values)
    assert verify(out, samples=2, inputs="all").ok


def test_inspect_takes_a_file_named_like_a_glob_for_itself(tmp_path):
    """A file named ``s[1].npy`` was looked up as the glob ``s[1].npy`` (which matches ``s1.npy``), not found,
    and called deleted by ``inspect`` while it was there."""
    from jacobeam.pipeline.inspect_output import inspect

    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, {"a": 7, "s[1]": 5})
    _run(_npy_job(data, out))
    report = inspect(str(out))
    assert report.ok and report.gone == [] and report.stale == []


def test_inspect_names_input_files_deleted_since_until_a_run_takes_them_out(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    (data / "b.npy").unlink()
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == cli.OK
    assert f"  gone        1 input file(s) deleted since: {data / 'b.npy'}; the next run takes their samples out" in \
        capsys.readouterr().out
    manifest = _run(raw)
    assert cli.main(["inspect", str(out), "--json"]) == cli.OK
    assert json.loads(capsys.readouterr().out)["gone"] == []
    # Its ids are removed, not rejected: in the manifest's totals and in each shard's
    assert manifest["removed"]["count"] == 13 and manifest["rejected"]["count"] == 0
    assert [shard["rejected"] for shard in manifest["shards"]] == [0] * len(manifest["shards"])


def test_every_input_file_gone_is_refused_saying_the_result_is_kept_and_how_to_empty_it(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for path in data.iterdir():
        path.unlink()
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(raw))
    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.endswith(f"matches no files: refused, as a mistyped glob would be, and the result in {out} (3 input "
                         "file(s)) is kept; to empty it, delete the output folder"), said
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".jacobeam-lease.json"} == before


@pytest.mark.parametrize("added", ["a", "bb"])  # sorting before the others, or between them
def test_a_run_that_never_finished_takes_a_file_added_among_the_others(tmp_path, added):
    """A first run stopped with some shards complete (no manifest: ids are numbered afresh), then a file
    added that sorts among the others: the shards whose ids now mean other samples are computed again (and
    one no range of the run names goes), the others kept. It was refused as another run's result, and
    --overwrite threw the complete shards away. The result is a fresh run's, sample for sample."""
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, {"b": 13, "c": 12})  # ids b 0..13, c 13..25; shards of 8: [0,8) [8,16) [16,24) [24,25)
    raw = _npy_job(data, out)
    _run(raw)
    for name in ("manifest.json", "jacobians.h5", "inputs.h5", "shards/shard-000000000016-000000000024.h5"):
        (out / name).unlink()  # as a run killed with two of its shards complete left it
    kept = _shards(out)["shard-000000000000-000000000008.h5"]
    _write(data, {added: 7}, seed=1)

    manifest = _run(raw)

    fresh = tmp_path / "fresh"
    _run(_npy_job(data, fresh))
    assert manifest["num_rows"] == 32
    after, want = _rows(out), _rows(fresh)
    assert sorted(after) == sorted(want) == list(range(32))
    for i in want:
        for name in want[i]:
            np.testing.assert_array_equal(after[i][name], want[i][name], err_msg=f"sample {i} {name}")
    shards = _shards(out)
    assert sorted(shards) == sorted(_shards(fresh))  # shard-...24-...25 gone: no range of the run names it
    assert (shards["shard-000000000000-000000000008.h5"] == kept) == (added != "a")  # b's first 8 rows: same ids


def test_a_file_the_glob_no_longer_matches_but_still_there_is_not_deleted(tmp_path, capsys):
    """input.paths narrowed to leave b.npy out, b.npy still there: a refusal naming it, the folder untouched
    (it was taken as deleted: its 13 samples left the result, and putting the glob back gave them new ids
    for good). Deleting b.npy then takes its samples out as any deleted file's."""
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    shards, manifest = _shards(out), (out / "manifest.json").read_bytes()
    narrowed = {**raw, "input": {**raw["input"], "paths": [str(data / "a.npy"), str(data / "c.npy")]}}
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(narrowed))
    capsys.readouterr()

    assert cli.main(["run", str(cfg)]) == cli.FAILED
    said = capsys.readouterr().err
    assert f"input file {data / 'b.npy'} is no longer matched by input.paths but is still there (its 13 " in said, said
    assert _shards(out) == shards and (out / "manifest.json").read_bytes() == manifest

    (data / "b.npy").unlink()
    assert cli.main(["run", str(cfg)]) == cli.OK
    assert json.loads((out / "manifest.json").read_text())["removed"] == {"count": 13, "ids": [[7, 20]], "files": 1}


def test_the_view_goes_before_a_shard_holding_other_samples_replaces_one_and_only_then(tmp_path, monkeypatch):
    """A reader of jacobians.h5 during a rerun read a shorter shard through the old view: rows labelled by the
    view's sources with a deleted file's name and row held the next file's samples. A shard recomputed for
    the same samples (a file changed in place) keeps the view: each row reads the old value or the new."""
    from jacobeam.transforms.output import storage

    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    deleted, delete = [], storage.delete
    monkeypatch.setattr(storage, "delete", lambda *paths: (deleted.extend(map(str, paths)), delete(*paths))[1])
    np.save(data / "c.npy", 2 * arrays["c"])  # the same rows, other values: its shards computed again
    assert _run(raw)["run"]["samples_computed"] == 16  # the two shards holding c's ids, 16..32
    assert str(out / "jacobians.h5") not in deleted
    (data / "a.npy").unlink()  # shard 0..8 written again holding only id 7
    _run(raw)
    assert deleted.count(str(out / "jacobians.h5")) == 1
    with h5py.File(out / "jacobians.h5") as view:
        assert view["sample_id"][:].tolist() == list(range(7, 32))


@pytest.mark.slow  # a process of its own, killed
@pytest.mark.parametrize("point", ["shard_commit", "shard_done"])
def test_a_run_killed_while_it_writes_a_shard_without_a_deleted_file_leaves_a_folder_the_rerun_completes(tmp_path, point):
    """Killed with the copy complete under its temporary name (``shard_commit``): the old shard, the
    manifest and the view are as before. Killed once it took the old one's name (``shard_done``): the
    rerun keeps it. Either way the rerun ends with the deleted file's rows gone and computes nothing."""
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    before, manifest_text = _rows(out), (out / "manifest.json").read_text()
    old = _shards(out)["shard-000000000000-000000000008.h5"]
    (data / "a.npy").unlink()  # ids 0..7: shard 0..8, the run's only shard to write, keeps b's id 7 only
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(raw))

    status, _ = jacobeam_process(["-q", "run", str(cfg)], tmp_path / "killed.stderr", kill_at=point)

    assert status == -9
    if point == "shard_commit":
        assert _shards(out)["shard-000000000000-000000000008.h5"] == old
    # The view went before the shorter shard could take the old one's name: no row read under another
    # sample's file and row; the manifest stays, and the folder reads as not complete.
    assert not (out / "jacobians.h5").exists() and (out / "manifest.json").read_text() == manifest_text
    assert cli.main(["inspect", str(out)]) == cli.FAILED
    manifest = _run(raw)
    assert manifest["removed"] == {"count": 7, "ids": [[0, 7]], "files": 1} and manifest["run"]["samples_computed"] == 0
    _assert_kept(before, _rows(out), set(range(7)))
    with h5py.File(out / "jacobians.h5") as view:
        samples = np.concatenate([arrays["b"], arrays["c"]])
        assert_close(view["jacobian"][:], tape_loop(test_models.small_mlp(), samples), rtol=1e-5)
    assert verify(out, samples=2, inputs="all").ok and not any(p.name.startswith(".") for p in (out / "shards").iterdir())
    assert manifest_text != (out / "manifest.json").read_text()


def test_shards_keeping_partial_sums_are_computed_again_without_the_deleted_file(tmp_path):
    """A shard's partial sums (``jacobian.aggregate``) cannot lose one sample's share: the shards that
    held b's rows are computed from their remaining files; the mean is that of the samples left."""
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data, SIZES)
    raw = {**_npy_job(data, out), "jacobian": {"batch_size": 4, "aggregate": ["mean"]}}
    _run(raw)
    (data / "b.npy").unlink()

    manifest = _run(raw)

    assert manifest["removed"]["ids"] == [[7, 20]] and manifest["run"]["samples_computed"] == 11  # a's 7, c's 4
    assert [s["computed_in_this_run"] for s in manifest["shards"]] == [True, True, True, False]
    expected = tape_loop(test_models.small_mlp(), np.concatenate([arrays["a"], arrays["c"]]))
    with h5py.File(out / "aggregates.h5") as h5:
        assert int(h5["count"][()]) == 19
        assert_close(h5["mean"][:], expected.mean(axis=0), rtol=1e-5)
    with h5py.File(out / "jacobians.h5") as view:
        assert_close(view["jacobian"][:], expected, rtol=1e-5)
    assert verify(out, samples=2, inputs="all").ok


def test_a_deleted_file_put_back_comes_back_under_new_ids(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    shutil.move(data / "b.npy", tmp_path / "b.npy")
    _run(raw)
    shutil.move(tmp_path / "b.npy", data / "b.npy")

    manifest = _run(raw)

    # b's old ids stay removed; its samples are a new file's: ids 32..45, after every old id, computed
    assert manifest["removed"] == {"count": 13, "ids": [[7, 20]], "files": 1}
    assert manifest["id_segments"] == [[0, 32], [32, 45]] and manifest["num_samples"] == 45
    assert manifest["run"]["samples_computed"] == 13
    entries = read_folder(str(out)).manifest["inputs"]
    assert [(Path(e["path"]).name, e["first_id"], bool(e.get("removed"))) for e in entries] == [
        ("a.npy", 0, False), ("b.npy", 7, True), ("c.npy", 20, False), ("b.npy", 32, False),
    ]
    with h5py.File(out / "jacobians.h5") as view:
        assert view["sample_id"][:].tolist() == [*range(7), *range(20, 45)]
        samples = np.concatenate([arrays["a"], arrays["c"], arrays["b"]])
        assert_close(view["jacobian"][:], tape_loop(test_models.small_mlp(), samples), rtol=1e-5)
    assert verify(out, samples=2, inputs="all").ok


# --- files no shard stored a row of ------------------------------------------------------------------------


def test_a_deleted_file_whose_samples_were_all_rejected_goes_without_reading_or_computing(tmp_path, monkeypatch):
    """Under skip, bad.npy's samples (ids 7..10, all NaN) were rejected: deleting it changes the shard
    that listed them only in what names them (its list of inputs and of rejected samples); its rows and
    their digest stay, and no input is read to write it again."""
    data, out = tmp_path / "data", tmp_path / "out"
    arrays = _write(data, {"a": 7, "c": 5})
    np.save(data / "bad.npy", np.full((3, 12), np.nan, np.float32))  # ids: a 0..7, bad 7..10, c 10..15
    raw = _npy_job(data, out, "skip", samples_per_shard=16)
    first = _run(raw)
    assert first["rejected"]["count"] == 3
    before = _rows(out)
    with h5py.File(out / "shards" / "shard-000000000000-000000000015.h5") as h5:
        digest = h5.attrs["samples_sha256"]
    (data / "bad.npy").unlink()

    def no_reading(*args, **kwargs):
        raise AssertionError("the kept samples were read again")

    monkeypatch.setattr(trim, "checked_slices", no_reading)
    manifest = _run(raw)

    assert manifest["removed"] == {"count": 3, "ids": [[7, 10]], "files": 1}
    assert manifest["rejected"]["count"] == 0 and (out / "rejected.jsonl").read_text() == ""
    _assert_kept(before, _rows(out), set())
    with h5py.File(out / "shards" / "shard-000000000000-000000000015.h5") as h5:
        assert h5.attrs["samples_sha256"] == digest and "rejected_samples" not in h5
        assert [Path(entry[0]).name for entry in json.loads(h5.attrs["inputs"])] == ["a.npy", "c.npy"]
    with h5py.File(out / "jacobians.h5") as view:
        samples = np.concatenate([arrays["a"], arrays["c"]])
        assert_close(view["jacobian"][:], tape_loop(test_models.small_mlp(), samples), rtol=1e-5)
    assert verify(out, samples=2, inputs="all").ok


def test_a_deleted_unreadable_file_just_goes(tmp_path):
    """An unreadable file (skip) had no ids: deleting it touches no shard."""
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, {"a": 7, "c": 5})
    (data / "broken.npy").write_bytes(b"not an npy file")
    raw = _npy_job(data, out, "skip")
    first = _run(raw)
    assert first["rejected"]["unreadable_files"] == [str(data / "broken.npy")]
    shards = _shards(out)
    (data / "broken.npy").unlink()

    manifest = _run(raw)

    assert manifest["removed"] == {"count": 0, "ids": [], "files": 0}
    assert manifest["rejected"]["unreadable_files"] == [] and manifest["run"]["samples_computed"] == 0
    assert _shards(out) == shards
    assert verify(out, samples=1, inputs="all").ok


def test_a_file_that_shrank_is_still_refused(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, SIZES)
    raw = _npy_job(data, out)
    _run(raw)
    np.save(data / "c.npy", np.load(data / "c.npy")[:5])
    (data / "b.npy").unlink()  # a deletion alone would be fine
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(raw))

    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED

    err = capsys.readouterr().err
    assert f"input file {data / 'c.npy'} changed: samples 12 there, 5 now" in err and "use --overwrite" in err
    assert "b.npy" not in err


# --- the exit statuses say what a scheduler should retry ---------------------------------------------------


def _retried(verdicts: dict[int, str]) -> set[int]:
    return {status for status, verdict in verdicts.items() if verdict.startswith("yes")}


def test_each_exit_status_says_whether_a_retry_can_help_and_the_airflow_recipe_retries_those_only():
    statuses = {cli.OK, cli.FAILED, cli.USAGE, cli.MISSING_EXTRA, cli.BUSY, cli.LOST, cli.INTERRUPTED, cli.TERMINATED}
    blocks = re.findall(r"^  (\d+) +(.*?)(?=^  \d+ |\Z)", cli.EXIT_STATUSES, re.M | re.S)
    help_verdicts = {int(status): re.search(r"Retry: (\w+)", text).group(1) for status, text in blocks if status != "0"}
    assert set(help_verdicts) | {cli.OK} == statuses
    docs = Path(__file__).parent.parent / "docs"
    rows = re.findall(r"^\| (\d+) \|.*\| ([^|]*) \|$", (docs / "usage.md").read_text(), re.M)
    table = {int(status): verdict.strip() for status, verdict in rows if status != "0"}
    assert set(table) | {cli.OK} == statuses
    assert _retried(help_verdicts) == _retried(table) == {cli.BUSY, cli.LOST, cli.INTERRUPTED, cli.TERMINATED}
    recipe = re.search(r"^RETRY = (\{.*\})$", (docs / "remote-and-runners.md").read_text(), re.M).group(1)
    assert set(ast.literal_eval(recipe)) == _retried(table)  # the Airflow task fails at once on the others
