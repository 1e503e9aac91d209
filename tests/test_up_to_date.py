"""A rerun with nothing to do (``pipeline.up_to_date``): it writes the manifest a full rerun that computes
nothing writes, and leaves every other file byte for byte; anything the full plan would act on (an input
file added, gone, grown or touched, another config or model, a shard, view or table written after the
manifest, a stopped run's files, other versions, --overwrite) makes the run plan in full."""

import json
import logging
import os
import shutil
from pathlib import Path

import keras
import numpy as np
import pytest

from jacobeam.pipeline import config, plan, runner, up_to_date
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.errors import JacobeamError
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_images import as_samples, write_images

SIZES = {"b": 13, "a": 7, "c": 20, "ünï": 3}  # 43 samples: not a multiple of the 16-sample shards
VOLATILE = ("created_at",)  # and run.id, run.wall_seconds: when and by whom, not what


def _save_model(path: Path, scale: float = 1.0) -> Path:
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    model.set_weights([scale * rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
    model.save(path)
    return path


def _write(data: Path, name: str, rows: int, seed: int) -> np.ndarray:
    data.mkdir(parents=True, exist_ok=True)
    array = np.random.default_rng(seed).normal(size=(rows, 12)).astype(np.float32)
    np.save(data / f"{name}.npy", array)
    return array


def _raw(root: Path, **jacobian) -> dict:
    return {
        "model": {"path": str(root / "model.keras")},
        "input": {"paths": [str(root / "data" / "*.npy")], "on_bad_sample": "skip"},
        "jacobian": {"batch_size": 8, "threads": 1, **jacobian},
        "output": {"path": str(root / "out"), "samples_per_shard": 16},
    }


def _run(raw: dict) -> dict:
    return runner.run(config.validate(raw), [], show_progress=False).manifest


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in ("manifest.json", ".jacobeam-lease.json")}


def _what(manifest: dict) -> dict:
    kept = {key: value for key, value in manifest.items() if key not in VOLATILE}
    return {**kept, "run": {k: v for k, v in manifest["run"].items() if k not in ("id", "wall_seconds")}}


def _rerun_both_ways(raw: dict, out: Path, monkeypatch, caplog) -> dict:
    """A full rerun (the shortcut refused), then the shortcut's: the same manifest but for when and by
    whom, every other file untouched, and the manifest on disk the one returned."""
    with monkeypatch.context() as patched:
        patched.setattr(up_to_date, "why_not", lambda *args: "planned in full by the test")
        full = _run(raw)
    files = _files(out)
    with caplog.at_level(logging.INFO, logger="jacobeam.pipeline.runner"):
        fast = _run(raw)
    assert "nothing to do" in caplog.text
    assert _files(out) == files
    assert json.loads((out / "manifest.json").read_text()) == fast
    assert _what(fast) == _what(full)
    assert fast["run"]["samples_computed"] == 0 and fast["run"]["samples_kept"] == fast["num_rows"]
    assert fast["run"]["id"] != full["run"]["id"]
    return fast


def test_a_complete_folder_reruns_as_a_full_rerun_would(tmp_path, monkeypatch, caplog):
    """Aggregates and the self-check on; four files, one with a non-ASCII name."""
    for seed, (name, rows) in enumerate(SIZES.items()):
        _write(tmp_path / "data", name, rows, seed)
    _save_model(tmp_path / "model.keras")
    raw = _raw(tmp_path, aggregate=["mean"], self_check={"samples": 2})
    first = _run(raw)
    assert first["run"]["samples_computed"] == 43 and first["self_check"]["samples_checked"] > 0
    again = _rerun_both_ways(raw, tmp_path / "out", monkeypatch, caplog)
    assert again["aggregates"] == first["aggregates"] and again["self_check"]["samples_checked"] > 0
    assert again["engine"] == first["engine"] and first["engine"]["mode"]  # the engine that computed the shards
    assert verify(str(tmp_path / "out"), samples=4).ok


def test_after_files_were_added_removed_grown_and_rejected(tmp_path, monkeypatch, caplog):
    """A folder whose ids are in two segments (a file added sorts first), with a file gone (its ids
    removed), a file grown (two pieces, one stamp) and a file that cannot be read (skip): the table is
    not in path order, and the shortcut still finds it current."""
    data = tmp_path / "data"
    arrays = {name: _write(data, name, rows, seed) for seed, (name, rows) in enumerate(SIZES.items())}
    _save_model(tmp_path / "model.keras")
    raw = _raw(tmp_path)
    _run(raw)
    arrays["0new"] = _write(data, "0new", 5, 10)
    (data / "a.npy").unlink()
    del arrays["a"]
    arrays["c"] = np.concatenate([arrays["c"], np.random.default_rng(11).normal(size=(6, 12)).astype(np.float32)])
    np.save(data / "c.npy", arrays["c"])
    (data / "broken.npy").write_bytes(b"not an array")
    second = _run(raw)
    assert second["removed"]["count"] == 7 and second["rejected"]["unreadable_files"] == [str(data / "broken.npy")]
    assert len(second["id_segments"]) == 2
    again = _rerun_both_ways(raw, tmp_path / "out", monkeypatch, caplog)
    assert again["num_rows"] == sum(len(a) for a in arrays.values())
    assert verify(str(tmp_path / "out"), samples=4).ok


def test_image_folders_with_class_labels(tmp_path, monkeypatch, caplog):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, ["dog/d1.png", "cat/c1.png", "cat/c2.png", "dog/d2.png", "bird/b1.png"])
    raw = {"model": {"factory": "tests.models:small_cnn"}, "input": {"paths": [str(images)]},
           "jacobian": {"batch_size": 8, "outputs": "label", "labels": {"folders": True}},
           "output": {"path": str(out), "samples_per_shard": 2}}
    _run(raw)
    again = _rerun_both_ways(raw, out, monkeypatch, caplog)
    assert again["labels"]["class_names"] == ["bird", "cat", "dog"]
    import h5py

    with h5py.File(out / "jacobians.h5") as h5:
        stored, index = h5["jacobian"][:], h5["output_index"][:, 0]
    paths = sorted(pixels)
    classes = [["bird", "cat", "dog"].index(Path(p).parent.name) for p in paths]
    np.testing.assert_array_equal(index, classes)
    full = tape_loop(test_models.small_cnn(), as_samples({p: pixels[p] for p in paths}))
    assert_close(stored[:, 0], full[np.arange(len(paths)), classes], rtol=1e-5)


