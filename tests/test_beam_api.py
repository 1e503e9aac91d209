"""The Beam-native API in a pipeline of a user's own: ComputeJacobians on keyed samples, WriteShards to a
folder that jacobeam's own tools read."""

import json
import os
import socket
import time
from pathlib import Path

import apache_beam as beam
import h5py
import numpy as np
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from jacobeam.pipeline import verify
from jacobeam.transforms import ComputeJacobians, EngineOptions, JacobianBatch, ModelSource, WriteShards, pipeline_spec
from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output.layout import LEASE
from jacobeam.transforms.output.lease import LeaseBusy
from tests import models as test_models
from tests.reference import assert_close, tape_loop, tape_loop_inputs

MODEL = ModelSource(factory="tests.models:small_cnn")
SHAPE = (8, 8, 1)


@pytest.fixture(scope="module")
def samples() -> np.ndarray:
    return np.random.default_rng(11).normal(size=(23, *SHAPE)).astype(np.float32)


@pytest.fixture(scope="module")
def expected(samples) -> np.ndarray:
    return tape_loop(test_models.small_cnn(), samples)


def _close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-5) -> bool:
    """``reference.assert_close`` as a predicate: within ``rtol`` of the reference's largest entry."""
    if actual.shape != expected.shape:
        return False
    scale = max(float(np.abs(expected).max()), 1e-12)
    return float(np.abs(actual.astype(np.float64) - expected).max()) / scale <= rtol


def _same_record(expected, actual) -> bool:
    """``equal_to``'s ``equals_fn`` for ``(key, {dataset: array})``: the same key, and each expected
    dataset close to the record's."""
    (key, datasets), (other_key, other) = expected, actual
    return key == other_key and all(name in other and _close(other[name], value) for name, value in datasets.items())


def test_keyed_samples_become_records_with_their_keys(samples, expected):
    wanted = [(f"s{i}", {"jacobian": expected[i]}) for i in range(5)]  # each key once, its sample's Jacobian
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
        records = (
            pipeline
            | beam.Create([(f"s{i}", samples[i]) for i in range(5)])
            | ComputeJacobians(MODEL, SHAPE, EngineOptions(batch_size=2))
            | beam.FlatMap(JacobianBatch.records)
        )
        assert_that(records, equal_to(wanted, equals_fn=_same_record))


def test_keyed_samples_of_a_two_input_model():
    rng = np.random.default_rng(6)
    images, metas = rng.normal(size=(5, 4, 4, 1)).astype(np.float32), rng.normal(size=(5, 3)).astype(np.float32)
    expected = tape_loop_inputs(test_models.two_inputs("float64"), {"image": images, "meta": metas})

    wanted = [(i, {f"jacobian/{name}": expected[name][i] for name in ("image", "meta")}) for i in range(5)]
    shapes = {"image": (4, 4, 1), "meta": (3,)}
    examples = [(i, {"image": images[i], "meta": metas[i]}) for i in range(5)]
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
        records = (
            pipeline
            | beam.Create(examples)
            | ComputeJacobians(ModelSource(factory="tests.models:two_inputs"), shapes, EngineOptions(batch_size=2))
            | beam.FlatMap(JacobianBatch.records)
        )
        assert_that(records, equal_to(wanted, equals_fn=_same_record))


def test_a_users_pipeline_writes_the_same_folder_as_jacobeam_run(tmp_path, samples, expected):
    out = tmp_path / "out"
    spec = pipeline_spec(str(out), MODEL, SHAPE, EngineOptions(batch_size=4), samples_per_shard=8)
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
        manifests = (
            pipeline
            | beam.Create(list(enumerate(samples))[::-1])  # any order
            | ComputeJacobians(MODEL, SHAPE, EngineOptions(batch_size=4))
            | WriteShards(spec)
        )
        summary = manifests | beam.Map(
            lambda m: (m["num_samples"], m["num_rows"], [(s["start"], s["stop"]) for s in m["shards"]])
        )
        assert_that(summary, equal_to([(23, 23, [(0, 8), (8, 16), (16, 23)])]))  # WriteShards' one output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == manifest["num_rows"] == 23
    assert [(s["start"], s["stop"]) for s in manifest["shards"]] == [(0, 8), (8, 16), (16, 23)]
    with h5py.File(out / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], np.arange(23))
        assert_close(view["jacobian"][:], expected)
    report = verify.verify(str(out), samples=0)
    assert report.ok, report.problems


