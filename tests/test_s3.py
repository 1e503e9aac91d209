"""Inputs and output on S3 through Beam's own S3 file system (``apache-beam[aws]``), against a local S3
server: moto's ``moto_server`` on 127.0.0.1, started once for the session and stopped after it
(``tests.services.moto_s3``), each test in a bucket of its own. jacobeam reaches it only through Beam's
options (``--s3_endpoint_url``, ``--s3_access_key_id``, ``--s3_secret_access_key``, ``--s3_region_name``),
given on the command line as a user would: to ``jacobeam run`` (the launcher's plan and the workers) and
to ``inspect``/``verify``.

What real S3 does and the fake ``fakegcs://`` of ``tests/remote_fs.py`` does not: uploads are multipart
(parts of at least 5 MiB but the last, and never none: an empty object cannot be uploaded that way),
rename is a server-side copy and a delete, listing is paged by prefix, reads are ranged GETs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import signal
import uuid
from pathlib import Path
from typing import Any

import google_crc32c
import h5py
import numpy as np
import pytest

from jacobeam.pipeline import checks, cli, folder
from jacobeam.transforms.output import lease, shards, storage
from jacobeam.transforms.output.inputs_table import folder_inputs
from jacobeam.transforms.output.layout import CRC32C_SUFFIX, LEASE
from tests import takeover
from tests.models import small_cnn
from tests.reference import assert_close, tape_loop
from tests.services import JacobeamRuns, jacobeam_process, moto_s3
from tests.test_pipeline import write_inputs

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Bucket:
    """One bucket on the test's S3 server; ``args`` are the Beam options that reach it."""

    name: str
    endpoint: str
    client: Any  # a boto3 S3 client: the test's own view of the bucket, beside jacobeam's

    @property
    def args(self) -> list[str]:
        return [
            f"--s3_endpoint_url={self.endpoint}", "--s3_access_key_id=testing", "--s3_secret_access_key=testing",
            "--s3_region_name=us-east-1",
        ]

    def url(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}"

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.name, Key=key)

    def keys(self, prefix: str = "") -> list[str]:
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix):
            found += [item["Key"] for item in page.get("Contents", [])]
        return sorted(found)

    def copy_back(self, prefix: str, target: Path) -> None:
        """Every object under ``prefix/`` into the local folder ``target`` (as ``aws s3 cp --recursive``)."""
        for key in self.keys(prefix + "/"):
            path = target / key[len(prefix) + 1:]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.get(key))


@pytest.fixture(scope="session")
def s3_endpoint():
    with moto_s3() as endpoint:
        yield endpoint


def _new_bucket(endpoint: str) -> Bucket:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    bucket = Bucket(f"jacobeam-{uuid.uuid4().hex[:12]}", endpoint, client)
    client.create_bucket(Bucket=bucket.name)
    return bucket


def _set_filesystem_options(monkeypatch, args: list[str] | None) -> None:
    """Beam's file systems in this process with these options (None: none set, as in a fresh process);
    undone after the test."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    monkeypatch.setattr(FileSystems, "_pipeline_options", None if args is None else PipelineOptions(args))


@pytest.fixture
def bucket(s3_endpoint, monkeypatch) -> Bucket:
    bucket = _new_bucket(s3_endpoint)
    _set_filesystem_options(monkeypatch, bucket.args)
    return bucket


# -- the storage layer on S3 --------------------------------------------------------------------------


def test_beams_s3_write_stream_cannot_write_an_empty_object(bucket):
    """Why ``storage`` puts small S3 objects: Beam's write stream is a multipart upload, and S3 refuses to
    complete one with no part. (Should a later Beam write empty objects, ``storage.S3_PUT_BYTES`` may go.)"""
    from apache_beam.io.filesystems import FileSystems

    with pytest.raises(Exception, match="MalformedXML"):
        with FileSystems.create(bucket.url("empty")):
            pass
    assert bucket.keys() == []


def test_empty_and_small_objects_are_written_as_s3_takes_them(bucket, tmp_path):
    """Empty objects (the writability probe, an empty rejected.jsonl) and small ones, by every write of
    ``storage``; fails where they go through Beam's multipart stream (MalformedXML)."""
    storage.write_bytes(bucket.url("out/a"), b"")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    storage.copy_from_local(empty, bucket.url("out/b"))
    storage.write_atomically(bucket.url("out/rejected.jsonl"), lambda local: local.write_text(""))
    storage.write_bytes(bucket.url("out/c"), b"abc")

    assert [bucket.get(f"out/{k}") for k in ("a", "b", "rejected.jsonl", "c")] == [b"", b"", b"", b"abc"]
    assert storage.listdir(bucket.url("out")) == ["a", "b", "c", "rejected.jsonl"]  # no temporary name left
    assert storage.read_text(bucket.url("out/rejected.jsonl")) == ""

    checks.check_writable(bucket.url("run"))  # the probe: an empty object, created and deleted
    assert bucket.keys("run") == []


