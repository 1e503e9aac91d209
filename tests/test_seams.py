"""Beam's test seams: a whole ``jacobeam run`` job in a ``TestPipeline`` with the closed-form fake engine
(``transforms.testing.fake_engine``), ``ComputeJacobians`` checked with ``assert_that``, and direct tests
of what was otherwise only tested through whole runs: shard tiling and id placement (``pipeline.ids``),
the aggregates' ``CombineFn``, the run identity and the foreign-folder comparison.

Every expected value comes from the fake model's closed form, ``J[r, j] = A[r, j] + B[r, j] x_j`` for
``y_r = sum_j A[r, j] x_j + 1/2 B[r, j] x_j**2``, computed here, or from a reference written here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import apache_beam as beam
import h5py
import numpy as np
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jacobeam.pipeline import config, ids, plan, runner, verify
from jacobeam.pipeline.folder import folder_differences, read_folder
from jacobeam.pipeline.identity import run_identity
from jacobeam.transforms import (
    ComputeJacobians,
    EngineOptions,
    JacobianBatch,
    ModelSource,
    ReadSamples,
    SampleBatch,
    WriteShards,
)
from jacobeam.transforms.aggregates import AggregateFn, partial
from jacobeam.transforms.errors import ModelError, OutputError
from jacobeam.transforms.inputs.readers import SourceFile
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.shards import ShardRecord
from jacobeam.transforms.output.storage import sha256
from jacobeam.transforms.spec import Reduction, Rejected, run_key
from jacobeam.transforms.testing.fake_engine import FakeEngine, FakeEngineFactory

ROOT = Path(__file__).resolve().parents[1]
FACTORY = FakeEngineFactory(outputs=3, seed=7, max_batch=5)
MODEL = ModelSource(factory="fake.model:closed_form")  # never loaded: the fake engine stands in for it
SHAPE = (2, 3)
SIZES = {"a": 7, "b": 13, "c": 20}  # 40 samples: not a multiple of samples_per_shard (16) nor of batches (6, 5)
BAD_ID = 10  # b.npy row 3: a NaN sample, rejected (on_bad_sample: skip)


def closed_form(x: np.ndarray, factory: FakeEngineFactory = FACTORY, shape=SHAPE) -> tuple[np.ndarray, np.ndarray]:
    """The fake model's outputs ``(n, m)`` and Jacobians ``(n, m, *shape)``, float64."""
    a, b = factory.coefficients(shape)
    flat = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.stack([a @ v + 0.5 * b @ (v * v) for v in flat])
    jacobian = np.stack([a + b * v[None, :] for v in flat])  # one sample at a time
    return y, jacobian.reshape(len(x), len(a), *shape)


def test_the_fake_engines_jacobian_is_the_derivative_of_its_output():
    """The closed form is right: central differences of the engine's own outputs (a quadratic, so exact
    up to rounding) give its Jacobian, and the outputs are the model's."""
    engine = FACTORY(MODEL, SHAPE, EngineOptions(store_dtype="float64"))
    x = np.random.default_rng(3).normal(size=(4, *SHAPE))
    datasets, _ = engine.compute(x)
    step, d = 1e-3, int(np.prod(SHAPE))
    for i in range(len(x)):
        columns = []
        for j in range(d):
            e = np.zeros(d)
            e[j] = step
            plus = engine.compute((x[i].ravel() + e).reshape(1, *SHAPE))[0]["output"][0]
            minus = engine.compute((x[i].ravel() - e).reshape(1, *SHAPE))[0]["output"][0]
            columns.append((plus - minus) / (2 * step))
        np.testing.assert_allclose(np.stack(columns, axis=1).reshape(3, *SHAPE), datasets["jacobian"][i], rtol=1e-9, atol=1e-9)
    y, _ = closed_form(x)
    np.testing.assert_allclose(datasets["output"], y, rtol=1e-12)


def test_the_fake_engine_refuses_what_it_does_not_compute():
    with pytest.raises(ModelError, match="one input only"):
        FACTORY(MODEL, {"image": (2,), "meta": (3,)}, EngineOptions())
    with pytest.raises(ModelError, match="reduce 'trace'"):
        FACTORY(MODEL, SHAPE, EngineOptions(reduce=Reduction(kind="trace")))
    with pytest.raises(ModelError, match="self_check.samples: 0"):
        _ = FACTORY(MODEL, SHAPE, EngineOptions()).operands


