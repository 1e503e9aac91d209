"""Planning inputs on S3 (the local moto server of ``test_s3.py``) reads headers only: at most 64 KiB per
object, counted at Beam's S3 downloader (benchmarks/planning.py --s3 1000 does the same for 1,000)."""

from benchmarks.planning import npy_bytes, plan, s3_bytes
from tests.test_s3 import bucket, s3_endpoint  # noqa: F401 - the fixtures

OBJECTS = 50
BYTES = 256 << 10  # each object: a .npy file of 256 KiB (rows of 4 KiB)


def test_planning_s3_objects_reads_at_most_64_kib_per_object(bucket, tmp_path):  # noqa: F811 - the fixture
    body = npy_bytes(BYTES // 4096)
    for i in range(OBJECTS):
        bucket.put(f"in/x{i:03d}.npy", body)
    with s3_bytes() as fetched:
        job = plan([bucket.url("in/*.npy")], str(tmp_path / "out"))
    assert len(job.spec.files) == OBJECTS and job.spec.num_samples == OBJECTS * (BYTES // 4096)
    assert len(fetched) <= 4 * OBJECTS  # a few ranged requests per object: the header's
    assert sum(fetched) <= OBJECTS * (64 << 10), f"{sum(fetched) / OBJECTS:,.0f} bytes per object"
    assert max(fetched) <= 64 << 10
