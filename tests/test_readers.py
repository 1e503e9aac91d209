"""Reading samples in slices from .npy, .npz and .h5 files, and the errors for unusable files."""

import io

import h5py
import numpy as np
import pytest

from transforms import storage
from transforms.errors import InputError
from transforms.readers import assign_ids, check_consistent, describe, iter_slices, open_rows


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

    monkeypatch.setattr(storage, "open_input", lambda p: Recording(io.FileIO(p)))
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
        with pytest.raises(InputError, match=r"t.npy: truncated: rows 5..10"):
            rows.read(5, 10)
