"""Planning from metadata: the launcher reads headers only (a sparse 4 GiB file costs what a small one
does), the workers read, check and hash the samples; a bad sample under ``error`` stops the run with one
line while the complete shards stay for the rerun; ``verify`` reads the samples again against each
shard's digest. The S3 case (bytes read per object): ``test_s3_plan.py``; timings: benchmarks/planning.py."""

import json
import re

import numpy as np
import pytest
from PIL import Image

from benchmarks.planning import counted_reads, plan, sparse_npy
from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.inputs import arrays, images


def _no_rows(monkeypatch):
    def refused(self, start, stop):
        raise AssertionError(f"the plan read rows {start}..{stop}")

    monkeypatch.setattr(arrays._NpyRows, "read", refused)
    monkeypatch.setattr(arrays._H5Rows, "read", refused)


def test_planning_a_sparse_4_gib_file_reads_its_header_only(tmp_path, monkeypatch):
    for name in ("a", "b"):
        sparse_npy(tmp_path / f"{name}.npy", 4 << 30)
    _no_rows(monkeypatch)
    with counted_reads() as counts:
        job = plan([str(tmp_path / "*.npy")], str(tmp_path / "out"))
    assert job.spec.num_samples == 2 * (4 << 30) // 4096 and len(job.spec.ranges()) == 512
    assert sorted(counts) == [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    assert max(counts.values()) <= 4096, counts  # the .npy header: 128 bytes
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("suffix, mode, transparency, channels", [
    (".png", "L", None, 1), (".png", "RGBA", None, 4), (".jpg", "RGB", None, 3),
    # A tRNS chunk gives a palette an alpha channel, not grey or RGB; CMYK decodes to RGB.
    (".png", "L", 3, 1), (".png", "RGB", (1, 2, 3), 3), (".png", "P", 0, 4), (".png", "P", None, 3),
    (".png", "LA", None, 2), (".jpg", "L", None, 1), (".jpg", "CMYK", None, 3),
])
def test_an_image_is_described_from_its_header_as_it_decodes(tmp_path, suffix, mode, transparency, channels):
    path = tmp_path / f"x{suffix}"
    pixels = np.random.default_rng(0).integers(0, 256, (9, 14, 3), dtype=np.uint8)
    image = Image.fromarray(pixels).convert(mode)
    image.save(path, **({} if transparency is None else {"transparency": transparency}))
    with counted_reads() as counts:
        described = images.describe(str(path), None)
    decoded = images.read_images([described])[0]
    assert described.sample_shape == decoded.shape == (9, 14, channels)
    assert sum(counts.values()) < path.stat().st_size or path.stat().st_size <= 4096
    sized = images.ImageOptions(size=(5, 6), channels=1)
    with counted_reads() as counts:
        assert images.describe(str(path), None, image=sized).sample_shape == (5, 6, 1)
    assert counts == {}  # input.image gives the shape: the file is not opened


def _config(data, out, policy):
    return {
        "model": {"factory": "tests.models:small_mlp"},
        "input": {"paths": [str(data / "*.npy")], "on_bad_sample": policy},
        "jacobian": {"batch_size": 4},
        "output": {"path": str(out), "samples_per_shard": 8},
    }


def test_a_nan_under_error_stops_the_worker_and_the_fixed_rerun_keeps_the_complete_shards(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(16, 12)).astype(np.float32), rng.normal(size=(8, 12)).astype(np.float32)
    np.save(data / "a.npy", a)
    bad = b.copy()
    bad[5, 2] = np.nan
    np.save(data / "b.npy", bad)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(data, out, "error")))

    assert cli.main(["-q", "run", str(cfg)]) == cli.FAILED
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("jacobeam")]  # not TensorFlow's native noise
    assert len(ours) == 1 and "Traceback" not in err, err
    assert re.fullmatch(rf"jacobeam: error: {re.escape(str(data / 'b.npy'))}: row 5: non-finite input: holds NaN "
                        r"\(input.on_bad_sample is error; .*\)", ours[0]), err
    complete = sorted(p.name for p in (out / "shards").glob("shard-*.h5"))
    assert complete == ["shard-000000000000-000000000008.h5", "shard-000000000008-000000000016.h5"]
    before = {name: (out / "shards" / name).read_bytes() for name in complete}

    np.save(data / "b.npy", b)  # fixed
    assert cli.main(["-q", "run", str(cfg)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["computed_in_this_run"] for s in manifest["shards"]] == [False, False, True]
    assert manifest["run"]["samples_computed"] == 8 and manifest["rejected"]["count"] == 0
    assert {name: (out / "shards" / name).read_bytes() for name in complete} == before
    assert verify(out, samples=2).ok


def test_a_nan_under_skip_is_listed_by_its_shard_and_verify_checks_the_samples_digest(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    x = np.random.default_rng(2).normal(size=(12, 12)).astype(np.float32)
    x[9, 0] = np.nan
    np.save(data / "x.npy", x)
    manifest = runner.run(config.validate(_config(data, out, "skip")), [], show_progress=False).manifest
    lines = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert lines == [{"id": 9, "file": str(data / "x.npy"), "row": 9, "reason": "non-finite input: holds NaN"}]
    assert [s["rejected"] for s in manifest["shards"]] == [0, 1]
    assert verify(out).ok

    x[3, 3] += 1.0  # another sample behind the same ids
    np.save(data / "x.npy", x)
    report = verify(out, inputs="all")  # without samples recomputed, the default re-hashes no shard's samples
    assert report.problems == [
        "shards/shard-000000000000-000000000008.h5: its samples, read again from the input files, differ from "
        "those its worker read (samples_sha256): the inputs changed since"
    ]


def test_a_folder_whose_shards_list_no_rejected_samples_or_stamps_resumes_from_its_manifest(tmp_path):
    """Shards written before planning read headers only: no rejected_samples, input_stamps or
    samples_sha256; their rejected samples come from rejected.jsonl, their files' stamps from the manifest."""
    import h5py

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    x = np.random.default_rng(3).normal(size=(12, 12)).astype(np.float32)
    x[2, 0] = np.inf
    np.save(data / "x.npy", x)
    cfg = config.validate(_config(data, out, "skip"))
    first = runner.run(cfg, [], show_progress=False).manifest
    listed = (out / "rejected.jsonl").read_text()
    for shard in (out / "shards").glob("shard-*.h5"):
        with h5py.File(shard, "a") as h5:
            h5.pop("rejected_samples", None)
            for name in ("input_stamps", "samples_sha256"):
                del h5.attrs[name]
    again = runner.run(cfg, [], show_progress=False).manifest
    assert again["run"]["samples_computed"] == 0 and (out / "rejected.jsonl").read_text() == listed
    assert again["rejected"] == first["rejected"] and verify(out, samples=1).ok
