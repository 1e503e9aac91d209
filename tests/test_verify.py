"""``jacobeam verify``: checksums, coverage, independent recomputation; and ``run --verify K``."""

import hashlib
import json
import shutil

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.verify import format_report, verify
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
    assert report.checked["jacobian"]["max_error"] < report.tolerance / 10
    assert report.checked["jacobian"]["of_bound"] <= 0.1  # no row came near its bound
    assert "float64 copy of the model" in report.method
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


@pytest.mark.parametrize("damage", ["value", "byte"])
def test_a_rerun_computes_again_a_shard_changed_after_its_run_and_does_not_adopt_it(copy, clean, caplog, damage):
    """A shard edited in place (a value scaled by 1.5 through h5py) or damaged on disk (a flipped byte) after
    its run: the rerun took it as complete and wrote its new checksum into the manifest, after which
    ``verify --samples 0`` passed it. Now the rerun warns, computes it again (as it was), and verifies."""
    name = "shard-000000000016-000000000032.h5"
    shard = copy / "shards" / name
    original, others = _datasets(shard), {p.name: p.read_bytes() for p in (copy / "shards").iterdir() if p.name != name}
    if damage == "value":
        with h5py.File(shard, "r+") as h5:
            h5["jacobian"][5] = 1.5 * h5["jacobian"][5]
    else:
        raw = bytearray(shard.read_bytes())
        raw[-100] ^= 0x01
        shard.write_bytes(bytes(raw))

    with caplog.at_level("WARNING", logger="jacobeam"):
        runner.run(_config(clean / "data", copy), [], show_progress=False)

    assert f"{shard}: its bytes differ from those the manifest lists" in caplog.text
    for key, values in _datasets(shard).items():
        np.testing.assert_array_equal(values, original[key], err_msg=key)
    assert {p.name: p.read_bytes() for p in (copy / "shards").iterdir() if p.name != name} == others  # untouched
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["run"]["samples_computed"] == 16
    assert verify(copy, samples=0).ok


def _datasets(shard):
    with h5py.File(shard) as h5:
        return {key: h5[key][:] for key in h5 if isinstance(h5[key], h5py.Dataset)}


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
    assert [p for p in report.problems if p.startswith("sample")] == [
        "sample 21 (shards/shard-000000000016-000000000032.h5 row 5): jacobian differs from the reference "
        "(tf.GradientTape gradient of one sample, one output row per copy, float64 copy of the model) by max relative "
        "error 0.01, bound 0.0001 (tolerance 0.0001, or 4x the error of an independent per-sample computation, at most 0.25)"
    ], report.problems


def test_missing_and_duplicated_ids_are_caught(copy):
    (copy / "shards" / "shard-000000000032-000000000040.h5").unlink()
    report = verify(copy, samples=0)
    assert "shards/shard-000000000032-000000000040.h5: listed in the manifest but missing" in report.problems
    assert "ids missing (neither stored, rejected nor removed): 8, first [32, 33, 34, 35, 36]" in report.problems
    shown = format_report(report)  # the ids line says what was found, never "each ... exactly once" beside it
    assert (f"  ids         {report.ids_checked} checked: 8 not stored, rejected or removed exactly once "
            "(the problems below)") in shown
    assert "exactly once\n" not in shown

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
    assert manifest["verify"]["datasets"]["jacobian"]["max_error"] < manifest["verify"]["tolerance"]
    assert verify(tmp_path / "out").ok  # recording the result kept the manifest valid


def test_unfinished_folder_fails_verification(copy):
    (copy / "manifest.json").unlink()
    report = verify(copy)
    assert report.problems == ["no manifest.json: the run did not finish; nothing to verify"]


def test_selected_rows_and_half_precision_storage_are_verified_against_the_same_rows(tmp_path):
    """outputs: top_k stores k rows per sample (and which, in output_index); float16 storage rounds.
    verify compares exactly those rows, within float16's rounding, and still catches a wrong row."""
    write_inputs(tmp_path / "data", (8, 8, 1))
    cfg = _config(tmp_path / "data", tmp_path / "out").model_dump(mode="json")
    cfg["jacobian"].update(outputs={"top_k": 2}, store_dtype="float16")
    runner.run(config.validate(cfg), [], show_progress=False)
    report = verify(tmp_path / "out", samples=5)
    assert report.ok, report.problems
    assert report.tolerance == 2 * 2.0**-10
    assert report.checked["jacobian"]["max_error"] <= 2 * 2.0**-10  # both rounded to float16: mostly equal

    shard = tmp_path / "out" / "shards" / "shard-000000000000-000000000016.h5"
    with h5py.File(shard, "r+") as h5:
        index = h5["output_index"][3]
        h5["output_index"][3] = index[::-1]  # claim the two rows are the other way round
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["shards"][0]["crc32c"] = crc32c(shard)
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    report = verify(tmp_path / "out", samples=40)
    assert [p.split(" (")[0] for p in report.problems if p.startswith("sample")] == ["sample 3"]


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


