"""The lease of a ``gs://`` output folder (``transforms/output/lease.py``, ``_GCSObject``) against a GCS
emulator: fake-gcs-server on 127.0.0.1 (``tests.services.fake_gcs``), started for this module and stopped
after it, each test in a bucket of its own. The client finds it through ``STORAGE_EMULATOR_HOST`` (and
then needs no credentials).

What the emulator checks (``test_what_the_emulator_checks``): an upload's ``ifGenerationMatch``, as GCS
does and atomically, but not a delete's: it deletes whatever generation the request names. So a refused
second writer and a refused heartbeat below are the server's answers, as on GCS; of a take-over and a
release the tests check the request the server received, a delete conditional on the generation its
run last saw (which GCS refuses, 412, once another generation is live).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pytest

from jacobeam.pipeline import cli
from jacobeam.pipeline.output_lease import take_lease
from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output import lease
from jacobeam.transforms.output.layout import LEASE
from tests.services import fake_gcs

KEY = f"out/{LEASE}"


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log"
    with fake_gcs(log) as endpoint:
        yield endpoint, log


@dataclasses.dataclass
class Bucket:
    """One bucket on the emulator; ``handle``: the test's own view of it (a ``google.cloud.storage``
    bucket), beside jacobeam's."""

    name: str
    handle: Any
    log: Path  # the emulator's request log

    def url(self, key: str = "") -> str:
        return f"gs://{self.name}/{key}"

    def get(self, key: str) -> bytes:
        return self.handle.blob(key).download_as_bytes()

    def put(self, key: str, data: bytes) -> int:
        """Write ``data`` unconditionally; its generation."""
        blob = self.handle.blob(key)
        blob.upload_from_string(data)
        return blob.generation

    def generation(self, key: str) -> int | None:
        blob = self.handle.get_blob(key)
        return None if blob is None else blob.generation

    def deletes(self, key: str, count: int) -> list[int | None]:
        """The generation each delete request of ``key`` named (``ifGenerationMatch``; None: unconditional),
        in order, once the emulator has logged ``count`` of them (it logs a request once it has answered)."""
        request = re.compile(rf'"DELETE /storage/v1/b/{self.name}/o/{re.escape(urllib.parse.quote(key, safe=""))}\??([^ "\\]*) ')
        deadline = time.monotonic() + 10
        while True:
            found = [urllib.parse.parse_qs(query).get("ifGenerationMatch", [None])[0]
                     for query in request.findall(self.log.read_text())]
            if len(found) >= count or time.monotonic() > deadline:
                return [None if generation is None else int(generation) for generation in found]
            time.sleep(0.05)


@pytest.fixture
def bucket(gcs_server, monkeypatch) -> Bucket:
    from google.cloud import storage as gcs

    endpoint, log = gcs_server
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    handle = gcs.Client().create_bucket(f"jacobeam-{uuid.uuid4().hex[:12]}")
    return Bucket(handle.name, handle, log)


def _record(holder: str, heartbeat: float) -> bytes:
    return json.dumps({"holder": holder, "host": "elsewhere", "pid": 1, "started_at": 0, "heartbeat": heartbeat}).encode()


def test_what_the_emulator_checks(bucket):
    """Why the tests check a delete's request rather than its effect: fake-gcs-server (1.54) refuses an
    upload whose ``ifGenerationMatch`` does not hold, as GCS does, but deletes whatever generation a
    request names. (Should a later one refuse that delete, the tests may check its effect instead.)"""
    from google.api_core.exceptions import PreconditionFailed

    blob = bucket.handle.blob("x")
    blob.upload_from_string(b"1", if_generation_match=0)
    first = blob.generation
    with pytest.raises(PreconditionFailed):
        bucket.handle.blob("x").upload_from_string(b"2", if_generation_match=0)
    bucket.put("x", b"3")
    with pytest.raises(PreconditionFailed):
        bucket.handle.blob("x").upload_from_string(b"4", if_generation_match=first)
    assert bucket.get("x") == b"3"
    bucket.handle.blob("x").delete(if_generation_match=first)  # GCS: 412
    assert bucket.generation("x") is None


def test_a_second_writer_is_refused_while_the_first_holds_the_lease(bucket):
    folder = bucket.url("out")
    with lease.Lease(folder).acquire() as held:
        assert json.loads(bucket.get(KEY))["holder"] == held.run_id
        with pytest.raises(lease.LeaseBusy, match=rf"output folder {folder} is being written by run {held.run_id} "):
            lease.Lease(folder).acquire()
        assert json.loads(bucket.get(KEY))["holder"] == held.run_id
        mine = bucket.generation(KEY)
    assert bucket.generation(KEY) is None  # release removes it
    assert bucket.deletes(KEY, 1) == [mine]


def test_after_a_take_over_the_heartbeat_is_refused_and_the_other_runs_lease_not_removed(bucket):
    held = lease.Lease(bucket.url("out")).acquire()
    created = bucket.generation(KEY)
    assert held._file.refresh(held._record())  # the heartbeat: an upload conditional on the generation written
    refreshed = bucket.generation(KEY)
    assert refreshed != created

    newer = bucket.put(KEY, _record("newer", heartbeat=9e12))  # as if taken over meanwhile
    assert not held._file.refresh(held._record())  # refused by the server: so the heartbeat stops
    assert json.loads(bucket.get(KEY))["holder"] == "newer"
    held.release()
    # Its delete names the generation it wrote last, not the newer lease's (which GCS therefore keeps).
    assert bucket.deletes(KEY, 1) == [refreshed] and refreshed != newer


