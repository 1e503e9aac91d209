"""Bad data under both policies (input.on_bad_sample), non-finite Jacobians, and the checks made before
the pipeline starts: each case either stops the run with one line naming file and row (before any
output where the headers tell, else in the worker that reads the sample, keeping the complete shards),
or is skipped and listed."""

import errno
import json
import re
import zipfile

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.output.inputs_table import folder_inputs
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_pipeline import folder_state

SIZES = {"a": 7, "b": 13, "c": 20}  # b is the file each case damages


def _good(folder, rng):
    arrays = {name: rng.normal(size=(size, 12)).astype(np.float32) for name, size in SIZES.items()}
    np.save(folder / "a.npy", arrays["a"])
    np.save(folder / "c.npy", arrays["c"])
    return arrays


def _truncate(path, keep_bytes):
    path.write_bytes(path.read_bytes()[:keep_bytes])


def make_case(folder, case, rng):
    """Write a.npy and c.npy (good) and a damaged b; returns (arrays, the expected rejected lines as
    (id, file name, row, reason pattern), the error pattern under on_bad_sample: error)."""
    folder.mkdir()
    arrays = _good(folder, rng)
    b = arrays["b"]
    if case == "nan":
        b[3, 5] = np.nan
        np.save(folder / "b.npy", b)
        return arrays, [(10, "b.npy", 3, r"non-finite input: holds NaN")], r"b.npy: row 3: non-finite input: holds NaN"
    if case == "inf":
        b[5, 0], b[6, 1], b[6, 2] = -np.inf, np.inf, np.nan
        np.save(folder / "b.npy", b)
        return arrays, [
            (12, "b.npy", 5, r"holds Inf$"), (13, "b.npy", 6, r"holds NaN and Inf"),
        ], r"b.npy: row 5: non-finite input: holds Inf \(input.on_bad_sample is error"
    if case == "truncated npy":
        np.save(folder / "b.npy", b)
        size = (folder / "b.npy").stat().st_size
        _truncate(folder / "b.npy", size - 4 * 12 * 3 - 10)  # rows 9..12 incomplete
        return arrays, [(7 + row, "b.npy", row, r"truncated") for row in range(9, 13)], r"b.npy: row 9: truncated"
    if case == "corrupt npy":
        (folder / "b.npy").write_bytes(b"\x93NUMPY garbage that is not a header")
        return arrays, [(None, "b.npy", None, r"corrupt: not a valid .npy array")], r"b.npy: not a valid .npy array"
    if case == "corrupt npz":
        np.savez_compressed(folder / "b.npz", x=b)
        raw = bytearray((folder / "b.npz").read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # inside the compressed member: its CRC no longer matches
        (folder / "b.npz").write_bytes(bytes(raw))
        # A member this small is decompressed whole to read its header: the plan finds it unreadable.
        return arrays, [(None, "b.npz", None, r"corrupt: (Bad CRC-32|Error -3)")], r"b.npz\[x\]: cannot be read"
    if case == "truncated h5":
        with h5py.File(folder / "b.h5", "w") as h5:
            h5["x"] = b
        _truncate(folder / "b.h5", (folder / "b.h5").stat().st_size // 2)
        return arrays, [(None, "b.h5", None, r"corrupt: not a valid HDF5 file")], r"b.h5: not a valid HDF5 file"
    if case == "unreadable":
        np.save(folder / "b.npy", b)  # opening it fails with an I/O error (see the monkeypatch below)
        return arrays, [(None, "b.npy", None, r"unreadable: .*Input/output error")], r"b.npy: cannot open: .*Input/output error"
    raise AssertionError(case)


CASES = ["nan", "inf", "truncated npy", "corrupt npy", "corrupt npz", "truncated h5", "unreadable"]
AT_PLAN = {"corrupt npy", "corrupt npz", "truncated h5", "unreadable"}  # told by the headers, before any output


def _config(data, out, policy, **output):
    return config.validate(
        {
            "model": {"factory": "tests.models:small_mlp"},
            "input": {"paths": [str(data / "*")], "key": None, "on_bad_sample": policy},
            "jacobian": {"batch_size": 4},
            "output": {"path": str(out), "samples_per_shard": 8, **output},
        }
    )


@pytest.fixture
def unreadable_b(monkeypatch):
    """Make opening any file named b.npy fail as a failing disk does (EIO), where input files are opened
    (``storage.open_input``: a local one with ``open``, as Beam's local file system does)."""
    from jacobeam.transforms.output import storage

    def flaky_open(path, *args, **kwargs):
        if str(path).endswith("/b.npy"):
            raise OSError(errno.EIO, "Input/output error", path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(storage, "open", flaky_open, raising=False)


@pytest.mark.parametrize("case", CASES)
def test_bad_data_under_error_stops_the_run_naming_file_and_row(case, tmp_path, rng, capsys, request):
    """A file whose headers are bad stops the plan, before any output; a bad sample stops the worker that
    reads it: the shards complete by then stay (a.npy's ids 0..7 here), nothing else is written."""
    if case == "unreadable":
        request.getfixturevalue("unreadable_b")
    make_case(tmp_path / "data", case, rng)
    _, _, message = make_case(tmp_path / "again", case, np.random.default_rng(0))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    before = folder_state(out)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(tmp_path / "data", out, "error").model_dump(mode="json")))

    status = cli.main(["-q", "run", str(cfg)])

    err = capsys.readouterr().err
    assert status == cli.FAILED, err
    line = err.strip().splitlines()[-1] if "Traceback" not in err else err
    assert re.search(r"^jacobeam: error: .*" + message, err, re.M), err
    assert str(tmp_path / "data") in line  # the full path of the file
    after = folder_state(out)
    if case in AT_PLAN:
        assert after == before  # nothing written, nothing removed
        return
    assert after["notes.txt"] == before["notes.txt"] and "manifest.json" not in after  # the user's file kept
    # The ranges of 8 before the first bad sample's.
    first_bad = {"nan": 10, "inf": 12, "truncated npy": 16}[case]
    complete = [f"shards/shard-{lo:012d}-{lo + 8:012d}.h5" for lo in range(0, first_bad - first_bad % 8, 8)]
    assert sorted(name for name in after if name.startswith("shards/shard-")) == complete


@pytest.mark.parametrize("case", CASES)
def test_bad_data_under_skip_is_left_out_listed_and_ids_stay(case, tmp_path, rng, request):
    if case == "unreadable":
        request.getfixturevalue("unreadable_b")
    arrays, expected, _ = make_case(tmp_path / "data", case, rng)
    out = tmp_path / "out"

    manifest = runner.run(_config(tmp_path / "data", out, "skip"), [], show_progress=False).manifest

    # rejected.jsonl lists exactly the expected samples, with file, row and reason.
    lines = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["id"], r["file"].rsplit("/", 1)[1], r["row"]) for r in lines] == [e[:3] for e in expected]
    for record, (_, _, _, reason) in zip(lines, expected):
        assert re.search(reason, record["reason"]), record
    rejected_ids = {e[0] for e in expected if e[0] is not None}
    b_has_ids = expected[0][0] is not None
    # Ids: positions in a, b, c; a file that cannot be opened at all holds no samples, hence no ids.
    b_len = SIZES["b"] if b_has_ids else 0
    inputs = {entry["path"].rsplit("/", 1)[1]: (entry["first_id"], entry["stop_id"]) for entry in folder_inputs(out)}
    assert inputs["a.npy"] == (0, 7) and inputs["c.npy"] == (7 + b_len, 27 + b_len)
    num_samples = 27 + b_len
    assert manifest["num_samples"] == num_samples
    assert manifest["rejected"]["count"] == len(rejected_ids)
    assert manifest["num_rows"] == num_samples - len(rejected_ids)
    # The stored rows are exactly the other samples, with their own ids and correct Jacobians.
    kept_ids = np.array([i for i in range(num_samples) if i not in rejected_ids])
    samples = np.concatenate([arrays["a"], arrays["b"][: SIZES["b"] if b_has_ids else 0], arrays["c"]])[kept_ids]
    with h5py.File(out / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], kept_ids)
        assert not view["nonfinite"][:].any()
        assert_close(view["jacobian"][:], tape_loop(test_models.small_mlp(), samples), rtol=1e-5)
    assert verify(out, samples=3).ok