# --- what makes a rerun plan in full ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A complete folder (its inputs and model beside it) and a copy of it, times kept."""
    root = tmp_path_factory.mktemp("up_to_date")
    work = root / "work"
    for seed, (name, rows) in enumerate(SIZES.items()):
        _write(work / "data", name, rows, seed)
    _save_model(work / "model.keras")
    _run(_raw(work))
    shutil.copytree(work, root / "pristine", copy_function=shutil.copy2)
    return root


@pytest.fixture
def work(pristine):
    """The complete folder as it was after its run (files and their times), at the path its config names."""
    work = pristine / "work"
    shutil.rmtree(work)
    shutil.copytree(pristine / "pristine", work, copy_function=shutil.copy2)
    return work


def _later(path: Path) -> None:
    stamp = path.stat().st_mtime + 5
    os.utime(path, (stamp, stamp))


def _edit_manifest(out: Path, edit) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def _a_shard(out: Path) -> Path:
    return sorted((out / "shards").iterdir())[1]


MUTATIONS = {
    "an input touched": (lambda w: _later(w / "data" / "a.npy"), "data/a.npy is new or changed"),
    "an input rewritten": (lambda w: _write(w / "data", "b", 13, 99), "data/b.npy is new or changed"),
    "an input grown": (lambda w: _write(w / "data", "c", 21, 2), "data/c.npy is new or changed"),
    "an input added": (lambda w: _write(w / "data", "d", 2, 5), "5 input files listed, 4 recorded"),
    "an input gone": (lambda w: (w / "data" / "b.npy").unlink(), "3 input files listed, 4 recorded"),
    "another model": (lambda w: _save_model(w / "model.keras", scale=2.0), "another model"),
    "jacobians.h5 gone": (lambda w: (w / "out" / "jacobians.h5").unlink(), "jacobians.h5 is missing or changed"),
    "jacobians.h5 written after": (lambda w: _later(w / "out" / "jacobians.h5"), "jacobians.h5 is missing or changed"),
    "inputs.h5 written after": (lambda w: _later(w / "out" / "inputs.h5"), "inputs.h5 is missing or changed"),
    "rejected.jsonl gone": (lambda w: (w / "out" / "rejected.jsonl").unlink(), "rejected.jsonl is missing"),
    "a shard gone": (lambda w: _a_shard(w / "out").unlink(), "not those of every range"),
    "a shard written after": (lambda w: _later(_a_shard(w / "out")), "changed after the manifest"),
    "a shard of another range": (
        lambda w: shutil.copy2(_a_shard(w / "out"), w / "out" / "shards" / "shard-000000000064-000000000080.h5"),
        "not those of every range"),
    "a stopped run's shard": (
        lambda w: (w / "out" / "shards" / ".shard-000000000000-000000000016.h5.tmp-abc123-0f").write_bytes(b"half"),
        "a stopped run's files"),
    "a stopped run's table": (lambda w: shutil.copy2(w / "out" / "inputs.h5", w / "out" / "inputs.previous.h5"),
                              "a stopped run's files"),
    "other library versions": (
        lambda w: _edit_manifest(w / "out", lambda m: m["versions"].update(numpy="1.0.0")), "other library versions"),
    "another jacobeam": (lambda w: _edit_manifest(w / "out", lambda m: m.update(jacobeam_version="0.0.1")),
                         "another version of jacobeam"),
    "another shard digest": (
        lambda w: _edit_manifest(w / "out", lambda m: m["shards"][1].update(samples_sha256="0" * 64)),
        "is not the shard the manifest lists"),
}


