"""Reading samples in slices from .npy, .npz and .h5 files, and the errors for unusable files."""

import io

import h5py
import numpy as np
import pytest

from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs.readers import assign_ids, check_consistent, describe, iter_slices, open_rows
from jacobeam.transforms.output import storage


def _write(path, array, key="x"):
    if path.suffix == ".npy":
        np.save(path, array)
    elif path.suffix == ".npz":
        np.savez(path, **{key: array, "other": np.zeros(3)})
    else:
        with h5py.File(path, "w") as h5:
            h5.create_dataset(f"group/{key}", data=array, chunks=(4, *array.shape[1:]))
    return str(path)


@pytest.mark.parametrize("suffix, key", [(".npy", None), (".npz", "x"), (".h5", "group/x"), (".hdf5", "group/x")])
def test_slices_equal_the_array(tmp_path, rng, suffix, key):
    array = rng.normal(size=(23, 3, 2)).astype(np.float32)
    path = _write(tmp_path / f"a{suffix}", array)
    source = describe(path, key)
    assert (source.num_samples, source.sample_shape, source.dtype) == (23, (3, 2), "float32")
    with open_rows(path, key) as rows:
        np.testing.assert_array_equal(rows.read(5, 17), array[5:17])
        np.testing.assert_array_equal(rows.read(22, 23), array[22:23])


def test_slices_cover_a_range_across_files_in_sorted_path_order(tmp_path, rng):
    arrays = [rng.normal(size=(n, 4)).astype(np.float32) for n in (7, 2, 11)]
    paths = [_write(tmp_path / f"part-{i}.npy", a) for i, a in enumerate(arrays)]
    files = assign_ids([describe(p, None) for p in reversed(paths)])
    assert [(f.path, f.first_id, f.stop_id) for f in files] == [(paths[0], 0, 7), (paths[1], 7, 9), (paths[2], 9, 20)]
    everything = np.concatenate(arrays)

    batches = list(iter_slices(files, 3, 19, max_rows=5))

    assert [len(ids) for ids, _, _ in batches] == [4, 2, 5, 5]
    ids = np.concatenate([ids for ids, _, _ in batches])
    np.testing.assert_array_equal(ids, np.arange(3, 19))
    np.testing.assert_array_equal(np.concatenate([x for _, x, _ in batches]), everything[3:19])
    assert all(labels is None for _, _, labels in batches)


def test_npy_is_read_in_slices_not_whole(tmp_path, rng, monkeypatch):
    array = rng.normal(size=(1000, 50)).astype(np.float32)
    path = _write(tmp_path / "big.npy", array)
    reads = []

    class Recording(io.BufferedReader):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    monkeypatch.setattr(storage, "open_input", lambda p, headers=False: Recording(io.FileIO(p)))
    with open_rows(path, None) as rows:
        np.testing.assert_array_equal(rows.read(10, 20), array[10:20])
    assert -1 not in reads and max(reads) <= 10 * 50 * 4


@pytest.mark.parametrize(
    "make, key, message",
    [
        (lambda p: np.save(p, np.zeros((4, 2), np.int32)), None, r"bad.npy: dtype int32; expected a float array"),
        (lambda p: np.save(p, np.zeros(4, np.float32)), None, r"bad.npy: array of shape \(4,\); expected samples"),
        (lambda p: p.write_bytes(b"not numpy at all"), None, r"bad.npy: not a valid .npy array"),
        (lambda p: np.save(p, np.zeros((4, 2), np.float32)), None, None),
    ],
)
def test_unusable_npy_files(tmp_path, make, key, message):
    path = tmp_path / "bad.npy"
    make(path)
    if message is None:
        assert describe(str(path), key).num_samples == 4
    else:
        with pytest.raises(InputError, match=message):
            describe(str(path), key)


def test_missing_keys_list_what_is_there(tmp_path, rng):
    npz = _write(tmp_path / "a.npz", rng.normal(size=(3, 2)))
    with pytest.raises(InputError, match=r"a.npz: no array 'y' \(input.key\); found \['other', 'x'\]"):
        describe(npz, "y")
    with pytest.raises(InputError, match=r"a.npz: holds arrays \['other', 'x'\]; set input.key"):
        describe(npz, None)
    h5 = _write(tmp_path / "a.h5", rng.normal(size=(6, 2)))
    with pytest.raises(InputError, match=r"a.h5: no dataset 'nope' \(input.key\)"):
        describe(h5, "nope")