# --- ComputeJacobians with the fake engine, checked by assert_that ----------------------------------------


def _records_equal(expected, actual) -> bool:
    """``(key, {dataset: array})`` records: the same key, datasets and dtypes; the Jacobian bit for bit
    (entrywise arithmetic), the output within two units of the store dtype's last place (a matrix product,
    whose last bits may follow the order of additions)."""
    (key, datasets), (other_key, other) = expected, actual
    if key != other_key or datasets.keys() != other.keys():
        return False
    if any(datasets[name].dtype != other[name].dtype for name in datasets):
        return False
    eps = float(np.finfo(np.float32).eps) if datasets["output"].dtype == np.float32 else 2.0**-8
    output, other_output = (np.asarray(v, np.float64) for v in (datasets["output"], other["output"]))
    return np.array_equal(datasets["jacobian"], other["jacobian"]) and np.allclose(other_output, output, rtol=2 * eps, atol=0)


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16"])
def test_compute_jacobians_with_the_fake_engine_gives_the_closed_form_per_key(store_dtype):
    import ml_dtypes

    store = np.dtype(ml_dtypes.bfloat16) if store_dtype == "bfloat16" else np.dtype(store_dtype)
    x = np.random.default_rng(5).normal(size=(11, *SHAPE)).astype(np.float32)
    y, jacobian = closed_form(x)
    expected = [(f"k{i}", {"output": y[i].astype(store), "jacobian": jacobian[i].astype(store)}) for i in range(11)]
    options = EngineOptions(batch_size=4, store_dtype=store_dtype)
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
        records = (
            pipeline
            | beam.Create([(f"k{i}", x[i]) for i in range(11)])
            | ComputeJacobians(MODEL, SHAPE, options, engine_factory=FACTORY)
            | beam.FlatMap(JacobianBatch.records)
        )
        assert_that(records, equal_to(expected, equals_fn=_records_equal))


def test_compute_jacobians_splits_a_batch_into_engine_calls_of_the_engines_batch_size():
    """A ``SampleBatch`` of 11 goes to an engine that takes at most 5 at a time: calls of 5, 5, 1, each
    with its ids and the closed form of its rows."""
    x = np.random.default_rng(6).normal(size=(11, *SHAPE)).astype(np.float32)
    _, jacobian = closed_form(x)
    expected = [
        (tuple(range(lo, min(lo + 5, 11))), jacobian[lo : lo + 5].astype(np.float32)) for lo in range(0, 11, 5)
    ]
    batch = SampleBatch(ids=np.arange(11, dtype=np.int64), inputs=x)
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
        calls = (
            pipeline
            | beam.Create([batch])
            | ComputeJacobians(MODEL, SHAPE, EngineOptions(batch_size=64), batched=True, engine_factory=FACTORY)
            | beam.Map(lambda b: (tuple(int(i) for i in b.ids), b.datasets["jacobian"]))
        )
        assert_that(
            calls,
            equal_to(expected, equals_fn=lambda e, a: e[0] == a[0] and np.array_equal(e[1], a[1])),
        )


def test_a_fake_engine_pipeline_never_imports_tensorflow(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import apache_beam as beam
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner
        from apache_beam.testing import test_pipeline
        from apache_beam.testing.util import assert_that, equal_to
        from jacobeam.transforms import ComputeJacobians, EngineOptions, JacobianBatch, ModelSource
        from jacobeam.transforms.testing.fake_engine import FakeEngineFactory

        factory = FakeEngineFactory(outputs=2, seed=1)
        a, b = factory.coefficients((3,))
        x = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
        expected = [(i, (a + b * x[i].astype(np.float64)).astype(np.float32).tolist()) for i in range(4)]
        with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
            got = (
                pipeline
                | beam.Create(list(enumerate(x)))
                | ComputeJacobians(ModelSource(factory="fake:model"), (3,), EngineOptions(batch_size=3),
                                   engine_factory=factory)
                | beam.FlatMap(JacobianBatch.records)
                | beam.MapTuple(lambda key, datasets: (key, datasets["jacobian"].tolist()))
            )
            assert_that(got, equal_to(expected))
        assert "tensorflow" not in sys.modules, sorted(m for m in sys.modules if m.startswith("tensorflow"))[:5]
        print("ran without tensorflow")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran without tensorflow" in done.stdout


# --- a whole jacobeam run in a TestPipeline, with the fake engine ----------------------------------------


def _write_inputs(folder: Path) -> np.ndarray:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {name: rng.normal(size=(size, *SHAPE)).astype(np.float32) for name, size in SIZES.items()}
    arrays["b"][BAD_ID - SIZES["a"], 1, 2] = np.nan
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array)
    return np.concatenate([arrays[name] for name in sorted(arrays)])