def test_a_lease_without_a_recent_heartbeat_is_taken_over(bucket, caplog):
    silent = bucket.put(KEY, _record("silent", heartbeat=0))
    with lease.Lease(bucket.url("out"), stale_seconds=0.6).acquire() as taken:
        assert json.loads(bucket.get(KEY))["holder"] == taken.run_id
        mine = bucket.generation(KEY)
    assert "taking over the lease of run silent" in caplog.text and "did not change for 1 s, watched from here" in caplog.text
    assert bucket.deletes(KEY, 2) == [silent, mine]  # the stale lease's generation, then its own
    assert bucket.generation(KEY) is None


def test_of_runs_that_start_at_once_one_holds_the_lease(bucket):
    """The create is conditional on the server (``ifGenerationMatch=0``): of eight at once, one succeeds."""
    runs = [lease.Lease(bucket.url("out")) for _ in range(8)]
    start = threading.Barrier(len(runs))
    refused = []

    def attempt(run: lease.Lease) -> None:
        start.wait()
        try:
            run.acquire()
        except lease.LeaseBusy:
            refused.append(run)

    threads = [threading.Thread(target=attempt, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        (winner,) = [run for run in runs if run.held]
        assert len(refused) == 7
        assert json.loads(bucket.get(KEY))["holder"] == winner.run_id
    finally:
        for run in runs:
            run.release()


def test_a_commit_into_a_gcs_folder_proves_its_run_still_holds_the_lease(bucket):
    """The fence on GCS (``transforms.output.fence``): a commit goes ahead while the lease names its run,
    and is refused, naming the new holder, once another run took it over. (A whole run into the emulator
    is not possible: Beam's gs:// file system deletes and renames by batch requests, which fake-gcs-server
    answers with "Bad response: not multi-part"; ``tests/test_fencing.py`` and ``test_s3.py`` run the
    take-over end to end, locally and on S3.)"""
    from jacobeam.transforms.errors import LostLeaseError
    from jacobeam.transforms.output.fence import Fence

    held = lease.Lease(bucket.url("out"), stale_seconds=0.3).acquire()
    committed = []
    with Fence(bucket.url("out"), held.run_id)():
        committed.append("shard")
    held._stop.set()  # paused: no more heartbeats
    held._thread.join()
    with lease.Lease(bucket.url("out"), stale_seconds=0.3).acquire(wait=True) as taker:  # watched, taken over
        with pytest.raises(LostLeaseError, match=rf"output folder {bucket.url('out').rstrip('/')}: this run "
                           rf"\({held.run_id}\) no longer holds its lease \(another run took it: run {taker.run_id} "):
            with Fence(bucket.url("out"), held.run_id)():
                committed.append("manifest")
        with Fence(bucket.url("out"), taker.run_id)():
            committed.append("the taker's")
    assert committed == ["shard", "the taker's"]
    held.release()  # its generation is not the live one: the taker's lease is not removed by it


def test_a_run_into_a_gcs_folder_another_run_holds_is_refused_before_anything_is_written(bucket, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"model": {"factory": "tests.models:small_cnn"}, "input": {"paths": [str(tmp_path / "*.npy")]},
                               "output": {"path": bucket.url("out")}}))
    with lease.Lease(bucket.url("out")).acquire():
        assert cli.main(["-q", "run", str(job)]) == cli.BUSY
        assert [blob.name for blob in bucket.handle.list_blobs()] == [KEY]
    assert f"jacobeam: error: output folder {bucket.url('out')} is being written by run " in capsys.readouterr().err


def test_without_google_cloud_storage_a_run_into_gs_exits_3_in_one_line(monkeypatch, tmp_path, capsys):
    import google.cloud

    monkeypatch.delattr(google.cloud, "storage", raising=False)
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # as if not installed: importing it fails
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"model": {"factory": "tests.models:small_cnn"}, "input": {"paths": [str(tmp_path / "*.npy")]},
                               "output": {"path": "gs://some-bucket/out"}}))
    assert cli.main(["-q", "run", str(job)]) == cli.MISSING_EXTRA
    assert capsys.readouterr().err == ("jacobeam: the lease of output folder gs://some-bucket/out needs google-cloud-storage: "
                                       "pip install 'apache-beam[gcp]'\n")


def test_without_credentials_the_lease_fails_in_one_line(monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/no/such/key.json")
    with pytest.raises(OutputError, match=r"^output folder gs://b/out: no Google Cloud credentials to take its lease: "
                                          r"File /no/such/key.json was not found\.$"):
        lease.Lease("gs://b/out")


def test_which_folders_take_a_lease(caplog):
    assert all(lease.supported(folder) for folder in ("out", "/tmp/out", "s3://b/out", "gs://b/out"))
    assert not lease.supported("hdfs://host/out")
    assert take_lease("hdfs://host/out", wait=False) == (None, [])
    assert "no lease on this file system yet (local, S3 and GCS folders have one)" in caplog.text
