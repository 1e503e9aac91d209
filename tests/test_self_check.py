"""The run's self-check (``jacobian.self_check``): each shard recomputes a few samples on their own."""

import json
import re
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.inspect_output import format_report, inspect
from jacobeam.transforms import self_check
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.errors import SelfCheckError
from jacobeam.transforms.output.storage import sha256
from jacobeam.transforms.spec import EngineOptions, SelfCheck, ShardRange

SIZES = {"a": 7, "b": 13, "c": 20}  # 40 samples: shards [0, 16), [16, 32), [32, 40)
SHARDS = ["shard-000000000000-000000000016.h5", "shard-000000000016-000000000032.h5", "shard-000000000032-000000000040.h5"]


def _write(folder: Path, shape=(12,), seed=0, labels=None) -> np.ndarray:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    parts = []
    for name, size in SIZES.items():
        x = rng.normal(size=(size, *shape)).astype(np.float32)
        if labels is None:
            np.save(folder / f"{name}.npy", x)
        else:
            np.savez(folder / f"{name}.npz", x=x, y=rng.integers(0, labels, size))
        parts.append(x)
    return np.concatenate(parts)


def _config(data: Path, out: Path, factory="tests.models:small_mlp", key=None, **jacobian):
    suffix = "*.npy" if key is None else "*.npz"
    return config.validate(
        {
            "model": {"factory": factory},
            "input": {"paths": [str(data / suffix)], "key": key},
            "jacobian": {"batch_size": 4, **jacobian},
            "output": {"path": str(out), "samples_per_shard": 16},
        }
    )


def _run(cfg):
    return runner.run(cfg, [], show_progress=False).manifest


def _attr(path: Path):
    with h5py.File(path) as h5:
        return json.loads(h5.attrs["self_check"]) if "self_check" in h5.attrs else None