def _config(data: Path, out: Path, samples_per_shard: int = 16):
    return config.validate(
        {
            "model": {"factory": MODEL.factory},
            "input": {"paths": [str(data / "*.npy")], "on_bad_sample": "skip"},
            # self_check recomputes with TensorFlow from the real engine: off for the fake engine
            "jacobian": {"batch_size": 6, "aggregate": ["mean", "jtj"], "self_check": {"samples": 0}},
            "output": {"path": str(out), "samples_per_shard": samples_per_shard},
        }
    )


def _fake_run(data: Path, out: Path, **kwargs) -> tuple[runner.RunResult, test_pipeline.TestPipeline]:
    pipeline = test_pipeline.TestPipeline(runner=FnApiRunner())
    result = runner.run(_config(data, out, **kwargs), [], show_progress=False, pipeline=pipeline, engine_factory=FACTORY)
    return result, pipeline


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One whole run with the fake engine; tests below copy its folder before changing anything."""
    root = tmp_path_factory.mktemp("seams")
    samples = _write_inputs(root / "data")
    result, pipeline = _fake_run(root / "data", root / "out")
    return root, samples, result, pipeline


def _shards(out: Path) -> dict[str, dict[str, np.ndarray]]:
    found = {}
    for path in sorted((out / "shards").iterdir()):
        with h5py.File(path) as h5:
            found[path.name] = {name: h5[name][()] for name in ("sample_id", "jacobian", "output")}
    return found


def test_a_run_in_the_callers_pipeline_stores_the_closed_form_for_every_sample(fake_run):
    root, samples, result, pipeline = fake_run
    out = root / "out"
    labels = [t.full_label for t in pipeline.transforms_stack[0].parts]
    assert labels == ["ShardRanges", "Spread", "ComputeShards", "Finalize"]  # built into the pipeline given
    manifest = result.manifest
    assert [(s["start"], s["stop"], s["num_samples"], s["rejected"]) for s in manifest["shards"]] == [
        (0, 16, 15, 1), (16, 32, 16, 0), (32, 40, 8, 0)
    ]
    assert manifest["rejected"]["ids"] == [[BAD_ID, BAD_ID + 1]]
    assert manifest["model_fingerprint"] == FakeEngine(SHAPE, EngineOptions(), outputs=3, seed=7).fingerprint
    assert manifest["engine"]["mode"] == "fake"
    assert result.metrics["samples"] == 39 and result.metrics["shards_written"] == 3

    y, jacobian = closed_form(samples)
    kept = np.array([i for i in range(40) if i != BAD_ID])
    shards = _shards(out)
    assert list(shards) == [
        "shard-000000000000-000000000016.h5", "shard-000000000016-000000000032.h5", "shard-000000000032-000000000040.h5"
    ]
    stored_ids = np.concatenate([s["sample_id"] for s in shards.values()])
    np.testing.assert_array_equal(stored_ids, kept)
    for shard in shards.values():
        rows = shard["sample_id"]
        assert shard["jacobian"].dtype == np.float32
        np.testing.assert_array_equal(shard["jacobian"], jacobian[rows].astype(np.float32))  # bit for bit
        np.testing.assert_allclose(shard["output"], y[rows], rtol=1e-6)

    wide = jacobian[kept].astype(np.float32).astype(np.float64).reshape(39, 3, -1)
    with h5py.File(out / "aggregates.h5") as h5:
        assert int(h5["count"][()]) == 39
        np.testing.assert_allclose(h5["mean"][()], wide.mean(axis=0).reshape(3, *SHAPE), rtol=1e-12)
        np.testing.assert_allclose(h5["jtj"][()], np.einsum("nrd,nre->de", wide, wide), rtol=1e-12)

    report = verify.verify(str(out), samples=0)
    assert report.ok, report.problems
    assert (report.shards_checked, report.ids_checked) == (3, 40)


def test_only_ranges_and_records_travel_between_the_runs_steps(fake_run):
    """Samples and Jacobians stay inside ComputeShards' process calls: a runner that hands a step's
    outputs on as a list per partition (Dask's) holds records, never a shard's results."""
    _, _, _, pipeline = fake_run
    produced = [
        output.element_type
        for applied in pipeline.transforms_stack[0].parts
        for part in [applied, *applied.parts]
        for output in part.outputs.values()
    ]
    assert not any(kind in (SampleBatch, JacobianBatch) for kind in produced)
    assert ShardRecord in produced


def test_metrics_of_a_runner_that_has_none_are_counted_from_the_manifest(fake_run):
    class NoMetrics:
        def metrics(self):
            raise NotImplementedError("as Beam's DaskRunner")

    _, _, result, _ = fake_run
    assert runner._metrics(NoMetrics(), result.manifest) == {"samples": 39, "shards_written": 3, "shards_skipped": 0}


def test_resume_after_losing_one_shard_recomputes_only_it_bit_for_bit(fake_run, tmp_path):
    root, _, first, _ = fake_run
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    lost = "shard-000000000016-000000000032.h5"
    before = {p.name: (sha256(p), p.stat().st_mtime_ns) for p in (out / "shards").iterdir()}
    (out / "shards" / lost).unlink()

    result, _ = _fake_run(root / "data", out)

    shards = result.manifest["shards"]
    assert [s["computed_in_this_run"] for s in shards] == [False, True, False]
    assert result.metrics["samples"] == 16  # only the lost shard's samples went through the engine
    after = {p.name: (sha256(p), p.stat().st_mtime_ns) for p in (out / "shards").iterdir()}
    assert {name: sha for name, (sha, _) in after.items()} == {name: sha for name, (sha, _) in before.items()}
    assert {name: seen for name, seen in after.items() if name != lost} == {
        name: seen for name, seen in before.items() if name != lost
    }  # the others were not rewritten
    assert [s["crc32c"] for s in shards] == [s["crc32c"] for s in first.manifest["shards"]]
    for name in ("aggregates.h5", "jacobians.h5"):
        with h5py.File(out / name) as new, h5py.File(root / "out" / name) as old:
            for key in new:
                np.testing.assert_array_equal(new[key][()], old[key][()])
    assert verify.verify(str(out), samples=0).ok


def test_read_compute_write_composed_in_a_users_pipeline_give_the_same_folder_as_the_run(fake_run, tmp_path):
    """``ReadSamples | ComputeJacobians | WriteShards`` on a planned job: the batches are grouped by their
    planned shard, every shard and aggregate the same bit for bit as ``jacobeam run``'s."""
    root, _, first, _ = fake_run
    out = tmp_path / "out"
    cfg = _config(root / "data", out)
    threads = runner.tf_threads(cfg, runner.PipelineOptions([]))  # the run's: shards record their threads
    job = plan.make_job(cfg, threads, check_model=False, identify_model=False)
    plan.prepare_output(job)
    spec = job.spec
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
        _ = (
            pipeline
            | ReadSamples(spec)
            | ComputeJacobians(spec.model, spec.sample_shape, spec.engine, engine_factory=FACTORY)
            | WriteShards(spec)
        )
    assert {p.name: sha256(p) for p in (out / "shards").iterdir()} == {
        p.name: sha256(p) for p in (root / "out" / "shards").iterdir()
    }
    for name in ("aggregates.h5", "jacobians.h5", "rejected.jsonl"):
        assert (out / name).exists()
    with h5py.File(out / "aggregates.h5") as new, h5py.File(root / "out" / "aggregates.h5") as old:
        for key in old:
            np.testing.assert_array_equal(new[key][()], old[key][()])
    assert (out / "rejected.jsonl").read_bytes() == (root / "out" / "rejected.jsonl").read_bytes()
    assert verify.verify(str(out), samples=0).ok


# --- shard tiling and id placement (pipeline.ids) ----------------------------------------------------------


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


# --- the aggregates' CombineFn -------------------------------------------------------------------------------


def _tree_sum(leaves: list[dict]) -> dict:
    """The sum along the fixed binary tree over the leaves (a complete tree over the next power of two,
    absent leaves skipped): the reference ``AggregateFn`` must match bit for bit."""
    width = 1
    while width < len(leaves):
        width *= 2

    def node(lo: int, size: int):
        if lo >= len(leaves):
            return None
        if size == 1:
            return leaves[lo]
        left, right = node(lo, size // 2), node(lo + size // 2, size // 2)
        return left if right is None else {k: left[k] + right[k] for k in left}

    return node(0, width)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 23), seed=st.integers(0, 2**16), data=st.data())
