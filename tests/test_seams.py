"""Beam's test seams: a whole ``jacobeam run`` job in a ``TestPipeline`` with the closed-form fake engine
(``transforms.testing.fake_engine``, the job in ``tests/fake_runs.py``), and ``ComputeJacobians`` checked
with ``assert_that``. Shard tiling and id placement are tested in ``test_ids.py``, the aggregates'
``CombineFn`` in ``test_aggregate_combine.py``, the run identity and foreign folders in
``test_folder_differences.py``.

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

from jacobeam.pipeline import plan, runner, verify
from jacobeam.transforms import (
    ComputeJacobians,
    EngineOptions,
    JacobianBatch,
    ReadSamples,
    SampleBatch,
    WriteShards,
)
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.output.shards import ShardRecord
from jacobeam.transforms.output.storage import sha256
from jacobeam.transforms.spec import Reduction
from jacobeam.transforms.testing.fake_engine import FakeEngine, FakeEngineFactory
from tests.fake_runs import BAD_ID, FACTORY, MODEL, SHAPE, run_config, run_once, run_with_fake_engine, write_inputs


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



@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One whole run with the fake engine; tests below copy its folder before changing anything."""
    return run_once(tmp_path_factory.mktemp("seams"))


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


def test_a_run_freezes_the_heap_only_while_it_runs_and_unfreezes_it_when_it_fails(tmp_path):
    """``runner._heap_frozen``: what was alive when the run was planned is out of the collector's passes
    while it runs, and collectable again after it, whether it ended well or not."""
    import gc

    write_inputs(tmp_path / "data")
    frozen = []
    pipeline = test_pipeline.TestPipeline(runner=FnApiRunner())
    runner.run(run_config(tmp_path / "data", tmp_path / "out"), [], show_progress=False, pipeline=pipeline,
               engine_factory=FACTORY, planned=lambda spec: frozen.append(gc.get_freeze_count()))
    assert frozen[0] > 0 and gc.get_freeze_count() == 0

    def fail(spec):
        raise RuntimeError("stopped after planning")

    with pytest.raises(RuntimeError, match="stopped after planning"):
        runner.run(run_config(tmp_path / "data", tmp_path / "out2"), [], show_progress=False,
                   pipeline=test_pipeline.TestPipeline(runner=FnApiRunner()), engine_factory=FACTORY, planned=fail)
    assert gc.get_freeze_count() == 0


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

    result, _ = run_with_fake_engine(root / "data", out)

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


def test_a_row_whose_shard_file_is_missing_reads_as_nan_and_id_minus_one_never_as_zeros(fake_run, tmp_path):
    """The view's fill values: a shard deleted under a finished folder (a rerun that deleted it and then
    failed, say) leaves rows no reader can take for data."""
    root, _, result, _ = fake_run
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    shards = result.manifest["shards"]
    (out / shards[1]["file"]).unlink()
    first, lost = shards[0]["num_samples"], shards[1]["num_samples"]
    with h5py.File(out / "jacobians.h5") as view:
        ids, jacobians, outputs, flags = (view[name][()] for name in ("sample_id", "jacobian", "output", "nonfinite"))
    gone = slice(first, first + lost)
    assert (ids[gone] == -1).all() and np.isnan(jacobians[gone]).all() and np.isnan(outputs[gone]).all()
    assert flags[gone].all()
    kept = np.r_[0:first, first + lost : len(ids)]
    assert (ids[kept] >= 0).all() and np.isfinite(jacobians[kept]).all() and not flags[kept].any()


def test_read_compute_write_composed_in_a_users_pipeline_give_the_same_folder_as_the_run(fake_run, tmp_path):
    """``ReadSamples | ComputeJacobians | WriteShards`` on a planned job: the batches are grouped by their
    planned shard, every shard and aggregate the same bit for bit as ``jacobeam run``'s."""
    root, _, first, _ = fake_run
    out = tmp_path / "out"
    cfg = run_config(root / "data", out)
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