def _planned(work: Path, raw: dict | None = None, **options) -> tuple[object, str]:
    """What ``plan_run`` makes of the folder (a ``Job``, ``UpToDate``, or the error the full plan raised)
    and why it did not find it up to date."""
    logger = logging.getLogger("jacobeam.pipeline.plan")
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        planned = plan.plan_run(config.validate(raw or _raw(work)), check_model=False, **options)
    except JacobeamError as err:
        planned = err
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    why = next((line for line in records if line.startswith("planning the run in full")), "")
    return planned, why


def test_the_untouched_folder_is_up_to_date(work):
    planned, why = _planned(work)
    assert isinstance(planned, plan.UpToDate), why
    assert planned.files == 4 and len(planned.manifest["shards"]) == 3


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_change_plans_the_run_in_full(work, mutation):
    change, reason = MUTATIONS[mutation]
    change(work)
    planned, why = _planned(work)
    assert not isinstance(planned, plan.UpToDate)
    assert reason in why


def test_another_config_or_overwrite_plans_in_full(work):
    planned, why = _planned(work, _raw(work, threads=2))  # not the run's identity, but its config
    assert isinstance(planned, plan.Job) and "another config" in why
    planned, why = _planned(work, overwrite=True)
    assert isinstance(planned, plan.Job) and planned.complete  # the same run: its shards kept, planned in full
    planned, why = _planned(work, shortcut=False)  # a caller's pipeline: it runs the job
    assert isinstance(planned, plan.Job) and planned.complete


def test_labels_from_a_table_plan_in_full(tmp_path):
    """A table's rows have no stamp of their own: a changed label is the full plan's to find."""
    images, out = tmp_path / "images", tmp_path / "out"
    write_images(images, ["d1.png", "c1.png", "c2.png"])
    (tmp_path / "labels.csv").write_text("file,label\nimages/d1.png,2\nimages/c1.png,1\nimages/c2.png,1\n")
    raw = {"model": {"factory": "tests.models:small_cnn"}, "input": {"paths": [str(images)]},
           "jacobian": {"batch_size": 8, "outputs": "label", "labels": {"table": str(tmp_path / "labels.csv")}},
           "output": {"path": str(out), "samples_per_shard": 2}}
    _run(raw)
    planned, why = _planned(tmp_path, raw)
    assert isinstance(planned, plan.Job) and "labels from a table" in why