def test_rejected_samples_are_absent_from_shards_and_resume_keeps_the_gaps(tmp_path, rng):
    """A whole shard's range rejected: a shard of no rows for it, its mark of completion (and its list of
    rejected samples); a rerun computes nothing and agrees."""
    data = tmp_path / "data"
    data.mkdir()
    x = rng.normal(size=(24, 12)).astype(np.float32)
    x[8:16] = np.nan  # exactly the second range of 8
    x[20] = np.inf
    np.save(data / "x.npy", x)
    out = tmp_path / "out"
    first = runner.run(_config(data, out, "skip"), [], show_progress=False).manifest
    assert [(s["start"], s["stop"], s["num_samples"], s["rejected"]) for s in first["shards"]] == [
        (0, 8, 8, 0), (8, 16, 0, 8), (16, 24, 7, 1)
    ]
    assert first["rejected"]["ids"] == [[8, 16], [20, 21]]
    again = runner.run(_config(data, out, "skip"), [], show_progress=False).manifest
    assert again["run"]["samples_computed"] == 0
    assert [s["crc32c"] for s in again["shards"]] == [s["crc32c"] for s in first["shards"]]
    with h5py.File(out / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], [*range(8), 16, 17, 18, 19, 21, 22, 23])


def test_all_samples_bad_is_an_error_without_a_manifest(tmp_path):
    """Which samples are bad, the workers find: the run fails at its end, and writes no result."""
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", np.full((5, 12), np.nan, np.float32))
    with pytest.raises(Exception, match=r"all 5 samples are rejected; nothing to compute \(.*x.npy: row 0: non-finite"):
        runner.run(_config(data, tmp_path / "out", "skip"), [], show_progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / "jacobians.h5").exists()


