"""Many small files read as one: one-sample ``.npy``, ``.npz``, ``.h5`` and PNG files give the ids, values,
rejections and digests of the same rows in one file (``checks.checked_slices`` gathers them into batches;
``transforms.read`` leaves a range of many files to it instead of a chain of one dataset per file)."""

import glob
import hashlib

import h5py
import numpy as np
import pytest

from jacobeam.transforms import read
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs.checks import Labels, RangeFindings, checked_slices
from jacobeam.transforms.inputs.readers import assign_ids, describe

FEATURES = 12  # tests.models:small_mlp's input


def _save(path, rows, labels=None):
    if path.suffix == ".npy":
        np.save(path, rows)
    elif path.suffix == ".npz":
        np.savez(path, x=rows, **({} if labels is None else {"y": labels}))
    else:
        with h5py.File(path, "w") as h5:
            h5["x"] = rows


def _spec(tmp_path, suffix, batch_size, samples_per_shard, on_bad_sample="skip"):
    from jacobeam.pipeline import config, plan

    cfg = config.validate(
        {
            "model": {"factory": "tests.models:small_mlp"},
            "input": {"paths": [str(tmp_path / "data" / f"*{suffix}")], "on_bad_sample": on_bad_sample},
            "jacobian": {"batch_size": batch_size},
            "output": {"path": str(tmp_path / "out"), "samples_per_shard": samples_per_shard},
        }
    )
    return plan.make_job(cfg, check_model=False).spec


def _read(spec, shard):
    findings = read.range_findings(spec)
    batches = [(b.ids, b.inputs) for b in read.shard_batches(spec, shard, findings)]
    return batches, findings


def _sha256(*rows):
    digest = hashlib.sha256()
    for values in rows:
        digest.update(np.ascontiguousarray(values).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".h5"])
def test_one_row_files_read_as_the_same_rows_would_be_from_one_file(tmp_path, rng, suffix):
    """70 one-row files, two of them non-finite, batches of 16 in shards of 64: every good row once, in id
    order, in whole batches but each shard's last; the bad ones rejected naming their file and row; the
    digest that of the good rows' bytes, and the one the per-file reading gives (slices of one row)."""
    (tmp_path / "data").mkdir()
    x = rng.normal(size=(70, FEATURES)).astype(np.float32)
    x[3, 0], x[41, 5] = np.nan, np.inf
    for i in range(70):
        _save(tmp_path / "data" / f"s{i:03d}{suffix}", x[i : i + 1])
    spec = _spec(tmp_path, suffix, batch_size=16, samples_per_shard=64)
    shards = spec.ranges()
    assert [(s.start, s.stop) for s in shards] == [(0, 64), (64, 70)]
    bad = {3: "non-finite input: holds NaN", 41: "non-finite input: holds Inf"}
    for shard in shards:
        # 64 files: too many for a chain of datasets, read in Python; the 6 of the last shard are not.
        assert (read._npy_segments(spec, shard) is None) == (shard.start == 0 or suffix != ".npy")
        batches, findings = _read(spec, shard)
        good = [i for i in range(shard.start, shard.stop) if i not in bad]
        sizes = [len(ids) for ids, _ in batches]
        assert sizes[:-1] == [16] * (len(sizes) - 1) and sum(sizes) == len(good)
        np.testing.assert_array_equal(np.concatenate([ids for ids, _ in batches]), good)
        np.testing.assert_array_equal(np.concatenate([inputs for _, inputs in batches]), x[good])
        assert [(r.file, r.row, r.start, r.reason) for r in findings.rejected] == [
            (spec.files[i].path, 0, i, reason) for i, reason in bad.items() if shard.start <= i < shard.stop
        ]
        assert findings.samples_sha256 == _sha256(x[good])
        per_file = RangeFindings(spec.files)
        for _ in checked_slices(spec.files, shard.start, shard.stop, 1, per_file):  # one file per slice
            pass
        assert per_file.samples_sha256 == findings.samples_sha256 and per_file.rejected == findings.rejected


