"""Shard tiling and id placement (``pipeline.ids``), planned without TensorFlow: drawn by hypothesis,
ranges cover every id once, within segments, with their rejected ids, and an incremental run keeps
every old id; and two cases written out."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jacobeam.pipeline import ids
from jacobeam.transforms.inputs.readers import SourceFile
from jacobeam.transforms.spec import Rejected


@st.composite
def tilings(draw):
    """Id segments, a shard step, and sorted disjoint rejected runs anywhere on the id line."""
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    bounds = np.cumsum([0, *lengths]).tolist()
    segments = list(zip(bounds[:-1], bounds[1:]))
    step = draw(st.integers(1, 17))
    total = bounds[-1]
    rejected = draw(st.lists(st.booleans(), min_size=total, max_size=total))
    breaks = draw(st.lists(st.booleans(), min_size=total, max_size=total))  # a run may also end mid-stretch
    runs, start = [], None
    for i in range(total + 1):
        inside = i < total and rejected[i]
        if start is not None and (not inside or breaks[i]):
            runs.append(Rejected(f"f{start}", f"bad {start}", 1000 + start, start, i))
            start = None
        if inside and start is None:
            start = i
    return segments, step, runs


@settings(max_examples=300, deadline=None)
@given(tilings())
def test_shard_ranges_cover_every_id_once_within_segments_with_their_rejected_ids(case):
    segments, step, runs = case
    ranges = ids.shard_ranges(segments, step, runs)
    total = segments[-1][1]
    covered = np.zeros(total, int)
    for r in ranges:
        covered[r.start : r.stop] += 1
    assert covered.tolist() == [1] * total  # every id of every segment in exactly one range
    assert [r.start for r in ranges] == sorted(r.start for r in ranges)
    rejected_ids = {i for run in runs for i in range(run.start, run.stop)}
    for r in ranges:
        (lo, hi), = [s for s in segments if s[0] <= r.start < s[1]]
        assert r.stop <= hi  # never across a segment boundary
        assert (r.start - lo) % step == 0 and (r.stop - r.start == step or r.stop == hi)
        inside = sorted(i for i in rejected_ids if r.start <= i < r.stop)
        clipped = sorted(i for c in r.rejected for i in range(c.start, c.stop))
        assert clipped == inside
        for c in r.rejected:
            origin = next(run for run in runs if run.start <= c.start < run.stop)
            assert (c.file, c.reason) == (origin.file, origin.reason) and c.stop <= origin.stop
            assert c.row == origin.row + (c.start - origin.start)  # the file row follows the id
        assert r.rows == r.stop - r.start - len(inside)
        assert [i for lo_, hi_ in r.kept() for i in range(lo_, hi_)] == [
            i for i in range(r.start, r.stop) if i not in rejected_ids
        ]


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
    runs = [Rejected("f", "bad", 0, 14, 18), Rejected("f", "bad", 9, 41, 42)]
    ranges = ids.shard_ranges([(0, 40), (40, 55)], 16, runs)
    assert [(r.start, r.stop, r.rows) for r in ranges] == [(0, 16, 14), (16, 32, 14), (32, 40, 8), (40, 55, 14)]
    assert ranges[0].rejected == (Rejected("f", "bad", 0, 14, 16),)
    assert ranges[1].rejected == (Rejected("f", "bad", 2, 16, 18),)  # split at the boundary, rows follow
    assert ranges[1].kept() == [(18, 32)]


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

    changed = [_source("/d/b", 6), _source("/d/a", 2)]
    _, _, differences = ids.place_files(changed, previous)
    assert differences == [
        'input file /d/b changed: samples 5 there, 6 now, data sha256 "sha /d/b 5" there, "sha /d/b 6" now',
        "input file /d/c (ids 5..9 there) is not among this run's inputs",
    ]
