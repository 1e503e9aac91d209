"""Planning from metadata: ``plan.make_job`` on many bytes against few, and what it reads per file.

The launcher lists files and reads headers only, so planning costs in the number of files, not their
bytes: 16 sparse ``.npy`` files of 4 GiB (64 GiB in all: a header, then a hole that reads as zeros, as
``truncate`` makes it) against 16 of 4 MiB, timed side by side in one run (interleaved repeats), and
the bytes the plan reads per file. ``--s3 N``: N objects on a local S3 server (moto, as the tests start
it), the bytes read per object counted at Beam's S3 downloader.

    .venv/bin/python -m benchmarks.planning                # 16 x 4 MiB against 16 x 4 GiB
    .venv/bin/python -m benchmarks.planning --s3 1000      # and 1,000 objects of 256 KiB on S3

Nothing here asserts a time (tests/test_plan_metadata.py checks the bytes read).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROW = 1024  # float32 values per sample: 4 KiB rows


def sparse_npy(path: Path, nbytes: int, row: int = ROW) -> None:
    """A ``.npy`` file of ``nbytes`` of float32 rows of ``row`` values: its header, then a hole."""
    rows = nbytes // (4 * row)
    with open(path, "wb") as stream:
        np.lib.format.write_array_header_1_0(stream, {"descr": "<f4", "fortran_order": False, "shape": (rows, row)})
        stream.truncate(stream.tell() + rows * row * 4)


def npy_bytes(rows: int, row: int = ROW) -> bytes:
    """A small ``.npy`` file's bytes (zeros)."""
    import io

    stream = io.BytesIO()
    np.save(stream, np.zeros((rows, row), np.float32))
    return stream.getvalue()


@contextlib.contextmanager
def counted_reads() -> Iterator[dict[str, int]]:
    """Bytes read from input files through ``storage.open_input`` while inside, by path."""
    from jacobeam.transforms.output import storage

    counts: dict[str, int] = {}
    real = storage.open_input

    class Counting:
        def __init__(self, stream, path):
            self._stream, self._path = stream, path

        def read(self, size=-1):
            data = self._stream.read(size)
            counts[self._path] = counts.get(self._path, 0) + len(data)
            return data

        def readinto(self, buffer):
            count = self._stream.readinto(buffer)
            counts[self._path] = counts.get(self._path, 0) + (count or 0)
            return count

        def __getattr__(self, name):
            return getattr(self._stream, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._stream.close()

    storage.open_input = lambda path, *args, **kwargs: Counting(real(path, *args, **kwargs), path)
    try:
        yield counts
    finally:
        storage.open_input = real


@contextlib.contextmanager
def s3_bytes() -> Iterator[list[int]]:
    """Bytes Beam's S3 downloader fetched while inside, one entry per ranged request."""
    from apache_beam.io.aws import s3io

    fetched: list[int] = []
    real = s3io.S3Downloader.get_range

    def get_range(self, start, end):
        data = real(self, start, end)
        fetched.append(len(data))
        return data

    s3io.S3Downloader.get_range = get_range
    try:
        yield fetched
    finally:
        s3io.S3Downloader.get_range = real


def plan(paths: list[str], out: str):
    """``plan.make_job`` of a run over ``paths`` (the model not loaded: its check is another cost)."""
    from jacobeam.pipeline import config, plan

    cfg = config.validate({
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": paths},
        "output": {"path": out},
    })
    return plan.make_job(cfg, check_model=False, identify_model=False)


def _local(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        folders = {}
        for label, size in (("16 x 4 MiB", 4 << 20), ("16 x 4 GiB", 4 << 30)):
            folder = Path(root) / label.replace(" ", "")
            folder.mkdir()
            for i in range(16):
                sparse_npy(folder / f"x{i:02d}.npy", size)
            folders[label] = folder
        times: dict[str, list[float]] = {label: [] for label in folders}
        read: dict[str, int] = {}
        for repeat in range(repeats + 1):  # the first round warms up (imports, file system caches)
            for label, folder in list(folders.items())[:: 1 if repeat % 2 else -1]:  # each first in turn
                with counted_reads() as counts:
                    began = time.perf_counter()
                    job = plan([str(folder / "*.npy")], str(Path(root) / "out"))
                    if repeat:
                        times[label].append(time.perf_counter() - began)
                read[label] = max(counts.values())
                assert job.spec.num_samples == 16 * (4 << (20 if "MiB" in label else 30)) // (4 * ROW)
        small, big = (statistics.median(t) for t in times.values())
        for label, t in times.items():
            print(f"plan {label:12} {statistics.median(t) * 1e3:8.1f} ms (median of {repeats}), "
                  f"at most {read[label]:,} bytes read per file")
        print(f"ratio 64 GiB / 64 MiB: {big / small:.2f}x (target: at most 2x)")


def _s3(objects: int, size: int) -> None:
    import boto3
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    from tests.services import moto_s3

    with moto_s3() as endpoint, tempfile.TemporaryDirectory() as root:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="planning")
        body = npy_bytes(size // (4 * ROW))
        for i in range(objects):
            client.put_object(Bucket="planning", Key=f"in/x{i:05d}.npy", Body=body)
        FileSystems.set_options(PipelineOptions([
            f"--s3_endpoint_url={endpoint}", "--s3_access_key_id=testing", "--s3_secret_access_key=testing",
            "--s3_region_name=us-east-1",
        ]))
        with s3_bytes() as fetched:
            began = time.perf_counter()
            job = plan(["s3://planning/in/*.npy"], str(Path(root) / "out"))
            seconds = time.perf_counter() - began
        assert len(job.spec.files) == objects
        print(f"plan {objects} S3 objects of {len(body):,} bytes: {seconds:.1f} s, {sum(fetched) / objects:,.0f} bytes "
              f"read per object ({len(fetched) / objects:.1f} requests; target: at most 65,536)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--s3", type=int, default=0, help="objects on a local S3 server (0: none)")
    parser.add_argument("--s3-size", type=int, default=256 << 10, help="bytes per object")
    args = parser.parse_args()
    _local(args.repeats)
    if args.s3:
        _s3(args.s3, args.s3_size)


if __name__ == "__main__":
    main()
