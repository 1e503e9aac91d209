"""``jacobeam verify``: checksums, coverage, independent recomputation; and ``run --verify K``."""

import hashlib
import json
import shutil

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.recompute import FD_RTOL, TAPE_RTOL, finite_differences, float64_twin
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.output.storage import crc32c
from tests import models as test_models
from tests.test_pipeline import write_inputs


def _config(data, out):
    return config.validate(
        {
            "model": {"factory": "tests.models:small_cnn"},
            "input": {"paths": [str(data / "*.npy")]},
            "jacobian": {"batch_size": 8},
            "output": {"path": str(out), "samples_per_shard": 16},
        }
    )


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    write_inputs(root / "data", (8, 8, 1))
    runner.run(_config(root / "data", root / "out"), [], show_progress=False)
    return root


@pytest.fixture
def copy(clean, tmp_path):
    shutil.copytree(clean / "out", tmp_path / "out")
    return tmp_path / "out"


def test_clean_output_verifies_with_small_errors(clean, capsys):
    status = cli.main(["verify", str(clean / "out"), "--samples", "6"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "verified" in printed and "3 checked against the manifest's checksums" in printed
    report = verify(clean / "out", samples=6, seed=3)
    assert report.ok and len(report.samples) == 6 and len(set(report.samples)) == 6
    assert report.max_rel_error["tape"] < TAPE_RTOL / 10
    assert report.max_rel_error["finite_differences"] < FD_RTOL / 10
    assert report.finite_differences.startswith("float64 central differences (step 1e-06) on 6 sample(s)")
    assert verify(clean / "out", samples=6, seed=3).samples == report.samples  # seeded choice


def test_a_flipped_byte_in_a_shard_is_caught(copy, capsys):
    shard = copy / "shards" / "shard-000000000016-000000000032.h5"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert cli.main(["verify", str(copy), "--samples", "0"]) == 1
    out = capsys.readouterr().out
    assert "VERIFICATION FAILED" in out
    assert "shards/shard-000000000016-000000000032.h5: crc32c differs from the manifest's" in out


def _as_written_before_crc32c(out):
    """The folder as a run before CRC32C left it: its manifest lists each shard's sha256, no crc32c."""
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:
        del entry["crc32c"]
        entry["sha256"] = hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_with_sha256_from_before_crc32c_verifies_and_catches_a_flipped_byte(copy):
    _as_written_before_crc32c(copy)
    report = verify(copy, samples=0)
    assert report.ok and report.shards_checked == 3, report.problems

    shard = copy / "shards" / "shard-000000000016-000000000032.h5"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert verify(copy, samples=0).problems == [
        "shards/shard-000000000016-000000000032.h5: sha256 differs from the manifest's (the file was changed)"
    ]


def test_a_shard_without_a_checksum_in_the_manifest_is_a_problem(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["shards"][0]["crc32c"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert verify(copy, samples=0).problems == [
        "shards/shard-000000000000-000000000016.h5: the manifest lists no checksum (crc32c or sha256)"
    ]


def test_wrong_values_behind_a_matching_checksum_are_caught_by_recomputation(copy):
    """A shard whose values were changed and whose checksum was updated to match: only recomputing
    the sample can tell, and both independent methods do."""
    shard = copy / "shards" / "shard-000000000016-000000000032.h5"
    with h5py.File(shard, "r+") as h5:
        jac = h5["jacobian"][5]
        jac.flat[np.argmax(np.abs(jac))] *= 1.01  # 1% off in one entry of sample 21
        h5["jacobian"][5] = jac
    manifest = json.loads((copy / "manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["crc32c"] = crc32c(copy / entry["file"])
    (copy / "manifest.json").write_text(json.dumps(manifest))

    report = verify(copy, samples=40)

    assert not report.ok
    assert not any("crc32c" in p for p in report.problems)
    assert any(p.startswith("sample 21 (shards/shard-000000000016-000000000032.h5 row 5): tape max relative error 0.01")
               for p in report.problems), report.problems
    assert any(p.startswith("sample 21 ") and "finite differences" in p for p in report.problems)
    assert sum("sample" in p for p in report.problems) == 2  # no other sample is blamed


def test_missing_and_duplicated_ids_are_caught(copy):
    (copy / "shards" / "shard-000000000032-000000000040.h5").unlink()
    report = verify(copy, samples=0)
    assert "shards/shard-000000000032-000000000040.h5: listed in the manifest but missing" in report.problems
    assert "ids missing (neither stored nor rejected): 8, first [32, 33, 34, 35, 36]" in report.problems

    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"] = [manifest["shards"][0], manifest["shards"][0], manifest["shards"][1]]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert any(p.startswith("ids present more than once: 16, first [0, 1, 2, 3, 4]") for p in verify(copy).problems)


def test_a_changed_model_is_reported_not_blamed_on_the_samples(copy, monkeypatch):
    monkeypatch.setattr(test_models, "small_cnn", lambda dtype="float32": test_models.small_mlp(dtype))
    report = verify(copy, samples=2)
    assert [p for p in report.problems if "fingerprint" in p and "cannot recompute" in p]
    assert not report.samples or not any(p.startswith("sample") for p in report.problems)


def test_run_verify_records_the_result_in_the_manifest(tmp_path, capsys):
    write_inputs(tmp_path / "data", (8, 8, 1))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(tmp_path / "data", tmp_path / "out").model_dump(mode="json")))
    assert cli.main(["-q", "run", str(cfg), "--verify", "3"]) == 0
    assert "verified" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["verify"]["ok"] is True and manifest["verify"]["samples_recomputed"] == 3
    assert manifest["verify"]["max_rel_error"]["tape"] < TAPE_RTOL
    assert verify(tmp_path / "out").ok  # recording the result kept the manifest valid


def test_unfinished_folder_fails_verification(copy):
    (copy / "manifest.json").unlink()
    report = verify(copy)
    assert report.problems == ["no manifest.json: the run did not finish; nothing to verify"]


# --- the finite-difference reference itself -----------------------------------------------------------


def test_float64_twin_matches_the_model_and_computes_in_float64(rng):
    from jacobeam.transforms.engine.models import LoadedModel, wrap_model

    for build in (test_models.small_mlp, test_models.small_cnn, test_models.grid_model, test_models.scalar_model):
        model = build()
        twin, why_not = float64_twin(wrap_model(model, "test"))
        assert why_not is None
        x = rng.normal(size=(3, *model.input_shape[1:]))
        y64 = twin([x])
        assert y64.dtype == np.float64
        np.testing.assert_allclose(y64, build("float64")(x).numpy(), rtol=1e-12, atol=1e-12)
    plain = LoadedModel(lambda xs: xs[0] * 2, [], "a plain function")
    why = "the model is not a Keras model (a SavedModel or tf.Module cannot be rebuilt in float64)"
    assert float64_twin(plain) == (None, why)


def test_finite_differences_match_the_analytic_jacobian_and_detect_kinks(rng):
    import keras

    model = test_models.small_mlp("float64")
    x = rng.normal(size=12)
    central, differentiable = finite_differences(lambda z: model(z).numpy(), x)
    w1, b1 = model.layers[0].get_weights()
    w2, _ = model.layers[1].get_weights()
    analytic = (w2.T * (1 - np.tanh(x @ w1 + b1) ** 2)) @ w1.T  # (5, 12)
    assert differentiable
    np.testing.assert_allclose(central, analytic, atol=1e-8 * np.abs(analytic).max())

    relu = keras.Sequential([keras.Input((3,), dtype="float64"), keras.layers.ReLU(dtype="float64")])
    assert finite_differences(lambda z: relu(z).numpy(), np.array([1.0, -2.0, 0.5]))[1]
    assert not finite_differences(lambda z: relu(z).numpy(), np.array([1.0, 0.0, 0.5]))[1]  # relu at exactly 0


def test_samples_at_kinks_are_left_out_of_the_finite_difference_check(tmp_path):
    """A constant input puts every max-pool window on a tie: automatic differentiation picks one of
    many derivatives there, and finite differences cannot check it. The tape check still runs."""
    data = tmp_path / "data"
    data.mkdir()
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype(np.float32)
    x[2] = 0.0
    np.save(data / "x.npy", x)
    runner.run(_config(data, tmp_path / "out"), [], show_progress=False)
    report = verify(tmp_path / "out", samples=4)
    assert report.ok, report.problems
    assert "on 3 sample(s); 1 sample(s) left out: the model is not differentiable there" in report.finite_differences
    assert "e.g. id 2" in report.finite_differences


def test_selected_rows_and_half_precision_storage_are_verified_against_the_same_rows(tmp_path):
    """outputs: top_k stores k rows per sample (and which, in output_index); float16 storage rounds.
    verify compares exactly those rows, within float16's rounding, and still catches a wrong row."""
    write_inputs(tmp_path / "data", (8, 8, 1))
    cfg = _config(tmp_path / "data", tmp_path / "out").model_dump(mode="json")
    cfg["jacobian"].update(outputs={"top_k": 2}, store_dtype="float16")
    runner.run(config.validate(cfg), [], show_progress=False)
    report = verify(tmp_path / "out", samples=5)
    assert report.ok, report.problems
    assert report.tolerances["tape"] == 2 * 2.0**-10
    assert report.max_rel_error["tape"] <= 2 * 2.0**-10  # both rounded to float16: mostly equal

    shard = tmp_path / "out" / "shards" / "shard-000000000000-000000000016.h5"
    with h5py.File(shard, "r+") as h5:
        index = h5["output_index"][3]
        h5["output_index"][3] = index[::-1]  # claim the two rows are the other way round
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["shards"][0]["crc32c"] = crc32c(shard)
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    report = verify(tmp_path / "out", samples=40)
    assert [p.split(" (")[0] for p in report.problems if p.startswith("sample")] == ["sample 3", "sample 3"]


def test_a_folder_whose_config_named_the_model_by_a_relative_path_verifies_from_any_directory(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    test_models.small_mlp().save(tmp_path / "models" / "mlp.keras")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(10, 12)).astype(np.float32))
    monkeypatch.chdir(tmp_path)
    cfg = config.validate({
        "model": {"path": "models/mlp.keras"},
        "input": {"paths": ["x.npy"]},
        "output": {"path": "out", "samples_per_shard": 4},
    })
    runner.run(cfg, [], show_progress=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    report = verify(tmp_path / "out", samples=3)

    assert report.ok, report.as_dict()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["config"]["model"]["path"] == str(
        tmp_path / "models" / "mlp.keras"
    )
    # The same config, resumed from its own directory, is the same run.
    monkeypatch.chdir(tmp_path)
    assert runner.run(cfg, [], show_progress=False).manifest["run"]["samples_computed"] == 0
