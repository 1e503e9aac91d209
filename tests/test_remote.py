"""Inputs and output on a remote file system: the ``fakegcs://`` scheme of ``tests/remote_fs.py`` (non-seekable
uploads, rename as copy + delete, no folders, no local paths). Every result is compared with a local run of
the same job, bit for bit, and with the per-sample tape reference. ``tests/test_s3.py`` runs the same kind of
jobs on Beam's own S3 file system against a local S3 server; ``tests/remote_fs.py`` says why this fake stays."""

import copy
import hashlib
import json
import shutil
from pathlib import Path

import google_crc32c
import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, runner
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.inputs_table import folder_inputs
from jacobeam.transforms.output.layout import CRC32C_SUFFIX
from tests import remote_fs
from tests.models import small_cnn
from tests.reference import assert_close, tape_loop
from tests.services import beam_service
from tests.test_pipeline import job_config, run, write_inputs

OUT = "fakegcs://bucket/out"


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "store"
    root.mkdir()
    monkeypatch.setenv(remote_fs.ROOT_ENV, str(root))
    return root


def _jobs(tmp_path: Path):
    """One job with inputs under fakegcs://bucket/data, its output in a local folder and in a remote one
    (the input paths are part of each shard's attributes, so both read the same URLs). Returns the
    samples in id order and the two configs."""
    samples = write_inputs(remote_fs.local_path("fakegcs://bucket/data"), (8, 8, 1))
    data = "fakegcs://bucket/data/*.npy"
    return samples, job_config(data, tmp_path / "local"), job_config(data, OUT)


def _remote_bytes(url: str) -> bytes:
    with storage.open_read(url) as stream:
        return stream.read()


def _copy_back(url: str, target: Path) -> None:
    """Copy a remote folder to a local one through Beam's FileSystems (as ``gsutil cp -r`` would)."""
    (target / "shards").mkdir(parents=True)
    for name in storage.listdir(url):
        (target / name).write_bytes(_remote_bytes(storage.join(url, name)))
    for name in storage.listdir(storage.join(url, "shards")):
        (target / "shards" / name).write_bytes(_remote_bytes(storage.join(url, "shards", name)))


def test_the_test_file_system_refuses_what_gcs_refuses(store):
    from apache_beam.io.filesystems import FileSystems

    stream = FileSystems.create("fakegcs://bucket/x.bin")
    stream.write(b"abc")
    with pytest.raises(OSError):
        stream.seek(0)
    assert not FileSystems.exists("fakegcs://bucket/x.bin")  # visible only once the upload is closed
    stream.close()
    assert _remote_bytes("fakegcs://bucket/x.bin") == b"abc"
    with pytest.raises(Exception):  # noqa: B017  h5py cannot write to a non-seekable stream: why shards go via local files
        with FileSystems.create("fakegcs://bucket/y.h5") as upload, h5py.File(upload, "w") as h5:
            h5["a"] = np.zeros(10)


@pytest.fixture(scope="module")
def _runs_once(tmp_path_factory):
    """The job of ``_jobs`` run once per module, into a local folder and into its own backing store."""
    root = tmp_path_factory.mktemp("remote")
    (root / "store").mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(remote_fs.ROOT_ENV, str(root / "store"))
        samples, local_cfg, _ = _jobs(root)
        local, remote = run(local_cfg), run(job_config("fakegcs://bucket/data/*.npy", OUT))
    return root, samples, local, remote


@pytest.fixture
def remote_and_local(tmp_path, store, _runs_once):
    """A copy of ``_runs_once``'s folders for one test to change: the store's objects and the local folder."""
    root, samples, local, remote = _runs_once
    shutil.copytree(root / "store", store, dirs_exist_ok=True)
    shutil.copytree(root / "local", tmp_path / "local")
    remote_cfg = job_config("fakegcs://bucket/data/*.npy", OUT)
    return tmp_path, samples, copy.deepcopy(local), copy.deepcopy(remote), remote_cfg