def test_a_folder_whose_config_named_the_vectors_by_a_relative_path_verifies_from_any_directory(tmp_path, monkeypatch):
    (tmp_path / "vectors").mkdir()
    np.save(tmp_path / "vectors" / "u.npy", np.random.default_rng(1).normal(size=(2, 5)))  # over small_mlp's 5 outputs
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(10, 12)).astype(np.float32))
    monkeypatch.chdir(tmp_path)
    cfg = config.validate({
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": ["x.npy"]},
        "jacobian": {"reduce": "vjp", "vectors": "vectors/u.npy"},
        "output": {"path": "out", "samples_per_shard": 4},
    })
    runner.run(cfg, [], show_progress=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    report = verify(tmp_path / "out", samples=3)

    assert report.ok and report.checked["vjp"]["samples"] == 3, report.as_dict()
    recorded = json.loads((tmp_path / "out" / "manifest.json").read_text())["config"]["jacobian"]
    assert recorded["vectors"] == str(tmp_path / "vectors" / "u.npy")
    monkeypatch.chdir(tmp_path)
    assert runner.run(cfg, [], show_progress=False).manifest["run"]["samples_computed"] == 0


# reduce: the dataset whose value is altered, the model (slogdet needs a square one), more of jacobian
_REDUCTIONS = {
    "sum_abs_over_channels": ("saliency", "small_cnn", {"outputs": {"top_k": 1}}),
    "vjp": ("vjp", "small_cnn", {}),
    "slogdet": ("logabsdet", "square_softplus", {}),
}


@pytest.mark.parametrize("reduce", list(_REDUCTIONS))
def test_a_reduction_is_recomputed_and_an_altered_value_caught(tmp_path, reduce):
    name, model, jacobian = _REDUCTIONS[reduce]
    write_inputs(tmp_path / "data", (6,) if model == "square_softplus" else (8, 8, 1))
    cfg = _config(tmp_path / "data", tmp_path / "out").model_dump(mode="json")
    cfg["model"] = {"factory": f"tests.models:{model}"}
    cfg["jacobian"].update(reduce=reduce, **jacobian)
    if reduce == "vjp":  # two fixed vectors u over small_cnn's 3 outputs
        np.save(tmp_path / "u.npy", np.random.default_rng(1).normal(size=(2, 3)))
        cfg["jacobian"]["vectors"] = str(tmp_path / "u.npy")
    runner.run(config.validate(cfg), [], show_progress=False)
    out = tmp_path / "out"
    report = verify(out, samples=40)
    assert report.ok, report.problems
    assert report.checked[name]["samples"] == 40
    shard = out / "shards" / "shard-000000000016-000000000032.h5"
    with h5py.File(shard, "r+") as h5:
        value = np.array(h5[name][5])
        if name == "logabsdet":  # compared absolutely: |det| 1% off
            value += np.log(1.01)
        else:
            value.flat[np.argmax(np.abs(value))] *= 1.01
        h5[name][5] = value
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["crc32c"] = crc32c(out / entry["file"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = [p for p in verify(out, samples=40).problems if p.startswith("sample")]
    assert len(problems) == 1 and problems[0].startswith("sample 21 ") and f": {name} differs" in problems[0], problems


def test_aggregates_are_checked_against_the_shards_partial_sums(tmp_path):
    write_inputs(tmp_path / "data", (8, 8, 1))
    cfg = _config(tmp_path / "data", tmp_path / "out").model_dump(mode="json")
    cfg["jacobian"]["aggregate"] = ["mean", "jtj"]
    runner.run(config.validate(cfg), [], show_progress=False)
    report = verify(tmp_path / "out", samples=2)
    assert report.ok, report.problems
    assert "bit for bit" in report.aggregates
    with h5py.File(tmp_path / "out" / "aggregates.h5", "r+") as h5:
        h5["jtj"][0, 0] = h5["jtj"][0, 0] * (1 + 1e-9)
    assert verify(tmp_path / "out", samples=0).problems == [
        "aggregates.h5: jtj differs from the tree-sum of the shards' partial sums"
    ]


def _two_rows_judged(stored_offsets):
    """A two-row dataset judged against its truth: row 0's own float32 computation is 2e-4 off (a bound of
    4 x 2e-4), row 1's exact (the tolerance, 1e-4); ``stored_offsets`` are what each stored row is off by."""
    from types import SimpleNamespace

    from jacobeam.transforms.self_check import _Judgement

    checker = SimpleNamespace(tolerance=1e-4, compute="float32", _floor=float(np.finfo(np.float32).tiny),
                              plain=SimpleNamespace(split_rows=lambda name, values, rows: np.reshape(values, (rows, -1)),
                                                    least_scales=lambda name, rows: np.zeros(rows)))
    truth = np.array([[1.0, 0.5, 0.2], [1.0, 0.3, 0.1]])
    own = truth + np.array([[2e-4, 0, 0], [0, 0, 0]])
    stored = truth + np.array([[stored_offsets[0], 0, 0], [0, stored_offsets[1], 0]])
    return _Judgement(checker, ["jacobian"], {"jacobian": truth}, {"jacobian": stored}, [{"jacobian": own}],
                      {"jacobian": None}, 2)


def test_a_dataset_s_row_nearest_its_bound_is_reported_with_its_own_error():
    # Row 0 is the furthest off (3e-4) but within its wider bound (8e-4); row 1 is nearer its bound (0.9e-4
    # of 1e-4). The bound reported is row 1's with row 1's error, never row 0's error beside row 1's bound.
    judged = _two_rows_judged((3e-4, 0.9e-4))
    assert judged.errors["jacobian"] == pytest.approx(3e-4)
    assert judged.nearest_bound()["jacobian"] == pytest.approx((0.9e-4, 1e-4))
    assert judged.worst_ratio() == pytest.approx(0.9)
    judged = _two_rows_judged((7e-4, 0.5e-4))  # now row 0 is the nearer one: 7e-4 of 8e-4
    assert judged.nearest_bound()["jacobian"] == pytest.approx((7e-4, 8e-4))


@pytest.mark.parametrize("stored", [np.inf, -np.inf, np.nan, 16.1181])
def test_a_row_float32_cannot_make_finite_bounds_nothing_and_a_wrong_value_fails(stored):
    """A row whose own float32 computation overflows (a margin of inf where the float64 truth is 23.3) has no
    noise to widen its bound by. It widened it to inf, and inf over inf passed: a stored inf, a NaN, and a
    value clipped far from the truth were each judged correct. The truth itself still passes."""
    from types import SimpleNamespace

    from jacobeam.transforms.self_check import _Judgement

    checker = SimpleNamespace(tolerance=1e-4, compute="float32", _floor=float(np.finfo(np.float32).tiny),
                              plain=SimpleNamespace(split_rows=lambda name, values, rows: np.reshape(values, (rows, -1)),
                                                    least_scales=lambda name, rows: np.zeros(rows)))
    truth, own = np.array([[23.2633], [4.5]]), np.array([[np.inf], [4.5]])

    def judged(value):
        return _Judgement(checker, ["objective"], {"objective": truth}, {"objective": np.array([[value], [4.5]])},
                          [{"objective": own}], {"objective": None}, 2)

    assert judged(stored).failing() == ["objective"] and judged(stored).worst_ratio() > 1000
    assert judged(23.2633).failing() == [] and judged(23.2633).worst_ratio() == 0


def test_verify_reports_each_dataset_s_largest_error_and_how_near_its_bound_it_came():
    """``jacobeam verify``'s line per dataset: the largest error of all samples, and the largest fraction of
    its own bound any row reached. It set the largest error beside the narrowest bound of all samples, so a
    sample with float32 noise (its bound wider) read as beyond the bound of a folder that verified (the
    objective of configs/trak.yaml: 1.2e-4 "bound 0.0001")."""
    from jacobeam.pipeline.recompute import tally
    from jacobeam.pipeline.verify import Report

    report = Report(folder="out", tolerance=1e-4)
    samples = [({"errors": {"objective": 1.2e-4}, "verdict": "ok", "dataset": "objective"}, {"objective": (1.2e-4, 4.8e-4)}),
               ({"errors": {"objective": 0.6e-4}, "verdict": "ok", "dataset": "objective"}, {"objective": (0.6e-4, 1e-4)}),
               ({"errors": {"objective": 0.2e-4}, "verdict": "ok", "dataset": "objective"}, {"objective": (0.2e-4, 1e-4)})]
    for record, nearest in samples:
        tally(report.checked, record, nearest)
    seen = report.checked["objective"]
    assert seen["max_error"] == pytest.approx(1.2e-4) and seen["samples"] == 3 and seen["kinks"] == 0
    assert seen["of_bound"] == pytest.approx(0.6) and seen["bound"] == pytest.approx(1e-4)
    report.samples = [1, 2, 3]
    assert "max relative error 1.20e-04 on 3 sample(s), at most 0.6x its bound (tolerance 0.0001" in format_report(report)
    tally(report.checked, {"errors": {"objective": 3e-4}, "verdict": "kink", "dataset": "objective"},
          {"objective": (3e-4, 1e-4)})  # beyond its bound at the sample, within it a few rounding units away
    assert seen["of_bound"] == pytest.approx(3.0) and seen["kinks"] == 1
    assert "at most 3x its bound (tolerance 0.0001, or 4x float's own error, 1 at a kink)" in format_report(report)


def test_a_folder_holding_an_output_folder_is_named_as_such_not_as_an_unfinished_run(clean, tmp_path, capsys):
    """``make demo`` leaves ``jacobeam-demo/`` with ``inputs/`` and the output folder ``out/``: pointed at the
    former, inspect and verify said "the run did not finish", which sends a user to rerun a run that
    finished. They name the output folders inside instead; a folder with a run's shards and no manifest is
    still an unfinished run."""
    for command in ("inspect", "verify"):
        assert cli.main([command, str(clean)]) == 1
        err = capsys.readouterr().err
        assert f"{clean}: not a jacobeam output folder (no manifest.json or shards/); the output folders in it: out" in err, err
    (tmp_path / "empty").mkdir()
    assert cli.main(["verify", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert "not a jacobeam output folder" in err and "output folders in it" not in err, err