def _shas(out: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in sorted((out / "shards").iterdir())}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A default run of the small MLP: the reference for the runs that fail or warn."""
    root = tmp_path_factory.mktemp("self-check")
    samples = _write(root / "data")
    manifest = _run(_config(root / "data", root / "out"))
    return root, samples, manifest


def _corrupt(monkeypatch, samples: np.ndarray, ids: range, factor: float = 1.5) -> None:
    """The engine returns the Jacobians of the samples ``ids`` scaled by ``factor``."""
    targets = {samples[i].tobytes() for i in ids}
    original = JacobianEngine.compute

    def compute(engine, x, labels=None):
        datasets, full = original(engine, x, labels)
        hit = [i for i, row in enumerate(np.asarray(x)) if row.tobytes() in targets]
        if hit:
            jacobian = np.array(datasets["jacobian"])
            jacobian[hit] *= factor
            datasets = {**datasets, "jacobian": jacobian}
        return datasets, full

    monkeypatch.setattr(JacobianEngine, "compute", compute)


# --- which samples --------------------------------------------------------------------------------------


def test_chosen_ids_are_seeded_by_the_shard():
    """Among the range's ids, whether read or not: which samples are bad, the worker finds as it reads (a
    chosen one that is rejected is not checked)."""
    shard = ShardRange(16, 20)
    chosen = self_check.chosen_ids(shard, 3 * 1024)  # 3 per 4 ids
    assert len(chosen) == 3 and all(16 <= i < 20 for i in chosen) and list(chosen) == sorted(chosen)
    np.testing.assert_array_equal(chosen, self_check.chosen_ids(ShardRange(16, 20), 3 * 1024))
    assert list(self_check.chosen_ids(shard, 10 * 1024)) == [16, 17, 18, 19]  # all, when a shard holds fewer
    assert len(self_check.chosen_ids(shard, 0)) == 0
    firsts = {int(self_check.chosen_ids(ShardRange(start, start + 4096), 1)[0]) - start for start in range(0, 40960, 4096)}
    assert len(firsts) > 1  # not the same place in every shard


@given(samples=st.integers(1, 64), size=st.integers(1, 10_000), total=st.integers(1, 50_000))
@settings(max_examples=200, deadline=None)
def test_the_checks_follow_the_samples_whatever_the_shard_size(samples, size, total):
    """``samples`` per 4,096 ids of a shard, rounded up: every shard is checked, and a run's checks are its
    share of the ids (plus at most one per shard for the rounding), so small shards do not multiply them. A
    default shard checks exactly ``samples``, as every shard did before the budget followed the samples."""
    shards = [ShardRange(start, min(start + size, total)) for start in range(0, total, size)]
    counts = [len(self_check.chosen_ids(shard, samples)) for shard in shards]
    assert all(1 <= count <= shard.rows for count, shard in zip(counts, shards))
    share = samples * total / self_check.PER_IDS
    assert min(share, total) <= sum(counts) < share + len(shards)
    whole = ShardRange(4096 * (total % 7), 4096 * (total % 7 + 1))
    np.testing.assert_array_equal(self_check.chosen_ids(whole, samples), self_check.drawn(whole, samples))
    assert len(self_check.drawn(whole, samples)) == samples


# --- the default run ------------------------------------------------------------------------------------


def test_default_run_checks_one_sample_per_small_shard_in_its_attributes_and_the_manifest(clean):
    """16-id shards: 4 checks per 4,096 ids, rounded up, is one per shard."""
    root, _, manifest = clean
    out = root / "out"
    summary = manifest["self_check"]
    assert summary["samples_per_shard"] == 4 and summary["on_mismatch"] == "fail"
    assert summary["samples_checked"] == 3 and summary["shards_checked"] == 3 and summary["per_ids"] == 4096
    assert summary["tolerance"] == 1e-4 and summary["max_rel_error"] < 1e-5
    assert summary["kinks"] == [] and summary["mismatches"] == []
    assert summary["reference"] == "tf.GradientTape gradient of one sample, one output row per copy"
    precision = summary["precision"]
    assert precision["against"] == "float64 copy of the model" and precision["samples"] == 3
    for name in ("jacobian", "output"):  # a smooth MLP: float32 is within 1e-5 of the float64 truth
        assert 0 < precision["datasets"][name]["error"]["max"] < 1e-5
        assert 0 < precision["datasets"][name]["noise"]["max"] < 1e-5
        assert precision["datasets"][name]["error"]["median"] <= precision["datasets"][name]["error"]["max"]
    for shard, name in zip(manifest["shards"], SHARDS):
        stored = _attr(out / "shards" / name)
        checks = stored["checked"]
        assert stored["samples"] == 4 and stored["on_mismatch"] == "fail"
        assert len(checks) == 1
        assert [check["id"] for check in checks] == list(self_check.chosen_ids(ShardRange(shard["start"], shard["stop"]), 4))
        for check in checks:
            assert check["verdict"] == "ok" and check["max_rel_error"] < 1e-5
            assert set(check["errors"]) == set(check["noise"]) == {"jacobian", "output"}
            assert check["truth"] == "float64 copy of the model" and check["bound"] == 1e-4
            assert "timing" not in check  # the shard's bytes do not depend on how long a check took
            first = {"a.npy": 0, "b.npy": 7, "c.npy": 20}[Path(check["input"]["file"]).name]
            assert check["input"]["row"] == check["id"] - first
        assert [{k: v for k, v in listed.items() if k != "timing"} for listed in shard["self_check"]] == checks
        assert all(listed["timing"]["seconds"] > 0 for listed in shard["self_check"])
    lines = format_report(inspect(str(out))).splitlines()
    line = next(line for line in lines if line.startswith("  self-check"))
    assert re.fullmatch(
        r"  self-check  3 sample\(s\) in 3 shard\(s\) recomputed on their own: 3 passed, 0 at a kink, 0 mismatch\(es\); "
        r"max relative error \S+ \(tolerance 0.0001\)", line
    )
    line = next(line for line in lines if line.startswith("  precision"))
    assert re.fullmatch(
        r"  precision   jacobian: float32 error against a float64 copy of the model median \S+, max \S+ \(TensorFlow's own "
        r"per-sample gradient: median \S+, max \S+\) on 3 checked sample\(s\)", line
    ), line


def test_samples_zero_records_nothing(clean, tmp_path):
    root, _, _ = clean
    manifest = _run(_config(root / "data", tmp_path / "out", self_check={"samples": 0}))
    assert all(_attr(tmp_path / "out" / "shards" / name) is None for name in SHARDS)
    assert all("self_check" not in shard for shard in manifest["shards"])
    assert manifest["self_check"]["samples_per_shard"] == 0 and manifest["self_check"]["samples_checked"] == 0
    assert "  self-check  off (jacobian.self_check.samples: 0)" in format_report(inspect(str(tmp_path / "out")))


def test_a_run_resumed_with_another_self_check_setting_keeps_its_shards(clean, tmp_path):
    """The self-check decides how results are checked, not what they are: not part of the run's identity."""
    root, _, first = clean
    out = tmp_path / "out"
    _run(_config(root / "data", out, self_check={"samples": 0}))
    (out / "shards" / SHARDS[1]).unlink()
    (out / "manifest.json").unlink()
    manifest = _run(_config(root / "data", out))
    assert [s["computed_in_this_run"] for s in manifest["shards"]] == [False, True, False]
    assert manifest["self_check"]["samples_checked"] == 1  # the shard computed now
    assert _attr(out / "shards" / SHARDS[1]) == _attr(root / "out" / "shards" / SHARDS[1])


