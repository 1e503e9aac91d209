"""Fault injection: ``jacobeam run`` killed with SIGKILL (the whole process tree, no clean-up of any kind)
at named points and at seeded random moments, then started again with the same command, must finish
with output bit-for-bit equal to an uninterrupted run: every shard's bytes, ``jacobians.h5``'s contents,
``rejected.jsonl``, a valid manifest, and no temporary file left.

The killed run is a subprocess in a new session (its own process group, killed as a whole); the
resume runs the same command line in-process (``cli.main``), which keeps each case to seconds.
"""

import json
import os
import random
import shutil
import signal
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.output.storage import sha256
from tests.services import jacobeam_process

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# Every named point of transforms/testing/faults.py, some at a later occurrence (the N-th shard, ...).
POINTS = [
    "plan", "setup", "shard_write:1", "shard_write:4", "shard_commit:2", "shard_done:3",
    "view_write", "view", "rejected", "manifest",
]


def _write_data(folder: Path, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, size in (("a", 7), ("b", 13), ("c", 20)):
        x = rng.normal(size=(size, 12)).astype(np.float32)
        if name == "b":
            x[4, 2] = np.nan  # rejected under skip: rejected.jsonl and a gap in the ids are part of the output
        np.save(folder / f"{name}.npy", x)


def _config(root: Path, data: Path, out: Path, extra: dict | None = None) -> Path:
    path = root / f"{out.name}.yaml"
    cfg = {
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": [str(data / "*.npy")], "on_bad_sample": "skip"},
        "jacobian": {"batch_size": 4},
        "output": {"path": str(out), "samples_per_shard": 8},
        **(extra or {}),
    }
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    _write_data(root / "data")
    clean = root / "clean"
    assert cli.main(["-q", "run", str(_config(root, root / "data", clean))]) == 0
    return root, clean


def _killed_run(config: Path, kill_at: str | None = None, after: float | None = None, args=()) -> int:
    """Run ``python -m jacobeam run`` in its own process group; SIGKILL the whole group when it dies by
    itself at ``kill_at``, or after ``after`` seconds. Returns the exit status (-9: killed)."""
    status, _ = jacobeam_process(["-q", "run", str(config), *args], config.with_suffix(".stderr"), kill_at, after)
    return status


def _contents(out: Path) -> dict:
    with h5py.File(out / "jacobians.h5") as view:
        return {name: view[name][:] for name in view}


def assert_same_as(out: Path, clean: Path) -> None:
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert names == sorted(str(p.relative_to(clean)) for p in clean.rglob("*"))  # no temporary file left
    for shard in sorted((clean / "shards").iterdir()):
        assert sha256(out / "shards" / shard.name) == sha256(shard), shard.name
    ours, theirs = _contents(out), _contents(clean)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])
    assert (out / "rejected.jsonl").read_bytes() == (clean / "rejected.jsonl").read_bytes()
    manifest, reference = (json.loads((d / "manifest.json").read_text()) for d in (out, clean))
    assert [(s["file"], s["crc32c"]) for s in manifest["shards"]] == [(s["file"], s["crc32c"]) for s in reference["shards"]]
    assert manifest["rejected"] == reference["rejected"]
    report = verify(out, samples=0, inputs="all")  # every shard's samples against the inputs too
    assert report.ok, report.problems


def _resume(config: Path) -> None:
    assert cli.main(["-q", "run", str(config)]) == 0


@pytest.mark.parametrize("point", POINTS)
def test_killed_at_a_named_point_then_resumed_equals_a_clean_run(job, point):
    root, clean = job
    out = root / f"out-{point.replace(':', '-')}"
    config = _config(root, root / "data", out)

    status = _killed_run(config, kill_at=point)

    assert status == -signal.SIGKILL, config.with_suffix(".stderr").read_text()[-2000:]  # it reached the point
    assert not (out / "manifest.json").exists()  # a first run killed anywhere before the rename is unfinished
    _resume(config)
    assert_same_as(out, clean)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_at_a_random_moment_then_resumed_equals_a_clean_run(job, seed):
    root, clean = job
    out = root / f"out-random-{seed}"
    config = _config(root, root / "data", out)
    _killed_run(config, after=random.Random(seed).uniform(1.0, 5.0))
    _resume(config)
    assert_same_as(out, clean)


def test_killed_again_and_again_while_resuming(job):
    """Each restart is itself killed at a (seeded) random point; the last one completes."""
    root, clean = job
    out = root / "out-chain"
    config = _config(root, root / "data", out)
    rng = random.Random(7)
    for point in rng.sample(["setup", "shard_write:1", "shard_write:2", "shard_commit:1", "view", "manifest"], 3):
        _killed_run(config, kill_at=point)
    _resume(config)
    assert_same_as(out, clean)


@pytest.mark.parametrize("point", ["shard_write:2", "view", "manifest"])
def test_killed_incremental_run_then_resumed_equals_an_uninterrupted_one(tmp_path, point):
    """New files beside the old ones; the incremental run is killed; the old manifest (still in place)
    keeps the id assignment, so the resumed run adds exactly what the uninterrupted one adds."""
    _write_data(tmp_path / "data")
    first = tmp_path / "first"
    _resume(_config(tmp_path, tmp_path / "data", first))
    np.save(tmp_path / "data" / "0new.npy", np.random.default_rng(5).normal(size=(11, 12)).astype(np.float32))
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    shutil.copytree(first, reference)
    shutil.copytree(first, killed)
    _resume(_config(tmp_path, tmp_path / "data", reference))
    config = _config(tmp_path, tmp_path / "data", killed)

    assert _killed_run(config, kill_at=point) == -signal.SIGKILL
    _resume(config)

    assert_same_as(killed, reference)
    manifest = json.loads((killed / "manifest.json").read_text())
    assert manifest["id_segments"] == [[0, 40], [40, 51]]