@pytest.mark.parametrize("size", [storage.S3_PUT_BYTES - 1, storage.S3_PUT_BYTES, 2 * storage.S3_PUT_BYTES + 7])
def test_objects_from_5_mib_go_through_beams_multipart_stream(bucket, tmp_path, size):
    """Below S3's least part size an object is one put (its ETag is the MD5 of its bytes); from it on,
    Beam's multipart upload (its ETag says how many parts: ``-N``); the same bytes either way."""
    data = np.random.default_rng(size).bytes(size)
    local = tmp_path / "big"
    local.write_bytes(data)
    storage.copy_from_local(local, bucket.url("big"))
    storage.write_bytes(bucket.url("big2"), data)

    for key in ("big", "big2"):
        assert bucket.get(key) == data
        etag = bucket.client.head_object(Bucket=bucket.name, Key=key)["ETag"].strip('"')
        if size < storage.S3_PUT_BYTES:
            assert etag == hashlib.md5(data).hexdigest()
        else:
            assert re.fullmatch(r"[0-9a-f]{32}-[1-9][0-9]*", etag), etag
    assert storage.sha256(bucket.url("big")) == hashlib.sha256(data).hexdigest()
    assert storage.crc32c(bucket.url("big")) == f"{google_crc32c.value(data):08x}"


def test_an_output_folder_that_cannot_be_written_fails_before_the_run(bucket):
    with pytest.raises(Exception, match=r"output.path s3://no-such-bucket-here/out: cannot write there"):
        checks.check_writable("s3://no-such-bucket-here/out")


def test_inspect_and_verify_refuse_options_beam_does_not_know(bucket):
    for extra in (["--no_such_option=1"], ["stray"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["inspect", bucket.url("out"), *bucket.args, *extra])
        assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["verify", "some/local/folder", "--s3_endpoint_url"])  # an option without its value


def test_an_s3_folder_has_one_writer_at_a_time(bucket, caplog):
    """The lease on S3: conditional requests (If-None-Match to create, If-Match to refresh, take over
    and remove), against the server's own checks."""
    folder = bucket.url("out")
    held = lease.Lease(folder).acquire()
    assert json.loads(bucket.get(f"out/{LEASE}"))["holder"] == held.run_id
    with pytest.raises(lease.LeaseBusy, match=rf"output folder {folder} is being written by run {held.run_id} "):
        lease.Lease(folder).acquire()
    assert held._file.refresh(held._record())  # the heartbeat: a conditional put on the lease's ETag

    bucket.put(f"out/{LEASE}", json.dumps({"holder": "newer", "host": "elsewhere", "pid": 1, "started_at": 0,
                                          "heartbeat": 9e12}).encode())  # as if taken over meanwhile
    assert not held._file.refresh(held._record())  # so the heartbeat stops
    held.release()
    assert json.loads(bucket.get(f"out/{LEASE}"))["holder"] == "newer"  # never removes another run's lease

    bucket.put(f"out/{LEASE}", json.dumps({"holder": "silent", "host": "elsewhere", "pid": 1, "started_at": 0,
                                          "heartbeat": 0}).encode())
    with lease.Lease(folder, stale_seconds=0.6).acquire() as taken:
        assert json.loads(bucket.get(f"out/{LEASE}"))["holder"] == taken.run_id
    assert "taking over the lease of run silent" in caplog.text and "did not change for 1 s, watched from here" in caplog.text
    assert f"out/{LEASE}" not in bucket.keys("out/")