def _nan_jacobian_model():
    """x[4] -> sqrt(x^2 + x): finite for finite x, but its derivative is infinite where x^2 + x == 0."""
    import keras

    inputs = keras.Input((4,))
    outputs = keras.layers.Lambda(lambda x: keras.ops.sqrt(x * x + x))(inputs)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_nonfinite_jacobians_from_finite_inputs_are_flagged_and_counted(tmp_path, monkeypatch, mode):
    """Verify recomputes in the run's own mode: at sqrt(0) reverse mode puts NaN in other places of
    the Jacobian than forward mode does, and the reference must fail where the run did."""
    monkeypatch.setattr(test_models, "nan_jacobian_model", _nan_jacobian_model, raising=False)
    data = tmp_path / "data"
    data.mkdir()
    x = np.full((10, 4), 2.0, np.float32)
    x[3, 1] = 0.0  # sqrt'(0): inf
    x[7, :] = -1.0  # x^2 + x == 0 everywhere
    np.save(data / "x.npy", x)
    cfg = config.validate(
        {
            "model": {"factory": "tests.models:nan_jacobian_model"},
            "input": {"paths": [str(data / "*.npy")]},
            "jacobian": {"batch_size": 4, "mode": mode},
            "output": {"path": str(tmp_path / "out"), "samples_per_shard": 6},
        }
    )
    manifest = runner.run(cfg, [], show_progress=False).manifest
    assert manifest["engine"]["mode"] == mode
    assert manifest["nonfinite"]["count"] == 2
    assert [s["nonfinite"] for s in manifest["shards"]] == [1, 1]
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        mask = view["nonfinite"][:]
        np.testing.assert_array_equal(np.flatnonzero(mask), [3, 7])
        jac = view["jacobian"][:]
        assert np.isfinite(jac[~mask]).all() and not np.isfinite(jac[mask]).all()
        np.testing.assert_allclose(jac[0], np.diag(np.full(4, 5 / (2 * np.sqrt(6)))), rtol=1e-6)
        # At x_1 = 0, sqrt's derivative is infinite: reverse mode gets NaN at (1, 1) alone, forward mode
        # NaN or inf along row 1 (each column's JVP multiplies the infinity by 0 or 1).
        expected = np.zeros((4, 4), bool)
        expected[1, 1 if mode == "reverse" else slice(None)] = True
        np.testing.assert_array_equal(~np.isfinite(jac[3]), expected)
    assert manifest["rejected"]["count"] == 0  # the inputs were fine: flagged, not rejected
    report = verify(tmp_path / "out", samples=10)
    assert report.ok, report.problems