def test_aggregate_combine_is_bit_identical_however_inputs_are_split_and_merged(n, seed, data):
    rng = np.random.default_rng(seed)
    # Magnitudes over 16 decades: a different order of additions changes the last bits.
    leaves = [
        partial(rng.normal(size=(int(rng.integers(1, 4)), 2, 3)) * 10.0 ** rng.integers(-8, 8), ("mean", "mean_abs", "jtj"))
        for _ in range(n)
    ]
    fn = AggregateFn(n)
    order = data.draw(st.permutations(range(n)))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=5)))
    pieces = [order[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, n])]
    accumulators = []
    for piece in pieces:
        accumulator = fn.create_accumulator()
        for position in piece:
            accumulator = fn.add_input(accumulator, (position, leaves[position]))
        accumulators.append(accumulator)
    while len(accumulators) > 1:  # merge in a drawn order, two or more at a time
        take = data.draw(st.integers(2, len(accumulators)))
        start = data.draw(st.integers(0, len(accumulators) - take))
        merged = fn.merge_accumulators(accumulators[start : start + take])
        accumulators[start : start + take] = [merged]

    total = fn.extract_output(accumulators[0])

    expected = _tree_sum(leaves)
    assert total.keys() == expected.keys() == {"count", "sum", "sum_abs", "jtj"}
    for name in expected:
        assert np.array_equal(total[name], expected[name]), name  # bit for bit
    assert int(total["count"]) == sum(int(leaf["count"]) for leaf in leaves)