@pytest.mark.slow
def test_a_run_paused_past_the_stale_time_and_taken_over_commits_nothing_on_s3_when_it_resumes(bucket, tmp_path):
    """The scenario of ``tests.takeover`` into an S3 folder: the fence is a read of the lease before each
    commit, and the take-over a delete conditional on the stale lease's ETag."""
    runs = JacobeamRuns()
    try:
        takeover.paused_and_taken_over(
            tmp_path, runs, bucket.url("out"), bucket.args,
            lambda: {key.removeprefix("out/"): bucket.get(key) for key in bucket.keys("out/")},
            lambda: json.loads(bucket.get(f"out/{LEASE}")))
    finally:
        runs.stop()


def test_a_run_into_an_s3_folder_another_run_holds_is_refused_before_anything_is_written(bucket, tmp_path):
    write_inputs(tmp_path / "in", (8, 8, 1))
    job = _config_file(tmp_path / "job.yaml", str(tmp_path / "in" / "*.npy"), bucket.url("out"))
    with lease.Lease(bucket.url("out")).acquire():
        assert cli.main(["-q", "run", str(job), *bucket.args]) == cli.BUSY
        assert bucket.keys("out/") == [f"out/{LEASE}"]


# -- whole runs ------------------------------------------------------------------------------------------


def _config_file(path: Path, data: str, out: str) -> Path:
    path.write_text(json.dumps({
        "model": {"factory": "tests.models:small_cnn"},
        "input": {"paths": [data]},
        "jacobian": {"batch_size": 8, "threads": 1},  # as job_config: a shard records its threads
        "output": {"path": out, "samples_per_shard": 16},
    }))
    return path


def _jacobeam(args: list[str], log: Path, kill_at: str | None = None, timeout: float = 300) -> tuple[int, int]:
    """``python -m jacobeam ARGS`` (``services.jacobeam_process``): its exit status (-9: it killed itself at
    ``kill_at``) and its process id."""
    return jacobeam_process(args, log, kill_at, timeout=timeout)


@dataclasses.dataclass
class Runs:
    bucket: Bucket
    root: Path
    samples: np.ndarray
    data: str  # the inputs' glob on S3
    local: Path  # the output folder of the same job run with a local output
    manifest: dict[str, Any]  # of the run into s3://BUCKET/out
    launcher: int  # the process id of that run's jacobeam


@pytest.fixture(scope="module")
def runs(s3_endpoint, tmp_path_factory) -> Runs:
    """The inputs in s3://BUCKET/in/*.npy; the same job run twice, into a local folder (in this process)
    and into s3://BUCKET/out (``jacobeam run`` in a process of its own, with two worker processes: the
    S3 options given on its command line reach its plan and the workers)."""
    root = tmp_path_factory.mktemp("s3")
    bucket = _new_bucket(s3_endpoint)
    samples = write_inputs(root / "in", (8, 8, 1))
    for path in sorted((root / "in").iterdir()):
        bucket.put(f"in/{path.name}", path.read_bytes())
    data = bucket.url("in/*.npy")

    log = root / "s3-run.log"
    remote = _config_file(root / "s3.yaml", data, bucket.url("out"))
    workers = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    status, launcher = _jacobeam(["-q", "run", str(remote), *bucket.args, *workers], log)
    assert status == 0, log.read_text()[-3000:]

    with pytest.MonkeyPatch.context() as monkeypatch:
        _set_filesystem_options(monkeypatch, None)
        local = root / "local"
        assert cli.main(["-q", "run", str(_config_file(root / "local.yaml", data, str(local))), *bucket.args]) == 0
    manifest = json.loads(bucket.get("out/manifest.json"))
    return Runs(bucket, root, samples, data, local, manifest, launcher)


