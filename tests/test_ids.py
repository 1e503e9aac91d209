"""Shard tiling and id placement (``pipeline.ids``), planned without TensorFlow: drawn by hypothesis,
ranges cover every id once, within segments, and an incremental run keeps
every old id; and two cases written out."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jacobeam.pipeline import ids
from jacobeam.transforms.inputs.readers import SourceFile


@st.composite
def tilings(draw):
    """Id segments and a shard step."""
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    bounds = np.cumsum([0, *lengths]).tolist()
    return list(zip(bounds[:-1], bounds[1:])), draw(st.integers(1, 17))


@settings(max_examples=300, deadline=None)
@given(tilings())
def test_shard_ranges_cover_every_id_once_within_segments(case):
    segments, step = case
    ranges = ids.shard_ranges(segments, step)
    total = segments[-1][1]
    covered = np.zeros(total, int)
    for r in ranges:
        covered[r.start : r.stop] += 1
    assert covered.tolist() == [1] * total  # every id of every segment in exactly one range
    assert [r.start for r in ranges] == sorted(r.start for r in ranges)
    for r in ranges:
        (lo, hi), = [s for s in segments if s[0] <= r.start < s[1]]
        assert r.stop <= hi  # never across a segment boundary
        assert (r.start - lo) % step == 0 and (r.stop - r.start == step or r.stop == hi)
        assert r.rows == r.stop - r.start


def _source(path: str, n: int) -> SourceFile:
    return SourceFile(path=path, key=None, num_samples=n, sample_shape=(3,), dtype="float32", data_sha256=f"sha {path} {n}")


def _as_previous(placed: list[SourceFile], segments) -> dict:
    """What a manifest records of placed files (``finalize.build_manifest``'s ``inputs`` and segments)."""
    return {
        "inputs": [
            {"path": f.path, "key": f.key, "first_id": f.first_id, "stop_id": f.stop_id, "num_samples": f.num_samples,
             "dtype": f.dtype, "data_sha256": f.data_sha256}
            for f in placed
        ],
        "id_segments": [list(s) for s in segments],
        "input_shape": [3],
    }


file_sets = st.dictionaries(st.text("abcxyz0", min_size=1, max_size=4), st.integers(1, 30), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(first=file_sets, later=st.lists(file_sets, min_size=1, max_size=3), order=st.randoms(use_true_random=False))
def test_incremental_placement_keeps_every_old_id_and_appends_new_files_sorted(first, later, order):
    files = [_source(f"/d/{name}", n) for name, n in first.items()]
    placed, segments, differences = ids.place_files(files, None)
    assert differences == [] and segments == [(0, sum(first.values()))]
    assert [f.path for f in placed] == sorted(f.path for f in files)  # fresh: sorted path order, from 0
    assert [f.first_id for f in placed] == np.cumsum([0, *(f.num_samples for f in placed)])[:-1].tolist()
    for batch in later:
        known = {f.path: f for f in placed}
        new = [_source(f"/d/{name}", n) for name, n in batch.items() if f"/d/{name}" not in known]
        given_files = [*known.values(), *new]
        order.shuffle(given_files)  # the order files are found in does not matter
        end = max(f.stop_id for f in placed)

        again, new_segments, differences = ids.place_files(given_files, _as_previous(placed, segments))

        assert differences == []
        by_path = {f.path: f for f in again}
        assert all(by_path[path].first_id == old.first_id for path, old in known.items())  # old ids stay
        appended = sorted(f.path for f in new)
        sizes = [by_path[p].num_samples for p in appended]
        assert [by_path[p].first_id for p in appended] == (end + np.cumsum([0, *sizes])[:-1]).tolist()  # sorted, after old
        assert new_segments == segments + ([(end, end + sum(f.num_samples for f in new))] if new else [])
        assert [f.first_id for f in again] == sorted(f.first_id for f in again)
        placed, segments = again, new_segments


def test_ranges_tile_each_id_segment_from_its_start():
    ranges = ids.shard_ranges([(0, 40), (40, 55)], 16)
    assert [(r.start, r.stop) for r in ranges] == [(0, 16), (16, 32), (32, 40), (40, 55)]


def test_old_files_keep_their_ids_and_new_files_go_after_them():
    previous = {
        "inputs": [
            {
                "path": "/d/b",
                "key": None,
                "first_id": 0,
                "num_samples": 5,
                "dtype": "float32",
                "data_sha256": "sha /d/b 5",
            },
            {
                "path": "/d/c",
                "key": None,
                "first_id": 5,
                "num_samples": 4,
                "dtype": "float32",
                "data_sha256": "sha /d/c 4",
            },
        ],
        "id_segments": [[0, 9]],
        "input_shape": [3],
    }
    files = [_source("/d/a", 2), _source("/d/b", 5), _source("/d/c", 4), _source("/d/z", 3)]  # /d/a sorts first, yet is new
    placed, segments, differences = ids.place_files(files, previous)
    assert [(f.path, f.first_id, f.stop_id) for f in placed] == [
        ("/d/b", 0, 5),
        ("/d/c", 5, 9),
        ("/d/a", 9, 11),
        ("/d/z", 11, 14),
    ]
    assert segments == [(0, 9), (9, 14)] and differences == []

    changed = [_source("/d/b", 4), _source("/d/a", 2)]
    placed, _, differences = ids.place_files(changed, previous)
    # /d/c is gone: no difference, its ids stay taken, marked removed (issue 37); /d/b shrank: refused
    assert differences == ["input file /d/b changed: samples 5 there, 4 now"]
    assert [(f.path, f.first_id, f.stop_id, f.removed) for f in placed] == [
        ("/d/b", 0, 5, False), ("/d/c", 5, 9, True), ("/d/a", 9, 11, False),
    ]


def test_a_file_that_grew_keeps_the_ids_of_its_old_rows_and_its_new_rows_come_after_every_old_id():
    """Rows appended to /d/b (5 -> 8): its rows 0..5 keep ids 0..5, rows 5..8 are a piece of their own
    placed as a new file would be (sorted by path with the new files, after the old end); it grows
    again: a third piece."""
    first, segments, _ = ids.place_files([_source("/d/b", 5), _source("/d/c", 4)], None)
    grown = [_source("/d/b", 8), _source("/d/c", 4), _source("/d/d", 2)]
    placed, segments, differences = ids.place_files(grown, _as_previous(first, segments))
    assert differences == [] and segments == [(0, 9), (9, 14)]
    assert [(f.path, f.first_id, f.stop_id, f.first_row) for f in placed] == [
        ("/d/b", 0, 5, 0), ("/d/c", 5, 9, 0), ("/d/b", 9, 12, 5), ("/d/d", 12, 14, 0),
    ]
    assert [placed[2].row(i) for i in (9, 11)] == [5, 7]
    previous = _as_previous(placed, segments)
    for entry, piece in zip(previous["inputs"], placed):
        entry["first_row"] = piece.first_row  # as the manifest records a piece
    again, segments, differences = ids.place_files([_source("/d/b", 10), _source("/d/c", 4), _source("/d/d", 2)], previous)
    assert differences == [] and segments == [(0, 9), (9, 14), (14, 16)]
    assert [(f.first_id, f.stop_id, f.first_row) for f in again if f.path == "/d/b"] == [(0, 5, 0), (9, 12, 5), (14, 16, 8)]