# --- checks before the pipeline starts --------------------------------------------------------------------


def test_samples_the_model_cannot_take_are_refused_naming_the_file(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", np.zeros((4, 8), np.float32))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(data, tmp_path / "out", "error").model_dump(mode="json")))
    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED
    err = capsys.readouterr().err
    assert re.search(r"expects samples of shape \(12,\); the inputs hold samples of shape \(8,\) \(.*/data/x.npy\)", err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where, message", [
    ("file", r"output.path .*/taken: exists and is not a folder"),
    ("below a file", r"output.path .*/taken/out: cannot create the folder"),
])
def test_output_folder_that_cannot_be_written_is_refused_first(tmp_path, capsys, where, message):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", np.zeros((4, 12), np.float32))
    (tmp_path / "taken").write_text("a file, not a folder")
    out = tmp_path / "taken" if where == "file" else tmp_path / "taken" / "out"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(data, out, "error").model_dump(mode="json")))
    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED
    assert re.search(message, capsys.readouterr().err)
    assert (tmp_path / "taken").read_text() == "a file, not a folder"


def test_keras_file_with_code_is_refused_and_imports_nothing(tmp_path, monkeypatch):
    """safe_mode stays on: neither a pickled lambda nor a module named in the file's config runs."""
    import keras

    from jacobeam.transforms.engine.models import load
    from jacobeam.transforms.errors import ModelError

    lam = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(lambda x: x * 2)])
    lam.save(tmp_path / "lambda.keras")
    with pytest.raises(ModelError, match=r"lambda.keras: refused: loading it would run Python code .*model.factory"):
        load(path=str(tmp_path / "lambda.keras"))

    # A file whose config names a layer class in an importable module: Keras must not import it.
    marker = tmp_path / "IMPORTED"
    (tmp_path / "jacobeam_test_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    plain.save(tmp_path / "plain.keras")
    with zipfile.ZipFile(tmp_path / "plain.keras") as source, zipfile.ZipFile(tmp_path / "evil.keras", "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                cfg = json.loads(data)
                layer = cfg["config"]["layers"][1]
                layer.update(module="jacobeam_test_evil", class_name="Evil", registered_name="jacobeam_test_evil>Evil")
                data = json.dumps(cfg).encode()
            target.writestr(item, data)
    with pytest.raises(ModelError, match=r"evil.keras: cannot load"):
        load(path=str(tmp_path / "evil.keras"))
    assert not marker.exists()


def test_skip_with_aggregates_and_a_fully_rejected_range(tmp_path, rng):
    """Aggregates sum over stored samples only; a range without a shard contributes no partial sums."""
    data = tmp_path / "data"
    data.mkdir()
    x = rng.normal(size=(24, 12)).astype(np.float32)
    x[8:16] = np.nan
    np.save(data / "x.npy", x)
    cfg = _config(data, tmp_path / "out", "skip").model_dump(mode="json")
    cfg["jacobian"]["aggregate"] = ["mean", "mean_abs"]
    manifest = runner.run(config.validate(cfg), [], show_progress=False).manifest
    kept = np.r_[0:8, 16:24]
    reference = tape_loop(test_models.small_mlp(), x[kept]).astype(np.float64)
    assert manifest["aggregates"]["count"] == 16
    with h5py.File(tmp_path / "out" / "aggregates.h5") as agg:
        np.testing.assert_allclose(agg["mean"][:], reference.mean(axis=0), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(agg["mean_abs"][:], np.abs(reference).mean(axis=0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad", [5.0, 2.5, -1.0])
def test_a_bad_label_follows_on_bad_sample_naming_file_and_row(bad, tmp_path, rng, capsys):
    """small_mlp has 5 outputs: a label 5, 2.5 or -1 is not an output index (float labels such as 3.0
    are). Under error the worker that reads it stops the run naming the file and row; under skip the
    sample is rejected, listed, and the others are computed with their own labels (the shard the
    stopped run completed is kept)."""
    data = tmp_path / "data"
    data.mkdir()
    x = rng.normal(size=(20, 12)).astype(np.float32)
    labels = rng.integers(0, 5, size=20).astype(np.float64)
    labels[13] = bad
    np.savez(data / "a.npz", x=x[:9], y=labels[:9])
    np.savez(data / "b.npz", x=x[9:], y=labels[9:])

    def cfg(policy):
        raw = _config(data, tmp_path / "out", policy).model_dump(mode="json")
        raw["input"]["key"] = "x"
        raw["jacobian"].update(outputs="label", labels={"key": "y"})
        return raw

    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(cfg("error")))
    status = cli.main(["-q", "run", str(path)])
    err = capsys.readouterr().err
    assert status == cli.FAILED, err
    assert re.search(rf"^jacobeam: error: .*b.npz: row 4: label {bad:g} is not an output index 0..4", err, re.M), err
    # Found by the worker reading ids 8..15: the range before it is complete, no result is written.
    assert sorted(p.name for p in (tmp_path / "out" / "shards").iterdir()) == ["shard-000000000000-000000000008.h5"]
    assert not (tmp_path / "out" / "manifest.json").exists()

    manifest = runner.run(config.validate(cfg("skip")), [], show_progress=False).manifest
    lines = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["id"], r["file"].rsplit("/", 1)[1], r["row"]) for r in lines] == [(13, "b.npz", 4)]
    assert manifest["num_rows"] == 19
    kept = np.array([i for i in range(20) if i != 13])
    full = tape_loop(test_models.small_mlp(), x[kept])
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], kept)
        np.testing.assert_array_equal(view["output_index"][:, 0], labels[kept])
        assert_close(view["jacobian"][:, 0], full[np.arange(19), labels[kept].astype(int)], rtol=1e-5)