def test_write_shards_refuses_ids_with_a_gap(tmp_path, samples):
    spec = pipeline_spec(str(tmp_path / "out"), MODEL, SHAPE, EngineOptions(batch_size=4), samples_per_shard=8)
    keyed = [(i, samples[i]) for i in (0, 1, 2, 4)]
    with pytest.raises(Exception, match=r"the shard of ids 0 to 4 holds a gap in the ids \(id 3 missing\)"):
        with beam.Pipeline(runner=FnApiRunner()) as pipeline:
            _ = pipeline | beam.Create(keyed) | ComputeJacobians(MODEL, SHAPE, EngineOptions(batch_size=4)) | WriteShards(spec)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_write_shards_needs_integer_ids(tmp_path, samples):
    spec = pipeline_spec(str(tmp_path / "out"), MODEL, SHAPE, EngineOptions(batch_size=4))
    with pytest.raises(Exception, match="keyed by its id"):
        with beam.Pipeline(runner=FnApiRunner()) as pipeline:
            _ = pipeline | beam.Create(list(samples[:3])) | ComputeJacobians(MODEL, SHAPE, EngineOptions()) | WriteShards(spec)


def test_aggregates_are_refused_for_a_users_pipeline(tmp_path):
    with pytest.raises(ValueError, match="aggregate"):
        pipeline_spec(str(tmp_path), MODEL, SHAPE, EngineOptions(aggregate=("mean",)))


def test_a_shard_with_rows_missing_is_an_error_and_leaves_no_file(tmp_path, samples):
    """Each shard is written by one process call, whole; a shard whose rows did not all arrive must fail
    the bundle, not commit or leave a half shard."""
    from jacobeam.transforms.elements import JacobianBatch as Batch
    from jacobeam.transforms.spec import ShardRange
    from jacobeam.transforms.write_shards import WriteShardFn

    spec = pipeline_spec(str(tmp_path / "out"), MODEL, SHAPE, samples_per_shard=8)
    fn = WriteShardFn(spec)
    half = Batch(ids=np.arange(4), datasets={"jacobian": np.zeros((4, 3, 2)), "output": np.zeros((4, 3))}, shard=ShardRange(0, 8))
    with pytest.raises(OutputError, match="4 rows written, 8 planned"):
        list(fn.process(half))
    assert not list((tmp_path / "out" / "shards").iterdir())


def _write(spec, samples, replace=False):
    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        _ = (
            pipeline
            | beam.Create(list(enumerate(samples)))
            | ComputeJacobians(MODEL, SHAPE, spec.engine)
            | WriteShards(spec, replace=replace)
        )
    return json.loads((Path(spec.output_dir) / "manifest.json").read_text())


def test_write_shards_refuses_a_folder_holding_another_runs_result_unless_told_to_replace_it(tmp_path, samples):
    out = tmp_path / "out"
    first = _write(pipeline_spec(str(out), MODEL, SHAPE, EngineOptions(batch_size=4), samples_per_shard=8), samples)
    before = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    other = pipeline_spec(str(out), MODEL, SHAPE, EngineOptions(batch_size=8), samples_per_shard=16)

    with pytest.raises(OutputError, match=rf"output folder {out} holds another run's result \(manifest.json of run key "
                                          rf"{first['run_key']}; 3 shard\(s\), shards/shard-000000000000-000000000008.h5 "
                                          r"first\): WriteShards\(spec, replace=True\)"):
        _write(other, samples)
    assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == before  # untouched
    assert not (out / LEASE).exists()  # the refusal released the folder

    replaced = _write(other, samples[:20], replace=True)
    assert replaced["run_key"] == other.run_key != first["run_key"]
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "shard-000000000000-000000000016.h5", "shard-000000000016-000000000020.h5"
    ]  # no shard of the first run left behind
    assert not (out / LEASE).exists()  # released when the manifest was written
    assert verify.verify(str(out), samples=0).ok


