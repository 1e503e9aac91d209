"""The input files' table, ``inputs.h5``: what it holds against the files themselves, rows round-tripped
whatever their keys, the manifest's pointer to it, folders written before it (a manifest listing the
files) resumed and verified, and a changed or missing table found by ``verify``."""

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import config, plan, runner
from jacobeam.pipeline.inspect_output import inspect
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.output import inputs_table
from jacobeam.transforms.spec import JobSpec, ModelSource, shard_inputs


def _config(data: Path, out: Path):
    return config.validate({
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": [str(data / "*.npy")]},
        "jacobian": {"batch_size": 4, "self_check": {"samples": 0}},
        "output": {"path": str(out), "samples_per_shard": 16},
    })


def _write(folder: Path, sizes: dict[str, int], seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, size in sizes.items():
        np.save(folder / f"{name}.npy", rng.normal(size=(size, 12)).astype(np.float32))


def _run(data: Path, out: Path) -> dict:
    return runner.run(_config(data, out), [], show_progress=False).manifest


def _expected_rows(data: Path) -> list[tuple[str, int, int]]:
    """(path, first id, stop id) of each file, from the files themselves, sorted by path."""
    rows, first = [], 0
    for path in sorted(data.glob("*.npy")):
        count = len(np.load(path))
        rows.append((str(path), first, first + count))
        first += count
    return rows


def _to_old_format(out: Path) -> dict:
    """Make the folder what jacobeam wrote before ``inputs.h5``: the manifest lists the files itself."""
    manifest = json.loads((out / "manifest.json").read_text())
    with h5py.File(out / "inputs.h5") as h5:  # read directly, not through the module under test
        columns = {key: h5["columns"][key][()] for key in json.loads(h5.attrs["keys"])}
        missing = {key: h5["columns/missing"][key][()] for key in h5["columns/missing"]} if "missing" in h5["columns"] else {}
    count = manifest["input_files"]["count"]
    entries = []
    for i in range(count):
        entry = {}
        for key, column in columns.items():
            state = missing[key][i] if key in missing else 0
            if state == 2:
                continue
            value = column[i]
            entry[key] = None if state == 1 else value.decode() if isinstance(value, bytes) else value.item()
        entries.append(entry)
    del manifest["input_files"]
    manifest["inputs"] = entries
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (out / "inputs.h5").unlink()
    return manifest


def test_rows_round_trip_whatever_their_keys(tmp_path):
    rows = [
        {"path": "/d/α.npy", "key": None, "first_id": 0, "stop_id": 3, "num_samples": 3, "dtype": "float32",
         "data_sha256": None, "stamp": "10:1.5", "label": 2, "removed": False},
        {"path": "/d/b.npz", "key": {"image": "x", "meta": "m"}, "first_id": 3, "stop_id": 3, "num_samples": 0,
         "dtype": {"image": "float32", "meta": "float64"}, "data_sha256": "ab" * 32, "unreadable": "not a zip file",
         "removed": True},
        {"path": "/d/α.npy", "key": None, "first_id": 3, "stop_id": 5, "num_samples": 2, "first_row": 3,
         "dtype": "float32", "data_sha256": None, "stamp": "12:2.0", "label": None},
    ]
    pointer = inputs_table.write_table(str(tmp_path), iter(rows))
    path = tmp_path / "inputs.h5"
    assert pointer == {"file": "inputs.h5", "count": 3, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    table = inputs_table.read_table(str(path))
    assert len(table) == 3 and list(table) == rows and [table[i] for i in (2, -3)] == [rows[2], rows[0]]
    with pytest.raises(IndexError, match=r"inputs.h5: row 3 of 3"):
        table[3]
    with h5py.File(path) as h5:  # one column per key, of the values' own type
        columns = h5["columns"]
        assert columns["first_id"][()].tolist() == [0, 3, 3] and columns["first_id"].dtype == np.int64
        assert columns["removed"][()].tolist() == [False, True, False]
        assert columns["path"].asstr()[()].tolist() == ["/d/α.npy", "/d/b.npz", "/d/α.npy"]
        assert json.loads(columns["key"].asstr()[1]) == {"image": "x", "meta": "m"}
        assert columns["missing/label"][()].tolist() == [0, 2, 1]  # a value, absent, None


def test_a_run_writes_the_table_and_points_at_it(tmp_path):
    _write(tmp_path / "data", {"a": 7, "b": 13, "c": 20})
    manifest = _run(tmp_path / "data", tmp_path / "out")
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "inputs" not in on_disk and on_disk["input_files"] == manifest["input_files"]
    table = tmp_path / "out" / "inputs.h5"
    assert manifest["input_files"] == {"file": "inputs.h5", "count": 3,
                                       "sha256": hashlib.sha256(table.read_bytes()).hexdigest()}
    rows = inputs_table.folder_inputs(tmp_path / "out")
    assert [(row["path"], row["first_id"], row["stop_id"]) for row in rows] == _expected_rows(tmp_path / "data")
    stamps = [f"{p.stat().st_size}:{p.stat().st_mtime!r}" for p in sorted((tmp_path / "data").glob("*.npy"))]
    assert [row["stamp"] for row in rows] == stamps
    assert verify(tmp_path / "out").ok
    report = inspect(str(tmp_path / "out"))
    assert report.problems == [] and report.stale == [] and json.dumps(report.as_dict())  # JSON as the manifest is


def test_a_folder_written_before_the_table_resumes_extends_and_verifies(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, {"a": 7, "b": 13})
    _run(data, out)
    old = _to_old_format(out)
    assert [(e["path"], e["first_id"], e["stop_id"]) for e in old["inputs"]] == _expected_rows(data)
    assert verify(out).ok  # as it is: its manifest lists the files

    again = _run(data, out)  # nothing to do; the new manifest points at a table again
    assert again["run"]["samples_computed"] == 0 and "inputs" not in again
    assert [(r["path"], r["first_id"], r["stop_id"]) for r in inputs_table.folder_inputs(out)] == _expected_rows(data)

    _to_old_format(out)
    _write(data, {"0": 5}, seed=1)  # sorts first, yet placed after the old files' ids
    extended = _run(data, out)
    assert extended["run"]["samples_computed"] == 5 and extended["num_samples"] == 25
    rows = [(Path(r["path"]).name, r["first_id"], r["stop_id"]) for r in inputs_table.folder_inputs(out)]
    assert rows == [("a.npy", 0, 7), ("b.npy", 7, 20), ("0.npy", 20, 25)]
    assert verify(out, samples=2).ok


def test_verify_finds_a_changed_or_missing_table(tmp_path):
    _write(tmp_path / "data", {"a": 7})
    out = tmp_path / "out"
    _run(tmp_path / "data", out)
    with h5py.File(out / "inputs.h5", "a") as h5:
        h5["columns/first_id"][0] = 1
    report = verify(out)
    assert not report.ok and "inputs.h5: sha256 differs from the manifest's (the file was changed)" in report.problems
    (out / "inputs.h5").unlink()
    report = verify(out)
    assert report.problems == ["inputs.h5: missing (the manifest lists the input files there)"]
    assert inspect(str(out)).problems == ["inputs.h5 is missing"]
    with pytest.raises(Exception, match=r"manifest.json lists its input files in inputs.h5, which cannot be read"):
        plan.make_job(_config(tmp_path / "data", out), check_model=False, identify_model=False)


def test_overwrite_removes_the_table_and_a_foreign_one_is_refused(tmp_path):
    _write(tmp_path / "data", {"a": 7})
    out = tmp_path / "out"
    _run(tmp_path / "data", out)
    job = plan.make_job(_config(tmp_path / "data", out), check_model=False, identify_model=False)
    assert str(out / "inputs.h5") not in job.remove  # a resumed folder keeps it
    (out / "manifest.json").unlink()
    (out / "inputs.h5").write_bytes(b"not jacobeam's")
    with pytest.raises(Exception, match=r"inputs.h5 — jacobeam uses these names, but did not write these files"):
        plan.make_job(_config(tmp_path / "data", out), check_model=False, identify_model=False)


def test_shard_inputs_finds_the_files_of_a_range_among_many():
    """``shard_inputs`` (bisecting the files by id) against a scan of every file."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 4, 500)
    files, first = [], 0
    for i, size in enumerate(sizes):
        files.append(SourceFile(path=f"/d/{i:04d}.npy", key=None, num_samples=int(size), sample_shape=(2,),
                                dtype="float32", first_id=first))
        first += int(size)
    shuffled = [files[i] for i in rng.permutation(len(files))]  # not in id order: every file is looked at
    for given in (tuple(files), shuffled):
        spec = JobSpec(model=ModelSource(builtin="mlp"), files=given, output_dir="/o", run_key="k")
        for start in range(0, first, 7):
            for stop in (start + 1, start + 7, start + 100):
                scanned = [[f.path, f.key, f.first_id, f.num_samples, f.data_sha256] for f in given
                           if f.num_samples and f.first_id < stop and start < f.first_id + f.num_samples]
                assert shard_inputs(spec.files, start, stop) == scanned, (start, stop)


def test_the_local_listing_finds_what_beams_finds(tmp_path):
    from apache_beam.io.filesystems import FileSystems

    from jacobeam.pipeline.discover import _local_match, _stamp

    for name in ("a.npy", "b.npz", "d1/c.npy", "d1/e/f.npy", "d2/g.npy", "d2/h.png", "x[1].npy"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * len(name))
    for pattern in ("*.npy", "d*/*.npy", "**", "**/*.npy", "d1/", "a.npy", "missing/*.npy", "d?/*", "[ab].np*"):
        full = f"{tmp_path}/{pattern}"
        (beam,) = FileSystems.match([full])
        assert _local_match(full) == {m.path: _stamp(m) for m in beam.metadata_list}, pattern


def test_npy_headers_are_described_as_describe_does(tmp_path):
    from jacobeam.pipeline.discover import resolve_inputs
    from jacobeam.transforms.errors import InputError
    from jacobeam.transforms.inputs.readers import describe

    data = tmp_path / "data"
    data.mkdir()
    for i, (shape, dtype) in enumerate([((1, 4), "<f4"), ((3, 4), "<f4"), ((1, 4), "<f4"), ((2, 4), "<f8"), ((1, 4), ">f4")]):
        np.save(data / f"{i}.npy", np.zeros(shape, dtype))
    np.lib.format.write_array((data / "5.npy").open("wb"), np.zeros((2, 4), "<f4"), version=(2, 0))
    files = resolve_inputs([str(data / "*.npy")], None)
    stamps = {str(p): f"{p.stat().st_size}:{p.stat().st_mtime!r}" for p in data.glob("*.npy")}
    first = 0
    for source in files:
        expected = describe(source.path, None)
        assert (source.num_samples, source.sample_shape, source.dtype, source.first_id, source.stamp) == (
            expected.num_samples, expected.sample_shape, expected.dtype, first, stamps[source.path])
        first += source.num_samples
    assert [f.num_samples for f in files] == [1, 3, 1, 2, 1, 2]
    np.save(data / "6.npy", np.zeros((1, 4), np.int32))  # the same check as describe's, with its message
    with pytest.raises(InputError, match=r"6.npy: dtype int32; expected a float array"):
        resolve_inputs([str(data / "*.npy")], None)


def test_a_rerun_reads_no_header_of_a_file_whose_stamp_is_unchanged(tmp_path, monkeypatch):
    import os

    from jacobeam.pipeline import discover

    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, {"a": 7, "b": 13, "c": 20})
    _run(data, out)
    fresh = plan.make_job(_config(data, tmp_path / "elsewhere"), check_model=False, identify_model=False).spec.files
    read = []
    monkeypatch.setattr(discover._NpyHeaders, "describe", lambda self, path, stamp: read.append(path))
    job = plan.make_job(_config(data, out), check_model=False, identify_model=False)
    assert read == [] and job.spec.files == fresh and job.complete
    os.utime(data / "b.npy", ns=(1, 1))  # another stamp: described again, its shards stale
    monkeypatch.undo()
    real = discover._NpyHeaders.describe
    monkeypatch.setattr(discover._NpyHeaders, "describe", lambda self, path, stamp: read.append(path) or real(self, path, stamp))
    job = plan.make_job(_config(data, out), check_model=False, identify_model=False)
    assert read == [str(data / "b.npy")] and job.spec.stale == ("shard-000000000000-000000000016.h5",
                                                                "shard-000000000016-000000000032.h5")


def test_a_spec_pickles_its_files_once_and_another_process_reads_them(tmp_path):
    """Beam pickles the spec into every step: the files travel as one blob, and a process that holds
    them takes its own copy; one that does not (a worker process) decodes them."""
    import pickle
    import subprocess
    import sys

    files = tuple(SourceFile(path=f"/d/{i:03d}.npy", key=None, num_samples=2, sample_shape=(3,), dtype="float32",
                             first_id=2 * i, stamp=f"{i}:1.5") for i in range(300))
    spec = JobSpec(model=ModelSource(builtin="mlp"), files=files, output_dir="/o", run_key="k", stale=("x.h5",))
    blob = pickle.dumps(spec)
    assert len(blob) < len(pickle.dumps(files, protocol=pickle.HIGHEST_PROTOCOL)) / 4  # compressed
    back = pickle.loads(blob)
    assert back == spec and back.files is files and back.stale == ("x.h5",)
    (tmp_path / "spec.pkl").write_bytes(blob)
    code = ("import pickle, sys; spec = pickle.load(open(sys.argv[1], 'rb')); "
            "print(len(spec.files), spec.files[7].path, spec.files[-1].stop_id, spec.run_key)")
    shown = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spec.pkl")], capture_output=True, text=True,
                           check=True).stdout.split()
    assert shown == ["300", "/d/007.npy", "600", "k"]