def test_a_range_of_big_and_small_files_of_two_dtypes(tmp_path, rng):
    """A 40-row file, 25 one-row files (one float64, one of 3 rows), a 30-row file, in shards of 64 and
    batches of 16: ids and values as written (float32 to compute), whole batches across every kind of
    boundary, and the digest of each row's bytes in its own file's dtype, in id order."""
    data = tmp_path / "data"
    data.mkdir()
    parts = [rng.normal(size=(40, FEATURES)).astype(np.float32)]
    parts += [rng.normal(size=(3 if i == 9 else 1, FEATURES)).astype(np.float64 if i == 4 else np.float32) for i in range(25)]
    parts.append(rng.normal(size=(30, FEATURES)).astype(np.float32))
    for i, part in enumerate(parts):
        np.save(data / f"p{i:03d}.npy", part)
    spec = _spec(tmp_path, ".npy", batch_size=16, samples_per_shard=64)
    shards = spec.ranges()
    assert [(s.start, s.stop) for s in shards] == [(0, 64), (64, 97)]
    rows = [row for part in parts for row in part]  # each row in its file's dtype
    for shard in shards:
        batches, findings = _read(spec, shard)
        sizes = [len(ids) for ids, _ in batches]
        whole, rest = divmod(shard.stop - shard.start, 16)
        assert sizes == [16] * whole + ([rest] if rest else [])
        np.testing.assert_array_equal(np.concatenate([ids for ids, _ in batches]), np.arange(shard.start, shard.stop))
        inputs = np.concatenate([values for _, values in batches])
        assert inputs.dtype == np.float32
        np.testing.assert_array_equal(inputs, np.array(rows[shard.start : shard.stop]).astype(np.float32))
        assert findings.samples_sha256 == _sha256(*rows[shard.start : shard.stop]) and not findings.rejected


def _bad_files(tmp_path, rng):
    """30 one-row files: file 7 holds a NaN, file 12 is cut short after planning."""
    (tmp_path / "data").mkdir()
    x = rng.normal(size=(30, FEATURES)).astype(np.float32)
    x[7, 2] = np.nan
    for i in range(30):
        np.save(tmp_path / "data" / f"s{i:03d}.npy", x[i : i + 1])
    return x


def _cut(path):
    with open(path, "r+b") as stream:
        stream.truncate(stream.seek(0, 2) - 8)


def test_bad_small_files_are_rejected_by_file_and_row(tmp_path, rng):
    x = _bad_files(tmp_path, rng)
    spec = _spec(tmp_path, ".npy", batch_size=8, samples_per_shard=64)
    _cut(tmp_path / "data" / "s012.npy")
    (shard,) = spec.ranges()
    batches, findings = _read(spec, shard)
    good = [i for i in range(30) if i not in (7, 12)]
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in batches]), good)
    np.testing.assert_array_equal(np.concatenate([inputs for _, inputs in batches]), x[good])
    assert [(r.file, r.row, r.start, r.stop, r.reason) for r in findings.rejected] == [
        (str(tmp_path / "data" / "s007.npy"), 0, 7, 8, "non-finite input: holds NaN"),
        (str(tmp_path / "data" / "s012.npy"), 0, 12, 13, "truncated: the row is past the end of the data"),
    ]
    assert findings.samples_sha256 == _sha256(x[good])


@pytest.mark.parametrize("first_bad", ["nan", "cut"])
def test_on_bad_sample_error_names_the_first_bad_small_file_in_one_line(tmp_path, rng, first_bad):
    """The NaN of file 7 is found when its batch is checked, after file 12 was found short as read: the
    error still names the first bad file in id order."""
    _bad_files(tmp_path, rng)
    spec = _spec(tmp_path, ".npy", batch_size=16, samples_per_shard=64, on_bad_sample="error")
    _cut(tmp_path / "data" / "s012.npy")
    if first_bad == "cut":
        _cut(tmp_path / "data" / "s005.npy")
    (shard,) = spec.ranges()
    with pytest.raises(InputError) as raised:
        _read(spec, shard)
    message = str(raised.value)
    expected = "s005.npy: row 0: truncated" if first_bad == "cut" else "s007.npy: row 0: non-finite input: holds NaN"
    assert expected in message and "\n" not in message


def test_labels_of_one_row_files_come_with_their_rows(tmp_path, rng):
    """One-row .npz files with a label each (one not an output index): labels and rows stay together, and
    both digests are those of the kept rows' bytes."""
    (tmp_path / "data").mkdir()
    x = rng.normal(size=(20, FEATURES)).astype(np.float32)
    y = rng.integers(0, 5, size=20)
    y[6] = 9
    paths = []
    for i in range(20):
        paths.append(str(tmp_path / "data" / f"s{i:03d}.npz"))
        np.savez(paths[-1], x=x[i : i + 1], y=y[i : i + 1])
    files = assign_ids([describe(path, "x") for path in paths])
    findings = RangeFindings(files, "skip", Labels("y", 5))
    found = list(checked_slices(files, 0, 20, 8, findings, "y"))
    good = [i for i in range(20) if i != 6]
    assert [len(ids) for ids, _, _ in found] == [7, 8, 4]  # the batch holding the bad row is one short
    np.testing.assert_array_equal(np.concatenate([ids for ids, _, _ in found]), good)
    np.testing.assert_array_equal(np.concatenate([rows for _, rows, _ in found]), x[good])
    np.testing.assert_array_equal(np.concatenate([labels for _, _, labels in found]), y[good])
    assert findings.samples_sha256 == _sha256(x[good]) and findings.labels_sha256 == _sha256(y[good])
    assert [(r.file, r.row, r.reason) for r in findings.rejected] == [(paths[6], 0, "label 9 is not an output index 0..4")]