def test_building_a_pipeline_touches_nothing_and_a_failed_one_holds_nothing(tmp_path, samples):
    """``WriteShards(replace=True)`` claims the folder when the pipeline runs, not when it is built: a
    pipeline built and never run leaves another run's result byte for byte and takes no lease. One that
    fails holds nothing afterwards (no lease file, no lease or heartbeat left in the process) and has not
    touched the result it was to replace."""
    import threading

    from jacobeam.transforms.output import lease

    out = tmp_path / "out"
    _write(pipeline_spec(str(out), MODEL, SHAPE, EngineOptions(batch_size=4), samples_per_shard=8), samples)
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    other = pipeline_spec(str(out), MODEL, SHAPE, EngineOptions(batch_size=8), samples_per_shard=16)
    pipeline = beam.Pipeline(runner=FnApiRunner())
    _ = (pipeline | beam.Create(list(enumerate(samples))) | ComputeJacobians(MODEL, SHAPE, other.engine)
         | WriteShards(other, replace=True))
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert not (out / LEASE).exists()

    keyed = [(i, samples[i]) for i in (0, 1, 2, 4)]  # a gap: fails after the claim, in the shards' step
    with pytest.raises(Exception, match="a gap in the ids"):
        with beam.Pipeline(runner=FnApiRunner()) as failing:
            _ = failing | beam.Create(keyed) | ComputeJacobians(MODEL, SHAPE, other.engine) | WriteShards(other, replace=True)
    assert not (out / LEASE).exists() and not lease._held
    assert not [t for t in threading.enumerate() if t.name == "jacobeam lease heartbeat"]
    # The replacement was written in a folder of its own: the failed one left the old result as it was
    # (it had removed it when it began), and the next one moves its result in.
    kept = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".jacobeam-overwrite" not in p.parts}
    assert kept == before and verify.verify(str(out), samples=2).ok
    replaced = _write(other, samples[:20], replace=True)
    assert replaced["output_dir"] == str(out) and sorted(p.name for p in out.iterdir()) == [
        "inputs.h5", "jacobians.h5", "manifest.json", "rejected.jsonl", "shards"]
    assert verify.verify(str(out), samples=4).ok and not lease._held


def test_write_shards_into_a_folder_another_live_run_holds_is_refused_as_busy(tmp_path, samples):
    out = tmp_path / "out"
    out.mkdir()
    holder = {"holder": "0123456789ab", "host": socket.gethostname(), "pid": os.getppid(), "started_at": time.time(),
              "heartbeat": time.time()}
    (out / LEASE).write_text(json.dumps(holder))
    spec = pipeline_spec(str(out), MODEL, SHAPE, EngineOptions(batch_size=4), samples_per_shard=8)
    with pytest.raises(LeaseBusy, match=rf"output folder {out} is being written by run 0123456789ab .*; run the "
                                        r"pipeline again once that run has ended, or write another output_dir"):
        _write(spec, samples)
    assert sorted(p.name for p in out.iterdir()) == [LEASE]


def test_one_write_shards_applied_twice_in_a_pipeline_is_refused_when_built(tmp_path, samples):
    """Its second application claimed the folder as a retry of the first (one run id) and wrote a second
    result over the first's: a folder of one's manifest and the other's shards, called complete."""
    spec = pipeline_spec(str(tmp_path / "out"), MODEL, SHAPE, EngineOptions(batch_size=4), samples_per_shard=8)
    write = WriteShards(spec)
    pipeline = beam.Pipeline(runner=FnApiRunner())
    computed = pipeline | beam.Create(list(enumerate(samples))) | ComputeJacobians(MODEL, SHAPE, spec.engine)
    _ = computed | "A" >> write
    with pytest.raises(ValueError, match=r"WriteShards to .*out is applied twice in one pipeline: .*make one WriteShards"):
        _ = computed | "B" >> write
    assert not (tmp_path / "out").exists()