def test_aggregate_combine_refuses_a_shard_twice_and_says_which_is_missing():
    leaf = partial(np.ones((1, 2, 2)), ("mean",))
    fn = AggregateFn(3)
    with pytest.raises(OutputError, match="shard partial 1 at level 0 arrived twice"):
        fn.merge_accumulators([fn.add_input({}, (1, leaf)), fn.add_input({}, (1, leaf))])
    with pytest.raises(OutputError, match="no partial sums for shard 1"):
        fn.extract_output(fn.add_input(fn.add_input({}, (0, leaf)), (2, leaf)))
    assert fn.extract_output(fn.create_accumulator()) is None


# --- run identity ----------------------------------------------------------------------------------------------


def _dict_config(**jacobian) -> dict:
    cfg = {
        "model": {"factory": "pkg.mod:model"},
        "input": {"paths": ["/data/*.npy"], "key": None},
        "jacobian": {"batch_size": 8, "project": {"dim": 16, "seed": 3}, **jacobian},
        "output": {"path": "/out", "samples_per_shard": 16},
    }
    return config.to_dict(config.validate(cfg))


def _leaves(prefix: str, section: dict) -> dict:
    found = {}
    for key, value in section.items():
        if isinstance(value, dict):
            found.update(_leaves(f"{prefix}{key}.", value))
        else:
            found[f"{prefix}{key}"] = value
    return found


def test_run_identity_holds_every_jacobian_key_but_threads_and_self_check():
    cfg = _dict_config(threads=3, self_check={"samples": 2, "on_mismatch": "warn"})
    identity = run_identity(cfg)
    jacobian = _leaves("jacobian.", cfg["jacobian"])
    assert "jacobian.threads" in jacobian and "jacobian.self_check.samples" in jacobian  # the config has them
    expected = {k: v for k, v in jacobian.items() if k != "jacobian.threads" and not k.startswith("jacobian.self_check.")}
    assert {k: v for k, v in identity.items() if k.startswith("jacobian.")} == expected
    assert "jacobian.project.seed" in identity  # nested keys too, dotted
    assert identity["output.samples_per_shard"] == 16 and identity["model.factory"] == "pkg.mod:model"
    assert not any(k.startswith(("input.paths", "output.path", "output.compression", "input.on_bad_sample")) for k in identity)