def test_remote_output_equals_a_local_run_bit_for_bit(remote_and_local):
    tmp_path, samples, local, remote, _ = remote_and_local

    assert [s["file"] for s in remote["shards"]] == [s["file"] for s in local["shards"]]
    for mine, theirs in zip(remote["shards"], local["shards"]):
        data = _remote_bytes(f"{OUT}/{mine['file']}")
        assert data == (tmp_path / "local" / theirs["file"]).read_bytes()
        assert f"{google_crc32c.value(data):08x}" == mine["crc32c"] == theirs["crc32c"]
        assert _remote_bytes(f"{OUT}/{mine['file']}{CRC32C_SUFFIX}").decode() == mine["crc32c"]
    # Nothing temporary is left, and the folder holds exactly what jacobeam writes.
    assert storage.listdir(OUT) == ["engine-plan.json", "inputs.h5", "jacobians.h5", "manifest.json", "rejected.jsonl"]
    assert not [n for n in storage.listdir(f"{OUT}/shards") if n.startswith(".")]

    copied = tmp_path / "copied"
    _copy_back(OUT, copied)
    with h5py.File(copied / "jacobians.h5") as a, h5py.File(tmp_path / "local" / "jacobians.h5") as b:
        assert set(a) == set(b)
        for name in b:
            np.testing.assert_array_equal(a[name][:], b[name][:])
        assert_close(a["jacobian"][:5], tape_loop(small_cnn(), samples[:5]))
    assert json.loads((copied / "manifest.json").read_text())["num_samples"] == len(samples)


def test_resume_after_a_remote_shard_is_deleted_or_unproven(remote_and_local):
    tmp_path, _, local, _, remote_cfg = remote_and_local
    first, second, third = (f"{OUT}/{s['file']}" for s in local["shards"])
    storage.delete(first)  # gone: computed again
    path = remote_fs.local_path(second)
    path.write_bytes(path.read_bytes()[:-100])  # a partial copy under the final name: its sidecar no longer matches
    storage.delete(third + CRC32C_SUFFIX)  # no proof at all: computed again

    resumed = run(remote_cfg)

    assert [s["computed_in_this_run"] for s in resumed["shards"]] == [True, True, True]
    for mine, theirs in zip(resumed["shards"], local["shards"]):
        assert _remote_bytes(f"{OUT}/{mine['file']}") == (tmp_path / "local" / theirs["file"]).read_bytes()
        assert _remote_bytes(f"{OUT}/{mine['file']}{CRC32C_SUFFIX}").decode() == theirs["crc32c"]


def test_resume_keeps_proven_remote_shards(remote_and_local):
    _, _, local, _, remote_cfg = remote_and_local
    storage.delete(f"{OUT}/{local['shards'][1]['file']}")

    resumed = run(remote_cfg)

    assert [s["computed_in_this_run"] for s in resumed["shards"]] == [False, True, False]
    assert [s["crc32c"] for s in resumed["shards"]] == [s["crc32c"] for s in local["shards"]]


def test_a_remote_folder_written_before_crc32c_resumes_on_its_sha256_sidecars(remote_and_local):
    """Shards proven by ``.sha256`` sidecars, as before CRC32C: those whose bytes match are kept and listed
    with their sha256, one whose bytes changed is computed again (with a ``.crc32c`` sidecar)."""
    _, _, local, _, remote_cfg = remote_and_local
    paths = [f"{OUT}/{s['file']}" for s in local["shards"]]
    sha256 = [hashlib.sha256(_remote_bytes(path)).hexdigest() for path in paths]
    for path, digest in zip(paths, sha256):
        storage.delete(path + CRC32C_SUFFIX)
        storage.write_bytes(path + ".sha256", digest.encode())
    changed = remote_fs.local_path(paths[1])
    changed.write_bytes(changed.read_bytes()[:-100])

    resumed = run(remote_cfg)

    assert [s["computed_in_this_run"] for s in resumed["shards"]] == [False, True, False]
    assert [s.get("sha256") for s in resumed["shards"]] == [sha256[0], None, sha256[2]]
    assert [s.get("crc32c") for s in resumed["shards"]] == [None, local["shards"][1]["crc32c"], None]
    assert _remote_bytes(paths[1] + CRC32C_SUFFIX).decode() == local["shards"][1]["crc32c"]
    assert cli.main(["verify", OUT, "--samples", "0"]) == 0


