"""TFRecord files of ``tf.train.Example`` as inputs: read in slices, the same id, shape and bad-sample
rules as array files, and Jacobians equal to a per-sample tape loop on the decoded values. Folders of
PNG/JPEG images: ``test_images.py``, with the helpers here."""

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import tensorflow as tf
import yaml

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs import tfrecords
from jacobeam.transforms.inputs.readers import describe, open_samples
from jacobeam.transforms.output.inputs_table import folder_inputs
from tests import models as test_models
from tests.reference import assert_close, tape_loop, tape_loop_inputs
from tests.test_pipeline import folder_state

SIZES = {"b": 13, "a": 7, "c": 20}  # written out of order: ids follow sorted path order


def example(**features: np.ndarray) -> bytes:
    return tf.train.Example(features=tf.train.Features(feature={
        name: tf.train.Feature(float_list=tf.train.FloatList(value=np.ravel(value))) for name, value in features.items()
    })).SerializeToString()


def write_tfrecord(path: Path, records: list[bytes]) -> None:
    with tf.io.TFRecordWriter(str(path), "GZIP" if path.name.endswith(".gz") else None) as writer:
        for record in records:
            writer.write(record)


def write_records(folder: Path, suffix: str, shape=(8, 8, 1), seed=0) -> np.ndarray:
    """Files of unequal length holding feature "pixels"; returns the samples in id order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {name: rng.normal(size=(n, *shape)).astype(np.float32) for name, n in SIZES.items()}
    for name, array in arrays.items():
        write_tfrecord(folder / f"{name}{suffix}", [example(pixels=x, other=np.zeros(2)) for x in array])
    return np.concatenate([arrays[name] for name in sorted(arrays)])


def job(paths, out: Path, factory="tests.models:small_cnn", **input_keys) -> dict:
    return {
        "model": {"factory": factory},
        "input": {"paths": paths, **input_keys},
        "jacobian": {"batch_size": 8},
        "output": {"path": str(out), "samples_per_shard": 16},
    }


def run(raw: dict) -> dict:
    return runner.run(config.validate(raw), [], show_progress=False).manifest


def view(out: Path) -> dict[str, np.ndarray]:
    with h5py.File(out / "jacobians.h5") as h5:
        return {name: h5[name][:] for name in ("jacobian", "output", "sample_id")}


def cli_error(raw: dict, tmp_path: Path, capsys, *overrides: str, status: int = cli.FAILED) -> str:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exited = cli.main(["-q", "run", str(cfg), *[arg for o in overrides for arg in ("--set", o)]])
    err = capsys.readouterr().err
    assert exited == status, err
    return err


# --- TFRecord ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".tfrecord", ".tfrecords", ".tfrecord.gz"])
def test_tfrecord_files_end_to_end(tmp_path, suffix):
    samples = write_records(tmp_path / "data", suffix)

    manifest = run(job([str(tmp_path / "data" / f"*{suffix}")], tmp_path / "out", key="pixels", sample_shape=[8, 8, 1]))

    stored = view(tmp_path / "out")
    np.testing.assert_array_equal(stored["sample_id"], np.arange(40))
    assert_close(stored["jacobian"], tape_loop(test_models.small_cnn(), samples), rtol=1e-5)
    assert [(Path(f["path"]).name, f["first_id"], f["stop_id"]) for f in folder_inputs(manifest["output_dir"])] == [
        (f"a{suffix}", 0, 7), (f"b{suffix}", 7, 20), (f"c{suffix}", 20, 40)
    ]
    assert manifest["input_shape"] == [8, 8, 1] and manifest["run_identity"]["input.sample_shape"] == [8, 8, 1]
    assert verify(tmp_path / "out", samples=3).ok


def test_tfrecord_slices_stream_past_earlier_records(tmp_path, monkeypatch):
    x = np.arange(600 * 3, dtype=np.float32).reshape(600, 3)
    write_tfrecord(tmp_path / "a.tfrecord", [example(v=row) for row in x])
    source = describe(str(tmp_path / "a.tfrecord"), "v", (3,))
    assert source.num_samples == 600
    pulled = []
    real = tfrecords._record_stream

    def counting(path, start=0):
        for record in real(path, start):
            pulled.append(record)
            yield record

    monkeypatch.setattr(tfrecords, "_record_stream", counting)
    with open_samples(source) as rows:
        np.testing.assert_array_equal(rows.read(100, 110), x[100:110])
        np.testing.assert_array_equal(rows.read(110, 130), x[110:130])  # continues the same stream
        assert len(pulled) == 30  # records before the slice are skipped inside TensorFlow, never parsed
        np.testing.assert_array_equal(rows.read(5, 7), x[5:7])  # an earlier slice starts a new stream


def test_several_inputs_from_tfrecord_features(tmp_path):
    rng = np.random.default_rng(3)
    samples = {"image": rng.normal(size=(11, 4, 4, 1)).astype(np.float32), "meta": rng.normal(size=(11, 3)).astype(np.float32)}
    (tmp_path / "data").mkdir()
    write_tfrecord(tmp_path / "data" / "a.tfrecord",
                   [example(img=samples["image"][i], m=samples["meta"][i]) for i in range(11)])
    raw = job([str(tmp_path / "data" / "*.tfrecord")], tmp_path / "out", "tests.models:two_inputs",
              key={"image": "img", "meta": "m"}, sample_shape={"image": [4, 4, 1], "meta": [3]})

    manifest = run(raw)

    expected = tape_loop_inputs(test_models.two_inputs("float64"), samples)
    with h5py.File(tmp_path / "out" / "jacobians.h5") as h5:
        assert_close(h5["jacobian/image"][:], expected["image"], rtol=1e-5)
        assert_close(h5["jacobian/meta"][:], expected["meta"], rtol=1e-5)
    assert manifest["input_shape"] == {"image": [4, 4, 1], "meta": [3]}
    assert verify(tmp_path / "out", samples=2).ok


def _bad_records(folder: Path) -> tuple[np.ndarray, list[tuple[int, int, str]]]:
    """a.tfrecord (5 good records) and b.tfrecord with bad records 1 (missing feature), 2 (wrong length),
    4 (NaN), 6 (not an Example) and a damaged 8th record, after which nothing can be located.
    Returns the good samples by id and the bad (id, record, reason pattern)."""
    folder.mkdir()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(13, 12)).astype(np.float32)
    write_tfrecord(folder / "a.tfrecord", [example(v=row) for row in x[:5]])
    b = x[5:].copy()
    b[4, 3] = np.nan
    records = [example(v=row) for row in b]
    records[1] = example(w=b[1])
    records[2] = example(v=b[2][:11])
    records[6] = b"not an Example"
    write_tfrecord(folder / "b.tfrecord", records)
    raw = bytearray((folder / "b.tfrecord").read_bytes())
    offset = sum(len(r) + 16 for r in records[:7]) + 12  # inside record 7's data: its checksum fails
    raw[offset] ^= 0xFF
    (folder / "b.tfrecord").write_bytes(bytes(raw))
    bad = [
        (6, 1, r"^feature 'v' is missing$"),
        (7, 2, r"^feature 'v' holds 11 values; expected 12 \(input.sample_shape \[12\]\)$"),
        (9, 4, r"^non-finite input: holds NaN$"),
        (11, 6, r"Could not parse example"),
        (12, 7, r"^corrupt: corrupted record at \d+"),
    ]
    return x, bad


def test_bad_records_under_error_stop_the_run_naming_file_and_record(tmp_path, capsys):
    _bad_records(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    before = folder_state(out)
    raw = job([str(tmp_path / "data" / "*.tfrecord")], out, "tests.models:small_mlp", key="v", sample_shape=[12])
    err = cli_error(raw, tmp_path, capsys)
    expected = r"^jacobeam: error: .*/data/b.tfrecord: row 1: feature 'v' is missing \(input.on_bad_sample is error"
    assert re.search(expected, err, re.M), err
    # Found by the worker reading the one range (ids 0..12): no shard is complete, no result written.
    after = folder_state(out)
    assert not [name for name in after if name.startswith("shards/shard-") or name == "manifest.json"], after
    assert {name: after[name] for name in before} == before


def test_bad_records_under_skip_are_left_out_and_listed(tmp_path):
    x, bad = _bad_records(tmp_path / "data")
    raw = job(
        [str(tmp_path / "data" / "*.tfrecord")],
        tmp_path / "out",
        "tests.models:small_mlp",
        key="v",
        sample_shape=[12],
        on_bad_sample="skip",
    )

    manifest = run(raw)

    lines = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["id"], Path(r["file"]).name, r["row"]) for r in lines] == [(i, "b.tfrecord", row) for i, row, _ in bad]
    for line, (_, _, reason) in zip(lines, bad):
        assert re.search(reason, line["reason"]), line
    assert manifest["num_samples"] == 13  # b's records up to the damaged one; what follows cannot be located
    kept = [i for i in range(13) if i not in {i for i, _, _ in bad}]
    stored = view(tmp_path / "out")
    np.testing.assert_array_equal(stored["sample_id"], kept)
    assert_close(stored["jacobian"], tape_loop(test_models.small_mlp(), x[kept]), rtol=1e-5)
    assert verify(tmp_path / "out", samples=3).ok


def test_tfrecord_needs_a_key_and_a_sample_shape_that_fit(tmp_path, capsys):
    write_records(tmp_path / "data", ".tfrecord", shape=(12,))
    paths = [str(tmp_path / "data" / "*.tfrecord")]
    out = tmp_path / "out"
    cases = [
        (
            job(paths, out, "tests.models:small_mlp", key="pixels"),
            r"a.tfrecord: a TFRecord file needs input.sample_shape",
        ),
        (job(paths, out, "tests.models:small_mlp", sample_shape=[12]), r"a.tfrecord: a TFRecord file needs input.key"),
        (
            job(paths, out, "tests.models:small_mlp", key="pixels", sample_shape=[3, 4]),
            r"small_mlp expects samples of shape \(12,\); the inputs hold samples of shape \(3, 4\)",
        ),
        (
            job(paths, out, "tests.models:small_mlp", key="pixels", sample_shape=[13]),
            # The plan reads no record: the model refuses the shape first (a record that does not hold
            # it is a bad sample the worker reading it names: test_bad_records_under_error_...).
            r"small_mlp expects samples of shape \(12,\); the inputs hold samples of shape \(13,\)",
        ),
        (
            job(
                paths,
                out,
                "tests.models:small_mlp",
                key="pixels",
                sample_shape=[12],
                on_bad_sample="error",
            )
            | {"jacobian": {"outputs": "label", "labels": {"key": "y"}}},
            r"a.tfrecord: jacobian.labels.key 'y': labels are not read from tfrecord files; labels need a named "
            r"array beside the samples, in .npz or .h5 files",
        ),
    ]
    for raw, message in cases:
        assert re.search(message, cli_error(raw, tmp_path, capsys)), message
    raw = job(paths, out, "tests.models:small_mlp", key="pixels", sample_shape={"x": [12]})
    assert re.search(r"input.sample_shape: a mapping by input name needs input.key to map the same inputs",
                     cli_error(raw, tmp_path, capsys, status=cli.USAGE))
    assert not out.exists()


def test_sample_shape_checks_array_files_too(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "a.npy", np.zeros((3, 12), np.float32))
    raw = job([str(tmp_path / "data" / "*.npy")], tmp_path / "out", "tests.models:small_mlp", sample_shape=[4, 3])
    assert re.search(
        r"a.npy: samples of shape \(12,\); expected \(4, 3\) \(input.sample_shape\)", cli_error(raw, tmp_path, capsys)
    )


@pytest.mark.parametrize("suffix", ["npy", "h5"])
def test_big_endian_samples_compute_and_verify_as_native_ones(tmp_path, suffix):
    """Samples stored big-endian (``>f4``): the same Jacobians as the native array's, and ``verify``'s
    re-hash of the inputs agrees with the workers' digest (it hashed the bytes as stored, the workers the
    native values: every shard was reported as computed from inputs changed since)."""
    x = np.random.default_rng(3).normal(size=(20, 8, 8, 1)).astype(np.float32)
    for name, dtype in (("native", "<f4"), ("big", ">f4")):
        (tmp_path / name).mkdir()
        if suffix == "npy":
            np.save(tmp_path / name / "a.npy", x.astype(dtype))
        else:
            with h5py.File(tmp_path / name / "a.h5", "w") as h5:
                h5.create_dataset("x", data=x.astype(dtype))
    keys = {"key": "x"} if suffix == "h5" else {}
    run(job([str(tmp_path / "native" / f"*.{suffix}")], tmp_path / "out_native", **keys))
    run(job([str(tmp_path / "big" / f"*.{suffix}")], tmp_path / "out_big", **keys))
    native, big = view(tmp_path / "out_native"), view(tmp_path / "out_big")
    for name in native:
        np.testing.assert_array_equal(big[name], native[name])
    report = verify(tmp_path / "out_big", samples=2, inputs="all")
    assert report.ok, report.problems


def _truncated_a(data: Path, rows_b: int, seed: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    """``data/a.npz`` (5 samples) cut in half, unreadable; returns its samples, ``rows_b`` more for a ``b.npz``
    (not written), and a.npz's whole bytes, to mend it with."""
    data.mkdir()
    rng = np.random.default_rng(seed)
    a, b = (rng.normal(size=(n, 8, 8, 1)).astype(np.float32) for n in (5, rows_b))
    np.savez(data / "a.npz", x=a)
    whole = (data / "a.npz").read_bytes()
    (data / "a.npz").write_bytes(whole[: len(whole) // 2])
    return a, b, whole


def test_a_file_unreadable_under_skip_then_mended_is_computed_as_a_new_file(tmp_path):
    """A truncated ``.npz`` left out under ``on_bad_sample: skip``, then written again whole: the rerun
    appends its samples (computed, after every old id) and keeps the rest. It was refused as another run's
    result, ``dtype "" there, "float32" now``; deleting the file, running and putting it back was the way."""
    data, out = tmp_path / "data", tmp_path / "out"
    a, b, whole = _truncated_a(data, 7, seed=4)
    np.savez(data / "b.npz", x=b)
    raw = job([str(data / "*.npz")], out, key="x", on_bad_sample="skip")
    first = run(raw)
    assert first["num_rows"] == 7
    kept = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}

    (data / "a.npz").write_bytes(whole)
    again = run(raw)

    assert again["num_rows"] == 12 and again["run"]["samples_computed"] == 5
    assert all((out / "shards" / name).read_bytes() == content for name, content in kept.items())
    stored = view(out)
    assert stored["sample_id"].tolist() == list(range(12))
    assert_close(stored["jacobian"], tape_loop(test_models.small_cnn(), np.concatenate([b, a])), rtol=1e-5)


def test_a_run_whose_every_sample_was_rejected_is_finished_once_its_files_are_mended(tmp_path):
    """Under skip, a truncated ``a.npz`` and a ``b.npz`` of NaNs: the run fails, nothing to compute, naming the
    unreadable file (it said ``row None``), and leaves its shards of rejected samples. Both files mended, the
    same command finishes it: a's samples now take the first ids, so b's shards are computed again. It was
    refused as another run's result."""
    data, out = tmp_path / "data", tmp_path / "out"
    a, b, whole = _truncated_a(data, 20, seed=5)
    np.savez(data / "b.npz", x=np.full_like(b, np.nan))
    raw = job([str(data / "*.npz")], out, key="x", on_bad_sample="skip")
    with pytest.raises(InputError, match=rf"all 20 samples are rejected; nothing to compute \({data / 'a.npz'}: ") as found:
        run(raw)
    assert "row None" not in str(found.value)
    assert list((out / "shards").glob("*.h5"))

    (data / "a.npz").write_bytes(whole)
    np.savez(data / "b.npz", x=b)
    manifest = run(raw)

    assert manifest["num_rows"] == 25 and manifest["run"]["samples_computed"] == 25
    assert_close(view(out)["jacobian"], tape_loop(test_models.small_cnn(), np.concatenate([a, b])), rtol=1e-5)


def test_a_record_whose_data_fails_its_checksum_is_bad_alone(tmp_path):
    """A TFRecord record damaged inside its data (its length header sound) is rejected, and the records after
    it are read: docs/inputs.md said every record from it on was bad."""
    folder = tmp_path / "data"
    folder.mkdir()
    x = np.random.default_rng(6).normal(size=(8, 12)).astype(np.float32)
    records = [example(v=row) for row in x]
    write_tfrecord(folder / "a.tfrecord", records)
    raw = bytearray((folder / "a.tfrecord").read_bytes())
    raw[sum(len(r) + 16 for r in records[:3]) + 12] ^= 0xFF  # record 3's first data byte
    (folder / "a.tfrecord").write_bytes(bytes(raw))

    run(job([str(folder / "*.tfrecord")], tmp_path / "out", "tests.models:small_mlp", key="v", sample_shape=[12],
            on_bad_sample="skip"))

    rejected = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["id"], r["row"]) for r in rejected] == [(3, 3)] and rejected[0]["reason"].startswith("corrupt: ")
    kept = [0, 1, 2, 4, 5, 6, 7]
    stored = view(tmp_path / "out")
    np.testing.assert_array_equal(stored["sample_id"], kept)
    assert_close(stored["jacobian"], tape_loop(test_models.small_mlp(), x[kept]), rtol=1e-5)