def test_sample_shapes_must_agree(tmp_path, rng):
    a = describe(_write(tmp_path / "a.npy", rng.normal(size=(3, 4))), None)
    b = describe(_write(tmp_path / "b.npy", rng.normal(size=(3, 5))), None)
    with pytest.raises(InputError, match=r"b.npy: samples of shape \(5,\); expected \(4,\) \(the sample shape of .*a.npy\)"):
        check_consistent([a, b])


def test_truncated_npy_is_an_error_naming_the_rows(tmp_path, rng):
    path = tmp_path / "t.npy"
    np.save(path, rng.normal(size=(10, 4)).astype(np.float32))
    path.write_bytes(path.read_bytes()[:-40])
    with open_rows(str(path), None) as rows:
        with pytest.raises(InputError, match=r"t.npy: truncated: rows 5 to 9 past the end"):
            rows.read(5, 10)


# --- ReadShardFn: TensorFlow's own reader for local .npy files, and the Python slices it stands in for ---


def _read_all(spec, shard):
    from jacobeam.transforms.read import ReadShardFn

    batches = list(ReadShardFn(spec).process(shard))
    return [(b.ids, b.inputs, b.labels) for b in batches]


def _npy_job(tmp_path, batch_size: int, input_: dict | None = None, output: dict | None = None):
    """The job spec of the small MLP over ``tmp_path/data/*.npy`` (planned without loading the model)."""
    from jacobeam.pipeline import config, plan

    cfg = config.validate(
        {
            "model": {"factory": "tests.models:small_mlp"},
            "input": {"paths": [str(tmp_path / "data" / "*.npy")], **(input_ or {})},
            "jacobian": {"batch_size": batch_size},
            "output": {"path": str(tmp_path / "out"), **(output or {})},
        }
    )
    return plan.make_job(cfg, check_model=False).spec


def test_native_npy_batches_equal_the_python_slices_across_files_and_rejected_rows(tmp_path, rng, monkeypatch):
    """Shards that start mid-file, span three files (one float64), reject bad rows and end on a short
    batch: both readers give the same ids and values, reject the same rows and hash the same bytes (the
    native reader's batches are filtered after reading, the Python slices before batching)."""
    from jacobeam.transforms import read

    data = tmp_path / "data"
    data.mkdir()
    arrays = [rng.normal(size=(n, 12)) for n in (13, 4, 21)]
    arrays[0][5, 1] = np.nan  # rejected under on_bad_sample: skip
    arrays[2][9:12] = np.inf
    for i, array in enumerate(arrays):
        np.save(data / f"part-{i}.npy", array.astype(np.float64 if i == 1 else np.float32))
    spec = _npy_job(tmp_path, 5, {"on_bad_sample": "skip"}, {"samples_per_shard": 16})
    shards = spec.ranges()
    assert len(shards) == 3

    def read_all(shard):
        findings = read.range_findings(spec)
        batches = [(b.ids, b.inputs) for b in read.shard_batches(spec, shard, findings)]
        assert all(len(ids) <= 5 for ids, _ in batches)
        ids, inputs = (np.concatenate(part) for part in zip(*batches))
        return ids, inputs, findings.rejected, findings.digest.hexdigest()

    native = {shard.start: read_all(shard) for shard in shards}
    assert all(read._npy_segments(spec, shard) for shard in shards)
    monkeypatch.setattr(read, "_npy_segments", lambda spec, shard: None)
    expected = np.concatenate([a.astype(np.float32) for a in arrays]).astype(np.float32)
    for shard in shards:
        ids, inputs, rejected, digest = native[shard.start]
        python = read_all(shard)
        np.testing.assert_array_equal(ids, python[0])
        np.testing.assert_array_equal(inputs, python[1])
        np.testing.assert_array_equal(inputs, expected[ids])
        assert inputs.dtype == np.float32 and rejected == python[2] and digest == python[3]
        bad = {5, 26, 27, 28}
        np.testing.assert_array_equal(ids, [i for i in range(shard.start, shard.stop) if i not in bad])
        assert [i for r in rejected for i in range(r.start, r.stop)] == sorted(bad & set(range(shard.start, shard.stop)))