def test_killed_multi_process_run_then_resumed_equals_a_clean_run(job):
    root, clean = job
    out = root / "out-multi"
    # The clean run's TensorFlow threads (all cores, one process), which every shard records: the killed run's
    # workers complete shards before the kill (planning reads headers only) and these are kept.
    config = _config(root, root / "data", out, {"jacobian": {"batch_size": 4, "threads": os.cpu_count() or 1}})
    args = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
    _killed_run(config, after=random.Random(11).uniform(4.0, 9.0), args=args)
    _resume(config)
    assert_same_as(out, clean)


# --- --overwrite (pipeline.overwrite) -------------------------------------------------------------------------

# The replacing run: another identity (shards of 16 ids, not 8), so that every old shard goes.
_REPLACING = {"output": {"samples_per_shard": 16}}


@pytest.fixture(scope="module")
def replaced(job):
    """``job``'s folder, and a clean run of the replacing config in a fresh folder: what an overwrite must leave."""
    root, clean = job
    config = _config(root, root / "data", root / "clean-replacing")
    cfg = json.loads(config.read_text())
    cfg["output"].update(_REPLACING["output"])
    config.write_text(json.dumps(cfg))
    assert cli.main(["-q", "run", str(config)]) == 0
    return root, clean, root / "clean-replacing"


def _overwriting(root: Path, clean: Path, name: str) -> tuple[Path, Path]:
    """A copy of the clean folder at ``root/name``, and the replacing config for it."""
    out = root / name
    shutil.copytree(clean, out)
    config = root / f"{name}-replacing.yaml"
    cfg = json.loads(_config(root, root / "data", out).read_text())
    cfg["output"].update(_REPLACING["output"])
    config.write_text(json.dumps(cfg))
    return out, config


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("point", ["setup", "shard_write:2", "shard_done:1", "view", "manifest"])
def test_an_overwrite_killed_before_its_result_is_committed_leaves_the_old_one_whole(replaced, point):
    """Killed while it computes (in its staging folder), an overwrite has not touched the old result: every
    file of it is as it was and it verifies. The same command then finishes the overwrite."""
    root, clean, reference = replaced
    out, config = _overwriting(root, clean, f"overwritten-{point.replace(':', '-')}")
    before = _files(out)

    assert _killed_run(config, kill_at=point, args=["--overwrite"]) == -signal.SIGKILL

    kept = {k: v for k, v in _files(out).items() if not k.startswith(".jacobeam-overwrite/") and k != ".jacobeam-lease.json"}
    assert kept == before  # the killed run's lease is left, as any killed run's
    assert verify(out, samples=0, inputs="all").ok
    assert cli.main(["-q", "run", str(config), "--overwrite"]) == 0
    assert_same_as(out, reference)


@pytest.mark.parametrize("point", ["overwrite_move:1", "overwrite_move:3", "overwrite_moved"])
@pytest.mark.parametrize("rerun", ["--overwrite", "no flag"])
def test_an_overwrite_killed_while_its_result_moves_in_is_finished_by_the_next_run(replaced, point, rerun, capsys):
    """Killed once its result is committed in the staging folder, while moving it in: the next run of the
    folder, with or without ``--overwrite``, moves the rest in before it plans, and finds it complete."""
    root, clean, reference = replaced
    out, config = _overwriting(root, clean, f"moving-{point.replace(':', '-')}-{rerun.strip('-').replace(' ', '-')}")

    assert _killed_run(config, kill_at=point, args=["--overwrite"]) == -signal.SIGKILL
    assert (out / ".jacobeam-overwrite" / "manifest.json").exists()
    if point.startswith("overwrite_move:"):  # old shards and new: no view reads them as one result
        assert not (out / "manifest.json").exists() and not (out / "jacobians.h5").exists()
        capsys.readouterr()
        assert cli.main(["inspect", str(out)]) == cli.FAILED
        assert "an --overwrite committed its result in .jacobeam-overwrite and was stopped while moving it in; the " \
               "next run of the folder finishes that" in capsys.readouterr().out

    assert cli.main(["-q", "run", str(config), *([rerun] if rerun == "--overwrite" else [])]) == 0
    assert_same_as(out, reference)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["output_dir"] == str(out) and manifest["config"]["output"]["path"] == str(out)


def test_a_run_of_the_old_config_after_a_committed_overwrite_is_refused(replaced, capsys):
    """An overwrite killed after its commit has replaced the result: the old config's run finds another run's."""
    root, clean, _ = replaced
    out, config = _overwriting(root, clean, "moving-then-old")
    assert _killed_run(config, kill_at="overwrite_move:2", args=["--overwrite"]) == -signal.SIGKILL
    assert cli.main(["-q", "run", str(_config(root, root / "data", out))]) == cli.FAILED
    assert "holds the result of a different run" in capsys.readouterr().err
    assert not (out / ".jacobeam-overwrite").exists()
