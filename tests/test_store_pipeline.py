"""What to store, end to end: reductions and selections in the shards and jacobians.h5, and
aggregates.h5 exact however the work is split."""

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from tests import models as test_models
from tests.reference import assert_close, tape_loop

REPO = Path(__file__).resolve().parent.parent
SIZES = (9, 14, 5)


def _flow_inputs(folder: Path) -> np.ndarray:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(21)
    parts = [rng.normal(size=(n, 8)).astype(np.float32) for n in SIZES]
    for i, part in enumerate(parts):
        np.savez(folder / f"part-{i}.npz", x=part, labels=rng.integers(0, 8, size=len(part)))
    return np.concatenate(parts)


def _config(data: Path, out: Path, **jacobian):
    return config.validate(
        {
            "model": {"factory": "tests.models:coupling_flow"},
            "input": {"paths": [str(data / "*.npz")], "key": "x"},
            "jacobian": {"batch_size": 4, **jacobian},
            "output": {"path": str(out), "samples_per_shard": 6},
        }
    )


def _run(cfg, beam_args=()):
    return runner.run(cfg, list(beam_args), show_progress=False)


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    samples = _flow_inputs(root / "data")
    full = tape_loop(test_models.coupling_flow(), samples).astype(np.float64)
    return root, samples, full


AGGREGATE = {"reduce": "slogdet", "aggregate": ["mean", "mean_abs", "jtj"], "store_dtype": "float64"}


def test_slogdet_and_aggregates_end_to_end(flow, tmp_path):
    root, samples, full = flow
    manifest = _run(_config(root / "data", tmp_path / "out", **AGGREGATE)).manifest

    sign, logabsdet = np.linalg.slogdet(full)
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        assert "jacobian" not in view
        np.testing.assert_array_equal(view["sign"][:], sign)
        np.testing.assert_allclose(view["logabsdet"][:], logabsdet, atol=1e-5)
        np.testing.assert_array_equal(view["sample_id"][:], np.arange(len(samples)))
    with h5py.File(tmp_path / "out" / "aggregates.h5") as agg:
        assert agg["count"][()] == len(samples)
        assert_close(agg["mean"][:], full.mean(axis=0), rtol=1e-5)
        assert_close(agg["mean_abs"][:], np.abs(full).mean(axis=0), rtol=1e-5)
        assert_close(agg["jtj"][:], np.einsum("nrd,nre->de", full, full), rtol=1e-5)
    assert manifest["stored"] == {"outputs": "all", "reduce": "slogdet"}
    assert manifest["aggregates"] == {"file": "aggregates.h5", "count": 28, "datasets": ["jtj", "mean", "mean_abs"]}


@pytest.mark.slow
def test_aggregates_are_identical_across_workers_and_after_resume(flow, tmp_path, monkeypatch):
    root, _, _ = flow
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    one = tmp_path / "one"
    _run(_config(root / "data", one, **AGGREGATE))
    two = tmp_path / "two"
    _run(_config(root / "data", two, **AGGREGATE), ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"])
    with h5py.File(one / "aggregates.h5") as a, h5py.File(two / "aggregates.h5") as b:
        for name in ("count", "mean", "mean_abs", "jtj"):
            np.testing.assert_array_equal(a[name][()], b[name][()])
    # A resumed run takes the kept shards' partial sums from their files.
    (two / "shards" / "shard-000000000006-000000000012.h5").unlink()
    (two / "manifest.json").unlink()
    (two / "aggregates.h5").unlink()
    resumed = _run(_config(root / "data", two, **AGGREGATE)).manifest
    assert resumed["run"]["samples_computed"] == 6
    with h5py.File(one / "aggregates.h5") as a, h5py.File(two / "aggregates.h5") as b:
        for name in ("count", "mean", "mean_abs", "jtj"):
            np.testing.assert_array_equal(a[name][()], b[name][()])


def test_label_rows_end_to_end(flow, tmp_path):
    root, samples, full = flow
    labels = np.concatenate([np.load(root / "data" / f"part-{i}.npz")["labels"] for i in range(3)])
    manifest = _run(_config(root / "data", tmp_path / "out", outputs="label", labels={"key": "labels"})).manifest
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["output_index"][:, 0], labels)
        assert view["jacobian"].shape == (28, 1, 8)
        assert_close(view["jacobian"][:, 0], full[np.arange(28), labels], rtol=1e-5)
    assert manifest["stored"] == {"outputs": "label", "reduce": "none", "labels_key": "labels"}


def test_projection_end_to_end_records_its_seed(flow, tmp_path):
    root, _, full = flow
    manifest = _run(_config(root / "data", tmp_path / "out", reduce="project", project={"dim": 3, "seed": 5})).manifest
    assert manifest["stored"]["projection"] == {"dim": 3, "kind": "rademacher", "seed": 5}
    matrix = np.random.default_rng(5).choice([-1.0, 1.0], size=(8, 3)) / np.sqrt(3)
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        assert_close(view["projection"][:], full @ matrix, rtol=1e-5)


@pytest.mark.parametrize(
    "sets, message, status",
    [
        (["jacobian.outputs=label", "jacobian.labels={key: nolabels}"], r"part-0.npz: no array 'nolabels'", cli.FAILED),
        (
            ["jacobian.reduce=vjp", "jacobian.vectors=/no/vectors.npy"],
            r"jacobian.vectors /no/vectors.npy: no such file",
            cli.FAILED,
        ),
        (
            ["jacobian.reduce=trace", "jacobian.outputs=argmax"],
            r"jacobian.reduce: trace needs every output row",
            cli.USAGE,
        ),
        (
            ["jacobian.reduce=jvp", "jacobian.vectors=v.npy", "jacobian.aggregate=[mean]"],
            r"jacobian.aggregate: needs the Jacobian",
            cli.USAGE,
        ),
    ],
)
def test_invalid_combinations_are_refused_before_anything_is_written(flow, tmp_path, capsys, sets, message, status):
    root, _, _ = flow
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(_config(root / "data", tmp_path / "out").model_dump(mode="json")))
    assert cli.main(["-q", "run", str(path), *[a for s in sets for a in ("--set", s)]]) == status
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