def test_inspect_and_verify_read_a_remote_folder(remote_and_local, capsys):
    _, _, local, _, _ = remote_and_local

    assert cli.main(["inspect", OUT, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["complete"] and report["view"]["jacobian"]["shape"] == [40, 3, 8, 8, 1]
    assert report["shards_on_disk"] == [Path(s["file"]).name for s in local["shards"]]

    assert cli.main(["verify", OUT, "--samples", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["shards_checked"] == 3 and report["max_rel_error"]["tape"] <= 1e-4

    path = remote_fs.local_path(f"{OUT}/{local['shards'][0]['file']}")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cli.main(["verify", OUT, "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any(local["shards"][0]["file"] in p and "crc32c" in p for p in problems)


def test_a_remote_folder_without_manifest_is_reported_incomplete(store, capsys):
    storage.write_bytes(f"{OUT}/shards/.shard-000000000000-000000000016.h5.tmp-abc", b"x")
    assert cli.main(["inspect", OUT]) == 1
    assert "NOT COMPLETE" in capsys.readouterr().out  # a run's shards/ on an object store: a prefix, no entry
    assert cli.main(["inspect", "fakegcs://bucket/nothing"]) == cli.FAILED
    storage.write_bytes("fakegcs://bucket/data/a.npy", b"x")
    assert cli.main(["verify", "fakegcs://bucket/data"]) == cli.FAILED
    assert "fakegcs://bucket/data: not a jacobeam output folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_remote_output_from_worker_processes(tmp_path, store):
    """Worker processes import the test file system through --beam_plugins, which runner.run fills in."""
    _, local_cfg, remote_cfg = _jobs(tmp_path)
    local = run(local_cfg)
    remote = run(remote_cfg, ["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    assert [s["crc32c"] for s in remote["shards"]] == [s["crc32c"] for s in local["shards"]]
    assert any(s["worker_pid"] != __import__("os").getpid() for s in remote["shards"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_remote_output_through_the_standalone_job_service(tmp_path, store):
    """The README's local stand-in for a Flink or Spark job server: Beam's Python job service on a port,
    PortableRunner with --job_endpoint and LOOPBACK workers; output on the remote file system."""
    with beam_service("apache_beam.runners.portability.local_job_service_main", "--port") as port:
        _, local_cfg, remote_cfg = _jobs(tmp_path)
        local = run(local_cfg)
        args = ["--runner=PortableRunner", f"--job_endpoint=localhost:{port}", "--environment_type=LOOPBACK"]
        remote = run(remote_cfg, args)
    assert [s["crc32c"] for s in remote["shards"]] == [s["crc32c"] for s in local["shards"]]
    for shard in remote["shards"]:
        assert _remote_bytes(f"{OUT}/{shard['file']}{CRC32C_SUFFIX}").decode() == shard["crc32c"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["shard_commit:2", "shard_renamed:1", "shard_renamed:3", "view", "manifest"])
def test_a_run_killed_while_writing_a_remote_folder_resumes_to_the_same_output(tmp_path, store, point, _runs_once):
    """SIGKILL of a run writing fakegcs:// (between copy and rename, between rename and sidecar, while
    finalizing), then the same command again: every shard byte for byte that of an uninterrupted run,
    and nothing temporary left."""
    import os
    import signal
    import subprocess
    import sys

    from jacobeam.transforms.testing import faults

    root, _, clean, _ = _runs_once  # the inputs and an uninterrupted run's local folder
    shutil.copytree(root / "store" / "bucket" / "data", remote_fs.local_path("fakegcs://bucket/data"))
    config = tmp_path / "remote.yaml"
    config.write_text(json.dumps({
        "model": {"factory": "tests.models:small_cnn"},
        "input": {"paths": ["fakegcs://bucket/data/*.npy"]},
        "jacobian": {"batch_size": 8, "threads": 1},  # as job_config: a shard records its threads
        "output": {"path": OUT, "samples_per_shard": 16},
    }))
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), faults.KILL_AT: point}
    launcher = "import sys, tests.remote_fs; from jacobeam.pipeline.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", launcher, "-q", "run", str(config)], cwd=repo, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert proc.wait(timeout=240) == -signal.SIGKILL
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "manifest.json" not in storage.listdir(OUT)
    left = storage.listdir(f"{OUT}/shards")
    unproven = [n for n in left if n.endswith(".h5") and not n.startswith(".") and n + CRC32C_SUFFIX not in left]
    assert len(unproven) == (1 if point.startswith("shard_renamed") else 0)

    assert cli.main(["-q", "run", str(config)]) == 0

    resumed = json.loads(_remote_bytes(f"{OUT}/manifest.json"))
    computed = {Path(s["file"]).name for s in resumed["shards"] if s["computed_in_this_run"]}
    assert set(unproven) <= computed  # a shard without its sidecar is never trusted
    assert [s["crc32c"] for s in resumed["shards"]] == [s["crc32c"] for s in clean["shards"]]
    for shard in resumed["shards"]:
        assert _remote_bytes(f"{OUT}/{shard['file']}") == (root / "local" / shard["file"]).read_bytes()
        assert _remote_bytes(f"{OUT}/{shard['file']}{CRC32C_SUFFIX}").decode() == shard["crc32c"]
    names = storage.listdir(OUT) + storage.listdir(f"{OUT}/shards")
    assert not [n for n in names if n.startswith(".")], names


@pytest.mark.parametrize("suffix, key, factory", [(".npz", "x", "grid_model"), (".h5", "x", "small_mlp")])
def test_npz_and_h5_inputs_are_read_through_file_objects(tmp_path, store, suffix, key, factory):
    """Remote .npz and .h5 inputs: the same stored values as the same files read from a local folder."""
    from tests import models as test_models

    model = getattr(test_models, factory)()
    samples = write_inputs(tmp_path / "data", model.input_shape[1:], suffix=suffix)
    write_inputs(remote_fs.local_path("fakegcs://bucket/data"), model.input_shape[1:], suffix=suffix)
    local = run(job_config(str(tmp_path / "data" / f"*{suffix}"), tmp_path / "local", f"tests.models:{factory}", key))
    remote = run(job_config(f"fakegcs://bucket/data/*{suffix}", OUT, f"tests.models:{factory}", key))

    assert [i["path"] for i in folder_inputs(remote["output_dir"])] == [f"fakegcs://bucket/data/{n}{suffix}" for n in "abc"]
    remote_inputs, local_inputs = folder_inputs(remote["output_dir"]), folder_inputs(local["output_dir"])
    assert [i["data_sha256"] for i in remote_inputs] == [i["data_sha256"] for i in local_inputs]
    for mine, theirs in zip(remote["shards"], local["shards"]):
        with storage.open_h5(f"{OUT}/{mine['file']}") as a, h5py.File(tmp_path / "local" / theirs["file"]) as b:
            for name in ("jacobian", "output", "sample_id"):
                np.testing.assert_array_equal(a[name][:], b[name][:])
    copied = tmp_path / "copied"
    _copy_back(OUT, copied)
    with h5py.File(copied / "jacobians.h5") as view:
        assert_close(view["jacobian"][:], tape_loop(model, samples))


def test_a_foreign_remote_folder_is_refused_and_overwrite_removes_only_our_files(remote_and_local):
    tmp_path, _, _, _, remote_cfg = remote_and_local
    storage.write_bytes(f"{OUT}/notes.txt", b"mine")
    other = remote_cfg.model_copy(update={"jacobian": remote_cfg.jacobian.model_copy(update={"batch_size": 4})})

    with pytest.raises(Exception, match=r"fakegcs://bucket/out holds the result of a different run"):
        run(other)
    replaced = runner.run(other, [], show_progress=False, overwrite=True).manifest

    assert all(s["computed_in_this_run"] for s in replaced["shards"])
    assert _remote_bytes(f"{OUT}/notes.txt") == b"mine"
    for shard in replaced["shards"]:
        assert _remote_bytes(f"{OUT}/{shard['file']}{CRC32C_SUFFIX}").decode() == shard["crc32c"]
    staged = f"{OUT}/.jacobeam-overwrite"  # computed there, then moved in: nothing left behind
    assert storage.listdir(staged) == [] and storage.listdir(f"{staged}/shards") == []