def test_labels_of_npy_inputs_are_refused_naming_the_file(tmp_path, capsys):
    """A .npy file holds one array, its samples: jacobian.labels.key cannot name another one there (it used
    to read the samples as labels)."""
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", np.zeros((4, 12), np.float32))
    raw = _config(data, tmp_path / "out", "error").model_dump(mode="json")
    raw["jacobian"].update(outputs="label", labels={"key": "labels"})
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(raw))
    assert cli.main(["-q", "run", str(path)]) == cli.FAILED
    assert capsys.readouterr().err == (
        f"jacobeam: error: {data / 'x.npy'}: jacobian.labels.key 'labels': a .npy file holds one array, its "
        "samples; labels need a named array beside the samples, in .npz or .h5 files\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_complete_shard_whose_commit_is_still_queued_when_a_later_range_fails_is_committed(tmp_path, rng,
                                                                                             monkeypatch):
    """A worker's shard commits run on the writer's thread, behind its writes, while the next range is read
    and computed. A bad sample in that range stops the run; the shard before it is complete, so its queued
    commit finishes (the rerun keeps it) rather than being dropped with the error. The writer's thread is
    held up here so that the commit has surely not begun when the error comes."""
    import time

    from jacobeam.transforms.output import shard_writer

    original = shard_writer.ShardWriter.commit_later

    def late(writer, rows=None):
        if "000000000008-000000000016" in writer.name:  # the shard before the bad sample's range
            writer._jobs.put(lambda: time.sleep(2))  # its thread busy until the next range has failed
        return original(writer, rows)

    monkeypatch.setattr(shard_writer.ShardWriter, "commit_later", late)
    make_case(tmp_path / "data", "truncated npy", rng)
    out = tmp_path / "out"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(tmp_path / "data", out, "error").model_dump(mode="json")))
    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "shard-000000000000-000000000008.h5", "shard-000000000008-000000000016.h5"]
