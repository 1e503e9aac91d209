"""Whether a folder is this run's: the run identity and key (``pipeline.identity``, ``transforms.spec``),
and what ``pipeline.folder`` reports of a folder written by another run, with the fake engine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jacobeam.pipeline import config, plan
from jacobeam.pipeline.folder import folder_differences, read_folder, stale_shards
from jacobeam.pipeline.identity import identity_differences, run_identity
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.inputs_table import folder_inputs
from jacobeam.transforms.spec import run_key
from tests.fake_runs import run_config, run_once, run_with_fake_engine, write_inputs


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One whole run with the fake engine; tests below copy its folder before changing anything."""
    return run_once(tmp_path_factory.mktemp("folders"))


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
    # jacobian.objective and project.structure came later: their defaults, what every earlier run computed, are
    # left out (their keys hold).
    left_out = ("jacobian.threads", "jacobian.objective", "jacobian.project.structure")
    expected = {k: v for k, v in jacobian.items() if k not in left_out and not k.startswith("jacobian.self_check.")}
    assert {k: v for k, v in identity.items() if k.startswith("jacobian.")} == expected
    assert jacobian["jacobian.objective"] == "outputs" and jacobian["jacobian.project.structure"] == "dense"
    assert "jacobian.project.seed" in identity  # nested keys too, dotted
    assert identity["output.samples_per_shard"] == 16 and identity["model.factory"] == "pkg.mod:model"
    assert not any(k.startswith(("input.paths", "output.path", "output.compression", "input.on_bad_sample")) for k in identity)


def test_run_key_ignores_threads_self_check_and_order_and_follows_everything_else():
    base = run_key(run_identity(_dict_config()))
    assert run_key(run_identity(_dict_config(threads=1, self_check={"samples": 0}))) == base
    reordered = dict(reversed(list(run_identity(_dict_config()).items())))
    assert run_key(reordered) == base
    for change in ({"batch_size": 9}, {"store_dtype": "float64"}, {"aggregate": ["mean"]}, {"project": {"seed": 4}},
                   {"wrt": "parameters", "objective": "margin", "labels": {"key": "y"}, "reduce": "project"}):
        assert run_key(run_identity(_dict_config(**change))) != base, change
    # Stable across versions and processes: folders written earlier must still be resumable.
    assert run_key({"a": 1, "b": [1, 2], "c": None}) == "9a0a99d8aab6f4b4"
    assert len(base) == 16 and int(base, 16) >= 0


# --- foreign output folders (pipeline.folder) -------------------------------------------------------------------


def _spec(data: Path, out: Path, samples_per_shard: int = 16):
    """This run's plan, as if the folder were to be overwritten (so the plan itself does not refuse it)."""
    return plan.make_job(
        run_config(data, out, samples_per_shard), overwrite=True, check_model=False, identify_model=False
    ).spec


def test_a_folder_of_the_same_run_has_no_differences(fake_run):
    root, _, result, _ = fake_run
    folder = read_folder(str(root / "out"))
    # read_folder attaches the inputs table's rows (inputs.h5) to the manifest as it was written
    assert folder.alien == [] and {k: v for k, v in folder.manifest.items() if k != "inputs"} == result.manifest
    assert list(folder.manifest["inputs"]) == list(folder_inputs(str(root / "out")))
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


def test_a_file_changed_in_place_makes_the_shards_it_feeds_stale_not_the_folder_different(tmp_path):
    """Its stamp (size, time of the last change) tells: the ids stay, the shards they feed are computed again."""
    data, out = tmp_path / "data", tmp_path / "out"
    write_inputs(data)
    run_with_fake_engine(data, out)  # shards name their input files by path: a run of its own, whose inputs may change
    c = np.load(data / "c.npy")
    np.save(data / "c.npy", c[::-1].copy())  # ids 20..40: the same shape, other samples
    stat = (data / "c.npy").stat()
    os.utime(data / "c.npy", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock still tells
    folder, spec = read_folder(str(out)), _spec(data, out)
    assert folder_differences(folder, spec, None) == []
    assert stale_shards(folder, spec) == ["shard-000000000016-000000000032.h5", "shard-000000000032-000000000040.h5"]


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


def test_a_refusal_names_each_changed_key_once_with_its_values_as_configured():
    """A key left out of an identity at its default reads as that default, and a key that is a word on one
    side and a mapping on the other is one line: ``objective`` read ``"margin" there, null`` and, besides,
    ``objective.loss is null there``; ``project.structure`` read ``null`` where the folder's was dense."""
    folder = {"jacobian.objective": "margin", "jacobian.project.dim": 2048, "jacobian.wrt": "parameters"}
    run = {"jacobian.objective.loss": "sparse_categorical_crossentropy", "jacobian.project.dim": 2048,
           "jacobian.project.structure": "kronecker", "jacobian.wrt.parameters": ["logits"], "model.logits": False}
    assert identity_differences(folder, run) == [
        'jacobian.objective is "margin" there, {"loss": "sparse_categorical_crossentropy"} in this run',
        'jacobian.project.structure is "dense" there, "kronecker" in this run',
        'jacobian.wrt is "parameters" there, {"parameters": ["logits"]} in this run',
    ]
    assert identity_differences({**folder, "jacobian.project.structure": "dense"}, folder) == []