# --- mismatches -----------------------------------------------------------------------------------------


def test_a_corrupted_result_fails_the_run_in_one_line_naming_shard_and_sample(clean, tmp_path, monkeypatch, capsys):
    root, samples, _ = clean
    out = tmp_path / "out"
    _corrupt(monkeypatch, samples, range(16, 32))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(root / "data", out).model_dump(mode="json")))

    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED

    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("jacobeam: error:"))
    chosen = int(self_check.chosen_ids(ShardRange(16, 32), 4)[0])
    file, row = ("b.npy", chosen - 7) if chosen < 20 else ("c.npy", chosen - 20)
    assert re.match(
        rf"jacobeam: error: self-check failed: shards/{SHARDS[1]} \(ids 16 to 31\), sample {chosen} "
        rf"\(input \S+/{file} row {row}\): jacobian differs from the reference \(tf.GradientTape gradient of one "
        r"sample, one output row per copy, float64 copy of the model\) by max relative error 0.5, bound 0.0001 "
        r"\(tolerance 0.0001, or 4x the error of an independent per-sample computation, at most 0.25\); "
        r"jacobian.self_check.on_mismatch: warn would record it and go on( \[while running '[^']*'\])?$",
        line,
    ), line
    # The failing shard was never committed; shards completed before it are intact; nothing half-written.
    names = sorted(p.name for p in (out / "shards").iterdir())
    assert SHARDS[1] not in names and all(not name.startswith(".") for name in names)
    assert all(sha256(out / "shards" / name) == sha256(root / "out" / "shards" / name) for name in names)
    assert not (out / "manifest.json").exists()

    monkeypatch.undo()  # the engine is right again: the same command completes the run
    assert cli.main(["-q", "run", str(cfg)]) == 0
    assert _shas(out) == _shas(root / "out")


def test_on_mismatch_warn_completes_and_records_the_mismatch(clean, tmp_path, monkeypatch, caplog):
    root, samples, _ = clean
    out = tmp_path / "out"
    _corrupt(monkeypatch, samples, range(32, 40), factor=2.0)
    manifest = _run(_config(root / "data", out, self_check={"on_mismatch": "warn"}))
    chosen = [int(i) for i in self_check.chosen_ids(ShardRange(32, 40), 4)]
    summary = manifest["self_check"]
    assert summary["mismatches"] == [
        {"file": f"shards/{SHARDS[2]}", "id": i, "dataset": "jacobian", "max_rel_error": 1.0} for i in chosen
    ]
    assert summary["max_rel_error"] == 1.0 and summary["samples_checked"] == 3
    checks = _attr(out / "shards" / SHARDS[2])["checked"]
    assert all(check["verdict"] == "mismatch" and check["errors"]["jacobian"] == 1.0 for check in checks)
    assert any(f"sample {chosen[0]}" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    report = format_report(inspect(str(out)))
    assert len(chosen) == 1 and ": 2 passed, 0 at a kink" in report and "1 mismatch(es)" in report
    assert f"MISMATCH, e.g. sample {chosen[0]} jacobian (recorded under on_mismatch: warn)" in report
    assert "jacobian: float32 error against a float64 copy of the model median" in report
    assert "max 1 (TensorFlow's own per-sample gradient: median" in report  # the recorded errors, mismatches included
    assert "float64 for more" not in report  # float32 itself is accurate here: float64 would not help


# --- reduced and selected results -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, jacobian, datasets",
    [
        ("tests.models:small_mlp", {"reduce": "frobenius", "outputs": "label", "labels": {"key": "y"}}, {"frobenius", "output"}),
        ("tests.models:small_mlp", {"reduce": "project", "project": {"dim": 4}}, {"projection", "output"}),
        ("tests.models:coupling_flow", {"reduce": "slogdet"}, {"sign", "logabsdet", "output"}),
    ],
)
def test_reduced_and_selected_results_are_checked(tmp_path, factory, jacobian, datasets):
    shape = (8,) if "flow" in factory else (12,)
    _write(tmp_path / "data", shape, labels=5)
    manifest = _run(_config(tmp_path / "data", tmp_path / "out", factory, key="x", **jacobian))
    summary = manifest["self_check"]
    assert summary["samples_checked"] == 3 and summary["max_rel_error"] < 1e-4, summary
    checks = [check for shard in manifest["shards"] for check in shard["self_check"]]
    assert {name for name in checks[0]["errors"]} == datasets
    if jacobian.get("reduce") == "project":  # forward mode, along the projection's columns
        assert summary["reference"].startswith("forward-mode JVPs along the product's vectors")