def _assert_same_as_local(bucket: Bucket, prefix: str, local: Path, copied: Path) -> dict[str, Any]:
    """Every object under ``prefix`` bit for bit what the local run wrote, plus a proving sidecar per
    shard; nothing else (no temporary name, no probe). Returns the manifest."""
    manifest = json.loads(bucket.get(f"{prefix}/manifest.json"))
    reference = json.loads((local / "manifest.json").read_text())
    names = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    sidecars = [f"{s['file']}{CRC32C_SUFFIX}" for s in reference["shards"]]
    assert bucket.keys(prefix + "/") == sorted(f"{prefix}/{n}" for n in names + sidecars)

    assert [(s["file"], s["crc32c"]) for s in manifest["shards"]] == [(s["file"], s["crc32c"]) for s in reference["shards"]]
    for shard in reference["shards"]:
        data = bucket.get(f"{prefix}/{shard['file']}")
        assert data == (local / shard["file"]).read_bytes(), shard["file"]
        assert f"{google_crc32c.value(data):08x}" == shard["crc32c"]
        assert bucket.get(f"{prefix}/{shard['file']}{CRC32C_SUFFIX}").decode() == shard["crc32c"]
    assert bucket.get(f"{prefix}/rejected.jsonl") == (local / "rejected.jsonl").read_bytes() == b""  # an empty object
    assert manifest["num_samples"] == reference["num_samples"] and manifest["datasets"] == reference["datasets"]

    # Every dataset, of every shard and of the view (read where HDF5 resolves its sources: a local copy).
    bucket.copy_back(prefix, copied)
    for name in [*(s["file"] for s in reference["shards"]), "jacobians.h5"]:
        with h5py.File(copied / name) as ours, h5py.File(local / name) as theirs:
            datasets = [k for k in theirs if isinstance(theirs[k], h5py.Dataset)]
            assert datasets and datasets == [k for k in ours if isinstance(ours[k], h5py.Dataset)]
            for key in datasets:
                a, b = ours[key][:], theirs[key][:]
                if a.dtype == object:  # strings (source_files): their values, not the addresses numpy holds
                    assert b.dtype == object and a.tolist() == b.tolist(), (name, key)
                else:
                    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (name, key)
    return manifest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_from_and_to_s3_equals_a_local_run_bit_for_bit(runs):
    manifest = _assert_same_as_local(runs.bucket, "out", runs.local, runs.root / "copied")
    # the table as the bucket holds it (copied back: this process has no S3 options), listing the bucket's files
    assert [i["path"] for i in folder_inputs(runs.root / "copied")] == [runs.bucket.url(f"in/{n}.npy") for n in "abc"]
    assert manifest["config"]["output"]["path"] == runs.bucket.url("out")
    assert all(s["computed_in_this_run"] for s in manifest["shards"])
    pids = {s["worker_pid"] for s in manifest["shards"]}
    assert pids and runs.launcher not in pids, "the shards are written by worker processes, with the S3 options"
    with h5py.File(runs.root / "copied" / "jacobians.h5") as view:
        assert_close(view["jacobian"][:5], tape_loop(small_cnn(), runs.samples[:5]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inspect_and_verify_read_the_bucket(runs, monkeypatch, capsys):
    """``jacobeam inspect`` and ``verify --samples 2`` with the S3 options after the folder (nothing set
    beforehand in this process); then ``inspect`` with no option, as boto3 takes them from the environment."""
    url, args = runs.bucket.url("out"), runs.bucket.args
    _set_filesystem_options(monkeypatch, None)
    assert cli.main(["inspect", url, "--json", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["complete"] and report["view"]["jacobian"]["shape"] == [40, 3, 8, 8, 1]
    assert report["shards_on_disk"] == [Path(s["file"]).name for s in runs.manifest["shards"]]

    _set_filesystem_options(monkeypatch, None)
    assert cli.main(["verify", url, "--samples", "2", "--json", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["shards_checked"] == 3 and report["max_rel_error"]["tape"] <= 1e-4, report

    _set_filesystem_options(monkeypatch, None)
    for name, value in {"AWS_ENDPOINT_URL_S3": runs.bucket.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["inspect", url]) == 0
    assert "complete" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shard_without_its_checksum_sidecar_is_not_counted_complete(runs, monkeypatch):
    """The proof of a remote shard, on S3: its sidecar, matching its bytes. Checked on a copy of the run."""
    bucket = runs.bucket
    _set_filesystem_options(monkeypatch, bucket.args)
    for key in bucket.keys("out/"):
        bucket.client.copy_object(Bucket=bucket.name, Key="proof/" + key[4:], CopySource={"Bucket": bucket.name, "Key": key})
    first, second, third = (f"proof/{s['file']}" for s in runs.manifest["shards"])
    bucket.delete(second + CRC32C_SUFFIX)
    changed = bytearray(bucket.get(third))
    changed[-1] ^= 0xFF
    bucket.put(third, bytes(changed))  # bytes that no longer match the sidecar

    found = folder.read_folder(bucket.url("proof"))

    assert list(found.shards) == [Path(first).name, Path(third).name]  # a launcher checks the sidecar exists
    assert bucket.url(second) in found.unproven
    assert shards.proven_checksum(bucket.url(first)) == {"crc32c": runs.manifest["shards"][0]["crc32c"]}
    assert shards.proven_checksum(bucket.url(second)) is None
    assert shards.proven_checksum(bucket.url(third)) is None  # a worker checks the bytes


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["shard_renamed:2", "manifest"])
def test_a_run_into_s3_killed_midway_resumes_to_the_same_bits(runs, monkeypatch, point):
    """``jacobeam run`` into S3 SIGKILLed (``shard_renamed:2``: the second shard renamed into place, its
    sidecar not written; ``manifest``: every shard done, the manifest's temporary object uploaded),
    then the same command again: the shards proven before are kept, the unproven one computed again,
    and the folder is bit for bit that of the local run, with nothing temporary left."""
    bucket = runs.bucket
    prefix = f"killed-{point.replace(':', '-')}"
    config = _config_file(runs.root / f"{prefix}.yaml", runs.data, bucket.url(prefix))
    log = runs.root / f"{prefix}.log"

    status, _ = _jacobeam(["-q", "run", str(config), *bucket.args], log, kill_at=point)
    assert status == -signal.SIGKILL, log.read_text()[-3000:]

    left = [key[len(prefix) + 1:] for key in bucket.keys(prefix + "/")]
    assert "manifest.json" not in left
    shard_names = [n for n in left if n.startswith("shards/shard-") and n.endswith(".h5")]
    proven = [n for n in shard_names if n + CRC32C_SUFFIX in left]
    unproven = [n for n in shard_names if n not in proven]
    assert len(unproven) == (1 if point.startswith("shard_renamed") else 0) and proven, left
    if point == "manifest":
        assert any(n.startswith(".manifest.json.tmp-") for n in left), left

    _set_filesystem_options(monkeypatch, None)  # the resume gets its S3 options from its command line
    assert cli.main(["-q", "run", str(config), *bucket.args]) == 0

    manifest = _assert_same_as_local(bucket, prefix, runs.local, runs.root / f"{prefix}-copied")
    computed = {s["file"] for s in manifest["shards"] if s["computed_in_this_run"]}
    assert set(unproven) <= computed  # a shard without its sidecar is computed again
    assert not set(proven) & computed  # a proven one is kept