def test_a_npy_file_rewritten_in_another_dtype_after_the_plan_is_read_as_its_values_not_its_bytes(tmp_path, rng):
    """Planned as float32, rewritten as float64 with the same values before its rows are read (a scheduled
    job's file replaced mid-run): the native reader read its float64 bytes as float32 rows, garbage that was
    stored and reported done. A header other than the plan's leaves it to the Python reader (its values)."""
    from jacobeam.transforms import read

    data = tmp_path / "data"
    data.mkdir()
    arrays = [rng.normal(size=(n, 12)).astype(np.float32) for n in (10, 10)]
    for i, array in enumerate(arrays):
        np.save(data / f"part-{i}.npy", array)
    spec = _npy_job(tmp_path, 4)
    shard = spec.ranges()[0]
    assert read._npy_segments(spec, shard)
    np.save(data / "part-1.npy", arrays[1].astype(np.float64))  # grown: the size check passes

    assert read._npy_segments(spec, shard) is None
    batches = list(read.shard_batches(spec, shard, read.range_findings(spec)))
    np.testing.assert_array_equal(np.concatenate([b.inputs for b in batches]), np.concatenate(arrays))


def test_native_npy_batches_are_whole_across_files_shorter_than_a_batch(tmp_path, rng):
    """Files of 3, 2 (float64) and 9 rows, batches of 4: the second file only partly completes the batch
    the first began; every batch but the last is whole, in id order, with the files' values (np.load)."""
    from jacobeam.transforms import read

    data = tmp_path / "data"
    data.mkdir()
    arrays = [rng.normal(size=(3, 6)).astype(np.float32), rng.normal(size=(2, 6)), rng.normal(size=(9, 6)).astype(np.float32)]
    for i, array in enumerate(arrays):
        np.save(data / f"part-{i}.npy", array)
    spec = _npy_job(tmp_path, 4)
    (shard,) = spec.ranges()
    assert read._npy_segments(spec, shard) is not None  # the native reader
    batches = _read_all(spec, shard)
    assert [len(ids) for ids, _, _ in batches] == [4, 4, 4, 2]
    expected = np.concatenate([np.load(data / f"part-{i}.npy").astype(np.float32) for i in range(3)])
    np.testing.assert_array_equal(np.concatenate([ids for ids, _, _ in batches]), np.arange(14))
    np.testing.assert_array_equal(np.concatenate([inputs for _, inputs, _ in batches]), expected)
    assert all(inputs.dtype == np.float32 and not labels.any() for _, inputs, labels in batches)


def test_a_file_truncated_since_the_plan_has_its_missing_rows_rejected(tmp_path, rng):
    """The native reader leaves a file shorter than planned to the Python slices, which name each row
    past the end (here under on_bad_sample: error, the first)."""

    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", rng.normal(size=(12, 12)).astype(np.float32))
    spec = _npy_job(tmp_path, 5)
    with open(data / "x.npy", "r+b") as stream:
        stream.truncate(stream.seek(0, 2) - 48)  # the last row, gone
    with pytest.raises(InputError, match=r"x\.npy: row 11: truncated: the row is past the end of the data \(input"):
        _read_all(spec, spec.ranges()[0])


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((7, 784), "<f4"),
        np.zeros((3,), ">f8"),
        np.zeros(()),
        np.zeros((2, 3), order="F"),
        np.zeros((5, 2), "i8"),
        np.zeros((1, 2, 3), "?"),
        np.zeros((4,), dtype=[("a", "<f4"), ("b", "<i2")]),  # not a plain header: numpy's parser
    ],
    ids=["f4", "big-endian f8", "scalar", "fortran", "i8", "bool", "structured"],
)
def test_npy_headers_read_without_ast_match_numpy(array):
    """Plain .npy headers are read without ast.literal_eval (CPython 3.11.7 cannot build two ASTs in two
    threads at once, gh-106905; it failed a suite run); each must give numpy's own reading."""
    import io

    from jacobeam.transforms.inputs.arrays import _npy_header

    stream = io.BytesIO()
    np.save(stream, array)
    stream.seek(0)
    fortran = array.flags.f_contiguous and not array.flags.c_contiguous
    assert _npy_header(stream) == (array.shape, fortran, array.dtype)
    assert stream.tell() == len(stream.getvalue()) - array.nbytes  # at the first row