def test_run_key_ignores_threads_self_check_and_order_and_follows_everything_else():
    base = run_key(run_identity(_dict_config()))
    assert run_key(run_identity(_dict_config(threads=1, self_check={"samples": 0}))) == base
    reordered = dict(reversed(list(run_identity(_dict_config()).items())))
    assert run_key(reordered) == base
    for change in ({"batch_size": 9}, {"store_dtype": "float64"}, {"aggregate": ["mean"]}, {"project": {"seed": 4}}):
        assert run_key(run_identity(_dict_config(**change))) != base, change
    # Stable across versions and processes: folders written earlier must still be resumable.
    assert run_key({"a": 1, "b": [1, 2], "c": None}) == "9a0a99d8aab6f4b4"
    assert len(base) == 16 and int(base, 16) >= 0


# --- foreign output folders (pipeline.folder) -------------------------------------------------------------------


def _spec(data: Path, out: Path, samples_per_shard: int = 16):
    """This run's plan, as if the folder were to be overwritten (so the plan itself does not refuse it)."""
    return plan.make_job(
        _config(data, out, samples_per_shard), overwrite=True, check_model=False, identify_model=False
    ).spec


def test_a_folder_of_the_same_run_has_no_differences(fake_run):
    root, _, result, _ = fake_run
    folder = read_folder(str(root / "out"))
    assert folder.alien == [] and folder.manifest == result.manifest
    assert sorted(folder.shards) == [s["file"].split("/")[-1] for s in result.manifest["shards"]]
    assert folder_differences(folder, _spec(root / "data", root / "out"), result.manifest["model_fingerprint"]) == []


def test_a_folder_written_with_another_samples_per_shard_is_reported(fake_run):
    root, _, _, _ = fake_run
    differences = folder_differences(read_folder(str(root / "out")), _spec(root / "data", root / "out", 8), None)
    assert differences == [
        "manifest.json: written by a different run: output.samples_per_shard is 16 there, 8 in this run",
        "shards/shard-000000000000-000000000016.h5: not one of this run's shards (ids grouped differently: another "
        "input set or samples_per_shard) (so do 1 more shards)",
        "shards/shard-000000000032-000000000040.h5: written by a different run: output.samples_per_shard is 16 there, "
        "8 in this run",
    ]


def test_a_folder_written_with_other_model_weights_is_reported(fake_run):
    root, _, result, _ = fake_run
    other = "f" * 64
    differences = folder_differences(read_folder(str(root / "out")), _spec(root / "data", root / "out"), other)
    fingerprint = result.manifest["model_fingerprint"]
    assert differences == [  # the same difference in the manifest and every shard: one line
        f"manifest.json: model weights differ (fingerprint {fingerprint[:16]}… there, {other[:16]}… in this run) "
        "(so do 3 shards)",
    ]


def test_a_folder_computed_from_other_input_data_is_reported(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    _write_inputs(data)
    _fake_run(data, out)  # shards name their input files by path: a run of its own, whose inputs may change
    c = np.load(data / "c.npy")
    np.save(data / "c.npy", c[::-1].copy())  # ids 20..40: the same shape, other samples
    differences = folder_differences(read_folder(str(out)), _spec(data, out), None)
    assert differences == [
        "shards/shard-000000000016-000000000032.h5: computed from other input data (its ids now mean other samples) "
        "(so do 1 more shards)"
    ]


@pytest.mark.parametrize("name, content", [
    ("manifest.json", '{"my": "own manifest"}'),
    ("jacobians.h5", "not HDF5"),
    ("aggregates.h5", "not HDF5 either"),
    ("rejected.jsonl", '{"line": 1}\n'),
    ("shards/shard-000000000000-000000000016.h5", "a shard's name, other bytes"),
])
def test_a_file_with_a_jacobeam_name_but_other_content_is_alien(fake_run, tmp_path, name, content):
    root, _, _, _ = fake_run
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    (out / name).write_text(content)
    (out / "notes.txt").write_text("mine")  # not one of jacobeam's names: neither owned nor alien

    folder = read_folder(str(out))

    path = storage.join(storage.normalize(out), *name.split("/"))
    assert folder.alien == [path]
    assert path not in folder.owned and storage.join(storage.normalize(out), "notes.txt") not in folder.owned
    assert Path(name).name not in folder.shards
    if name == "manifest.json":
        assert folder.manifest is None