# --- kinks ----------------------------------------------------------------------------------------------


def kinked_relu(dtype: str = "float32") -> keras.Model:
    """x[4] -> Dense 3 relu -> Dense 2, whose first hidden unit is exactly at its kink (pre-activation 0)
    for samples with x1 = 2 x0 + x2 / 2 (dyadic values: exact in floating point): ``kinked_samples``."""
    model = keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(3, activation="relu", dtype=dtype),
            keras.layers.Dense(2, dtype=dtype),
        ]
    )
    kernel = np.array([[1.0, 0.3, -0.7], [-0.5, 0.8, 0.2], [0.25, -0.4, 0.9], [0.0, 0.6, 0.5]])
    model.layers[0].set_weights([kernel.astype(dtype), np.array([0.0, 2.0, 2.0], dtype)])
    model.layers[1].set_weights([np.array([[1.5, -2.0], [0.7, 0.4], [-0.3, 0.9]], dtype), np.zeros(2, dtype)])
    return model


def kinked_samples(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    x0, x2, x3 = rng.integers(-8, 9, n) / 8, rng.integers(-4, 5, n) / 4, rng.integers(-4, 5, n) / 4
    return np.stack([x0, 2 * x0 + x2 / 2, x2, x3], axis=1).astype(np.float32)


NUDGE = np.array([1e-6, 0, 0, 0], np.float32)  # onto the active side of the kinked unit


def test_a_kinked_sample_is_a_note_and_a_corrupted_one_a_mismatch():
    x = kinked_samples(4)
    engine = JacobianEngine(wrap_model(kinked_relu(), "kinked"), (4,), EngineOptions(batch_size=4))
    checker = self_check.SelfChecker(engine, SelfCheck())
    computed = engine(x)
    other_side = engine(x + NUDGE)  # another batching's round-off could have put it there
    row = lambda datasets, i: {name: values[i : i + 1] for name, values in datasets.items()}  # noqa: E731

    assert checker.check([x[:1]], row(computed, 0), 0)["verdict"] == "ok"
    kink = checker.check([x[:1]], row(other_side, 0), 0)
    assert kink["verdict"] == "kink" and kink["max_rel_error"] > 1e-2
    assert kink["note"] == self_check.KINK_NOTE
    # Ten times as far from the truth as the derivative on the other side of the kink: a wrong value.
    jump = other_side["jacobian"][:1] - computed["jacobian"][:1]
    wrong = {**row(other_side, 0), "jacobian": computed["jacobian"][:1] + 10 * jump}
    assert checker.check([x[:1]], wrong, 0)["verdict"] == "mismatch"


def test_a_run_whose_samples_sit_at_kinks_completes_with_notes(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "x.npy", kinked_samples(40))
    original = JacobianEngine.compute
    monkeypatch.setattr(JacobianEngine, "compute", lambda engine, x, labels=None: original(engine, x + NUDGE, labels))
    manifest = _run(_config(tmp_path / "data", tmp_path / "out", "tests.test_self_check:kinked_relu"))
    summary = manifest["self_check"]
    assert summary["samples_checked"] == 3 and len(summary["kinks"]) == 3 and summary["mismatches"] == []
    assert summary["max_rel_error"] is None  # every check was at a kink: none judged by the tolerance
    assert "recomputed on their own: 0 passed, 3 at a kink (" in format_report(inspect(str(tmp_path / "out")))


def test_config_keys_and_their_checks():
    base = {"model": {"builtin": "mlp"}, "input": {"paths": ["x.npy"]}, "output": {"path": "out"}}
    assert config.validate(base).jacobian.self_check.spec() == SelfCheck(samples=4, on_mismatch="fail")
    for bad, key in (
        ({"samples": -1}, "samples"),
        ({"on_mismatch": "ignore"}, "on_mismatch"),
        ({"sample": 2}, "sample"),
    ):
        with pytest.raises(config.ConfigError, match=rf"jacobian.self_check.{key}"):
            config.validate({**base, "jacobian": {"self_check": bad}})
    with pytest.raises(SelfCheckError):  # a JacobeamError: the command line prints it as one line
        raise SelfCheckError("x")


# --- checks while the references are being built -------------------------------------------------------


@pytest.mark.parametrize("together", [True, False])
def test_checks_wait_for_the_references_with_a_later_batch_of_their_shard(monkeypatch, together):
    """A DoFn that takes ``held_checks`` before it commits a shard (``holds_checks``, as ``jacobeam run``'s
    does) holds its chosen samples back to the shard's end where its checker checks them together
    (``checks_together``, the input side's), and otherwise while the worker's references are being built
    (``SelfChecker.prepare``), when they are checked with a later batch or by ``held_checks``: against the
    values their own batch computed though the engine has reused its buffers since, and the records are
    those of checks made at once, in id order. A plain ``ComputeJacobiansFn`` (a user's pipeline, whose
    writer never asks) checks each batch's samples with it, waiting for the references. Samples checked
    in other groups have the same records but for float32's noise (and the bound it sets), measured in
    one pass over each group, whose batch shape oneDNN rounds differently."""
    from jacobeam.transforms.compute import ComputeJacobiansFn
    from jacobeam.transforms.elements import SampleBatch
    from jacobeam.transforms.spec import ModelSource

    original, buffers = JacobianEngine.compute, {}

    def reused(engine, x, labels=None):  # every call's results in the same arrays, as a buffer pool would
        datasets, full = original(engine, x, labels)
        for name, values in datasets.items():
            buffers.setdefault((id(engine), name), np.empty_like(values))[...] = values
        return {name: buffers[(id(engine), name)] for name in datasets}, full

    class Holding(ComputeJacobiansFn):
        holds_checks = True

    monkeypatch.setattr(JacobianEngine, "compute", reused)
    x = np.random.default_rng(1).normal(size=(16, 12)).astype(np.float32)
    shard = ShardRange(0, 16)

    def run(kind, ready: bool) -> list:
        fn = kind(ModelSource(factory="tests.models:small_mlp"), (12,), EngineOptions(batch_size=4),
                  self_check=SelfCheck(samples=2048))  # 8 of the 16
        fn.setup()
        fn._checker.ready = lambda: ready
        fn._checker.checks_together = together
        found = []
        for lo in range(0, 16, 4):
            found += [batch.checks for batch in fn.process(SampleBatch(np.arange(lo, lo + 4), x[lo : lo + 4], shard=shard))]
        return [*found, fn.held_checks(shard)]

    held, at_once, plain = run(Holding, ready=False), run(Holding, ready=True), run(ComputeJacobiansFn, ready=False)
    chosen = [int(i) for i in self_check.chosen_ids(shard, 2048)]
    assert held[:4] == [None] * 4 and [check["id"] for check in held[4]] == chosen
    if together:
        assert at_once == held[:4] + [at_once[4]]
    else:
        assert at_once[4] == [] and any(at_once[:3])
    assert plain[4] == [] and any(plain[:3])
    def flat(found, leave=("timing",)):
        return [{k: v for k, v in c.items() if k not in leave} for checks in found for c in checks or []]

    assert flat(held) == flat(at_once) if together else flat(held, NOISE) == flat(at_once, NOISE)
    assert flat(held, NOISE) == flat(plain, NOISE) and [c["id"] for c in flat(plain)] == chosen
    assert all(check["verdict"] == "ok" for check in held[4])


NOISE = ("timing", "noise", "bound")  # what depends on the group of samples a check was made with


def test_a_run_whose_references_are_never_ready_checks_each_shard_before_committing_it(clean, tmp_path, monkeypatch):
    """``jacobeam run``'s workers (``ComputeShardFn``) commit a shard after its last batch: samples held
    back for the references are checked there, first. The shards are those of a run that checked at once,
    byte for byte; a wrong value held back stops the run before its shard is committed."""
    root, samples, _ = clean
    monkeypatch.setattr(self_check.SelfChecker, "ready", lambda checker: False)
    manifest = _run(_config(root / "data", tmp_path / "held"))
    assert manifest["self_check"]["samples_checked"] == 3 and _shas(tmp_path / "held") == _shas(root / "out")

    _corrupt(monkeypatch, samples, range(16, 32))
    with pytest.raises(SelfCheckError, match=rf"shards/{SHARDS[1]} \(ids 16 to 31\), sample"):
        _run(_config(root / "data", tmp_path / "wrong"))
    assert SHARDS[1] not in {p.name for p in (tmp_path / "wrong" / "shards").iterdir()}