def test_png_files_read_as_their_pixels_over_255(tmp_path, rng):
    """40 grey PNGs, batches of 16: each sample its 8-bit pixels / 255 in float32 (PNG is lossless), the
    digest that of those values' bytes."""
    import tensorflow as tf

    (tmp_path / "data").mkdir()
    pixels = rng.integers(0, 256, size=(40, 6, 5, 1), dtype=np.uint8)
    for i, image in enumerate(pixels):
        (tmp_path / "data" / f"s{i:03d}.png").write_bytes(tf.io.encode_png(image).numpy())
    spec = _spec(tmp_path, ".png", batch_size=16, samples_per_shard=64)
    (shard,) = spec.ranges()
    batches, findings = _read(spec, shard)
    expected = pixels.astype(np.float32) * np.float32(1 / 255)
    assert [len(ids) for ids, _ in batches] == [16, 16, 8]
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in batches]), np.arange(40))
    np.testing.assert_array_equal(np.concatenate([inputs for _, inputs in batches]), expected)
    assert findings.samples_sha256 == _sha256(expected)


@pytest.mark.parametrize("fmt", ["npy", "png"])
def test_the_benchmark_compares_the_same_samples(tmp_path, fmt):
    """benchmarks.small_files times one file per sample against one .npy: both must hold the same samples
    as the pipeline reads them, in the same id order."""
    from benchmarks import small_files

    x = small_files.samples_of(fmt, 20)
    sides = []
    for side, write in (("files", small_files.write_files), ("one", small_files.write_one)):
        paths = sorted(glob.glob(write(fmt, x, tmp_path / side)))
        files = assign_ids([describe(path, None) for path in paths])
        found = list(checked_slices(files, 0, 20, 16, RangeFindings(files)))
        sides.append(np.concatenate([rows for _, rows, _ in found]))
    assert len(sides[0]) == 20 and sides[0].dtype == sides[1].dtype == np.float32
    np.testing.assert_array_equal(sides[0], sides[1])



@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", "<f2", "<i2"])
@pytest.mark.parametrize("shape", [(3,), (2, 2, 3)])
@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_small_npy_files_read_whole_give_what_numpy_loads(tmp_path, dtype, shape, version):
    """Each file read in one call, a header parsed once per distinct header: the rows numpy loads, in the
    file's own dtype; files of another shape or dtype in between are parsed on their own."""
    from jacobeam.transforms.inputs.arrays import SmallNpyFiles

    rng = np.random.default_rng(4)
    files, reader = [], SmallNpyFiles()
    for i, rows in enumerate([1, 1, 4, 1, 2]):
        array = (rng.normal(size=(rows, *shape)) * 100).astype(dtype)
        path = tmp_path / f"f{i}.npy"
        with open(path, "wb") as stream:
            np.lib.format.write_array(stream, array, version=version)
        files.append((str(path), array))
    for path, array in files * 2:  # the second pass from the parsed headers
        for start, stop in [(0, len(array)), (0, 1), (len(array) - 1, len(array))]:
            got = reader.rows(path, start, stop)
            assert got.dtype == array.dtype
            np.testing.assert_array_equal(got, array[start:stop])


def test_small_npy_files_leave_the_unusual_to_the_usual_reader(tmp_path):
    """None (the usual reader's checks and messages apply) for a truncated file, rows past its end, a
    Fortran-ordered or object array, something not a .npy at all, a file gone."""
    from jacobeam.transforms.inputs.arrays import SmallNpyFiles

    reader = SmallNpyFiles()
    np.save(tmp_path / "ok.npy", np.ones((2, 3), np.float32))
    np.save(tmp_path / "cut.npy", np.ones((2, 3), np.float32))
    _cut(tmp_path / "cut.npy")
    np.save(tmp_path / "fortran.npy", np.asfortranarray(np.ones((2, 3), np.float32)))
    np.save(tmp_path / "objects.npy", np.array([[1], ["a"]], dtype=object), allow_pickle=True)
    (tmp_path / "junk.npy").write_bytes(b"not an array at all")
    assert reader.rows(str(tmp_path / "ok.npy"), 0, 2).shape == (2, 3)
    assert reader.rows(str(tmp_path / "ok.npy"), 1, 3) is None
    for name in ("cut", "fortran", "objects", "junk", "gone"):
        assert reader.rows(str(tmp_path / f"{name}.npy"), 0, 1 if name != "cut" else 2) is None, name
