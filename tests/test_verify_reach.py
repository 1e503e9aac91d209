"""``jacobeam verify --inputs {sampled,all,none}``: whose input samples verify reads again, and how many
bytes, on a dataset large in bytes and small in samples (sparse ``.npy`` files: wide rows of zeros, each
marked with its id, through a linear model that stores one number per sample)."""

import contextlib
from pathlib import Path

import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.engine.models import seeded_weights

WIDE = 250_000  # 1 MB float32 samples: the fast suite's 100 MB dataset
WIDER = 1_000_000  # 4 MB samples: the slow test's 10 GB


def _linear(width: int, dtype: str):
    import keras

    side = int(np.sqrt(width))  # sums of `side` terms twice: one of `width` terms differs by kernel in float32
    model = keras.Sequential([
        keras.Input((width,), dtype=dtype),
        keras.layers.Reshape((side, side), dtype=dtype),
        keras.layers.Dense(1, dtype=dtype),
        keras.layers.Flatten(dtype=dtype),
        keras.layers.Dense(1, dtype=dtype),
    ])
    seeded_weights(model, seed=3)
    return model


def wide_linear(dtype: str = "float32"):
    """x[250,000] -> 500 x Dense 1 -> Dense 1 (a model.factory for the tests below)."""
    return _linear(WIDE, dtype)


def wider_linear(dtype: str = "float32"):
    """x[1,000,000] -> 1,000 x Dense 1 -> Dense 1."""
    return _linear(WIDER, dtype)


def _sparse_npy(path: Path, first_id: int, rows: int, width: int) -> int:
    """A ``.npy`` file of ``rows`` float32 samples of zeros, written as a sparse file, except that each
    sample's first entry is its id + 1 (so that every sample's bytes differ); returns its header's size."""
    with open(path, "wb") as stream:
        np.lib.format.write_array_header_1_0(stream, {"descr": "<f4", "fortran_order": False, "shape": (rows, width)})
        header = stream.tell()
        stream.truncate(header + rows * width * 4)
        for row in range(rows):
            stream.seek(header + row * width * 4)
            stream.write(np.float32(first_id + row + 1).tobytes())
    return header


def make_dataset(root: Path, files: int, rows: int, width: int, factory: str, per_shard: int, **run) -> dict:
    (root / "data").mkdir(parents=True)
    headers = [_sparse_npy(root / "data" / f"part{i}.npy", i * rows, rows, width) for i in range(files)]
    cfg = config.validate({
        "model": {"factory": f"tests.test_verify_reach:{factory}"},
        "input": {"paths": [str(root / "data" / "*.npy")]},
        # one number per sample stored; the run's self-check recomputes one sample per shard
        "jacobian": {"batch_size": 8, "reduce": "frobenius", "self_check": {"samples": 1}},
        "output": {"path": str(root / "out"), "samples_per_shard": per_shard},
    })
    result = runner.run(cfg, [], show_progress=False, **run)
    return {"root": root, "out": root / "out", "rows": rows, "width": width, "header": headers[0],
            "manifest": result.manifest}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """4 files of 25 samples of 1 MB (100 MB, sparse on disk), 10 shards of 10 samples (some span two
    files); the run verified 2 samples at its end (``run --verify 2``)."""
    return make_dataset(tmp_path_factory.mktemp("reach"), 4, 25, WIDE, "wide_linear", 10, verify_samples=2)


def _shards_of(manifest: dict, ids) -> list[dict]:
    """The manifest's shards holding these ids, by their ranges."""
    return [shard for shard in manifest["shards"] if any(shard["start"] <= i < shard["stop"] for i in ids)]


def _files_spanned(shard: dict, rows: int) -> int:
    return len(range(shard["start"] // rows, (shard["stop"] - 1) // rows + 1))


def _expected_bytes(data: dict, shards: list[dict]) -> tuple[int, int]:
    """The bytes of these shards' samples, and an upper bound with the headers of the files they span
    read once per shard (each file's header, and a read buffer's worth beyond it)."""
    row_bytes = data["width"] * 4
    samples = sum(shard["num_samples"] for shard in shards) * row_bytes
    return samples, samples + sum(_files_spanned(s, data["rows"]) for s in shards) * (data["header"] + 8192)


@contextlib.contextmanager
def _changed(data: dict, *sample_ids: int):
    """These samples' last entry made 0.5 in their input files (a finite value, the file's size kept), and
    restored afterwards: the module's dataset serves the other tests."""
    rows, row_bytes = data["rows"], data["width"] * 4
    places = [(data["root"] / "data" / f"part{i // rows}.npy", data["header"] + (i % rows + 1) * row_bytes - 4)
              for i in sample_ids]
    try:
        for path, offset in places:
            with open(path, "r+b") as stream:
                stream.seek(offset)
                stream.write(np.float32(0.5).tobytes())
        yield
    finally:
        for path, offset in places:
            with open(path, "r+b") as stream:
                stream.seek(offset)
                stream.write(np.float32(0).tobytes())


def test_sampled_reads_only_the_sampled_shards_inputs(dataset):
    report = verify(dataset["out"], samples=3, seed=1)
    assert report.ok, report.problems
    sampled = _shards_of(dataset["manifest"], report.samples)
    assert 1 <= len(sampled) <= 3 and len(report.samples) == 3
    low, high = _expected_bytes(dataset, sampled)
    inputs = report.inputs
    assert inputs["reach"] == "sampled" and inputs["shards"] == 10 and inputs["shards_rehashed"] == len(sampled)
    assert inputs["samples_rehashed"] == sum(shard["num_samples"] for shard in sampled)
    assert low <= inputs["bytes_rehashed"] <= high, (inputs, low, high)
    # in all: those, and the recomputed samples' rows with their files' headers
    assert low <= inputs["bytes_read"] <= high + 3 * (dataset["width"] * 4 + 2 * (dataset["header"] + 8192))


def test_all_reads_every_input_byte_and_none_reads_none(dataset):
    every = verify(dataset["out"], samples=0, inputs="all").inputs
    low, high = _expected_bytes(dataset, dataset["manifest"]["shards"])
    assert low == 100 * dataset["width"] * 4  # the 100 samples of 1 MB
    assert every["shards_rehashed"] == 10 and every["samples_rehashed"] == 100
    assert low <= every["bytes_rehashed"] == every["bytes_read"] <= high

    nothing = verify(dataset["out"], samples=0, inputs="none").inputs
    assert nothing["shards_rehashed"] == nothing["bytes_rehashed"] == nothing["bytes_read"] == 0
    # recomputing 2 samples still reads their rows (and headers), nothing of their shards beyond them
    recomputing = verify(dataset["out"], samples=2, inputs="none")
    assert recomputing.ok and len(recomputing.samples) == 2
    row_bytes = dataset["width"] * 4
    assert 2 * row_bytes <= recomputing.inputs["bytes_read"] <= 2 * row_bytes + 4 * (dataset["header"] + 8192)

    # --samples 0 samples no shard: the default re-hashes nothing, and says so
    assert verify(dataset["out"], samples=0).inputs["bytes_read"] == 0


def test_the_counted_bytes_are_what_the_process_read(dataset):
    """Independently of the counter: the bytes the process read (Linux's rchar) with --inputs all exceed
    those with --inputs none by the dataset's size, within a read buffer per shard and file."""
    io_file = Path("/proc/self/io")
    if not io_file.exists():
        pytest.skip("no /proc/self/io on this system")

    def rchar() -> int:
        return int(next(line for line in io_file.read_text().splitlines() if line.startswith("rchar:")).split()[1])

    verify(dataset["out"], samples=0, inputs="none")  # imports and caches warmed
    measured = {}
    for reach in ("none", "all"):
        before = rchar()
        verify(dataset["out"], samples=0, inputs=reach)
        measured[reach] = rchar() - before
    low, high = _expected_bytes(dataset, dataset["manifest"]["shards"])
    assert low <= measured["all"] - measured["none"] <= high + (1 << 20), measured


def test_the_report_and_the_manifest_say_what_was_read(dataset, capsys):
    recorded = dataset["manifest"]["verify"]  # run --verify 2
    assert recorded["ok"] and recorded["inputs"]["reach"] == "sampled"
    assert recorded["inputs"]["shards_rehashed"] == len(_shards_of(dataset["manifest"], recorded["sample_ids"]))

    assert cli.main(["verify", str(dataset["out"]), "--samples", "0", "--inputs", "all"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  inputs"))
    assert line.startswith("  inputs      re-hashed the samples of 10 of 10 shard(s) (--inputs all): 100 sample(s), "
                           "100 MB read in "), line

    assert cli.main(["verify", str(dataset["out"]), "--samples", "2", "--inputs", "none"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  inputs"))
    assert line.startswith("  inputs      not re-hashed (--inputs none): no shard's samples were compared with the "
                           "input files; 2 MB read from input files in all"), line

    assert cli.main(["verify", str(dataset["out"]), "--samples", "0"]) == 0
    assert "  inputs      not re-hashed: no sample recomputed (--samples 0), so no shard sampled; --inputs all " \
        "re-hashes every shard's samples\n" in capsys.readouterr().out


def test_a_changed_input_byte_is_caught_where_the_reach_reads(dataset):
    chosen = verify(dataset["out"], samples=2, seed=5)
    assert chosen.ok, chosen.problems
    sampled = _shards_of(dataset["manifest"], chosen.samples)
    others = [shard for shard in dataset["manifest"]["shards"] if shard not in sampled]
    # a sample of a sampled shard, not one recomputed: only its shard's digest can tell
    inside = next(i for i in range(sampled[0]["start"], sampled[0]["stop"]) if i not in chosen.samples)
    outside = others[0]["start"]  # a sample of a shard not sampled: only --inputs all reads it

    def changed(shard: dict) -> str:
        return f"{shard['file']}: its samples, read again from the input files, differ from those its worker read " \
            "(samples_sha256): the inputs changed since"

    with _changed(dataset, inside):
        assert verify(dataset["out"], samples=2, seed=5).problems == [changed(sampled[0])]
        assert verify(dataset["out"], samples=2, seed=5, inputs="all").problems == [changed(sampled[0])]
        unchecked = verify(dataset["out"], samples=2, seed=5, inputs="none")
        assert unchecked.ok and unchecked.inputs["shards_rehashed"] == 0  # it did not look, and says so
    with _changed(dataset, outside):
        assert verify(dataset["out"], samples=2, seed=5).ok
        assert verify(dataset["out"], samples=0, inputs="all").problems == [changed(others[0])]
    with _changed(dataset, inside, outside):
        both = sorted([sampled[0], others[0]], key=lambda shard: shard["start"])
        assert verify(dataset["out"], samples=2, seed=5, inputs="all").problems == [changed(shard) for shard in both]
    assert verify(dataset["out"], samples=2, seed=5, inputs="all").ok  # restored


@pytest.mark.slow
def test_ten_gigabytes_sampled_reads_the_sampled_shards_and_all_reads_everything(tmp_path):
    """The issue's case: ``verify --samples 8`` on 10 GB of inputs (5 sparse files of 500 samples of 4 MB,
    100 shards) reads the inputs of at most 8 shards; ``--inputs all`` reads all 10 GB."""
    data = make_dataset(tmp_path, 5, 500, WIDER, "wider_linear", 25)
    assert sum(f.stat().st_size for f in (tmp_path / "data").iterdir()) >= 10**10
    sampled = verify(data["out"], samples=8)
    assert sampled.ok, sampled.problems
    shards = _shards_of(data["manifest"], sampled.samples)
    low, high = _expected_bytes(data, shards)
    assert sampled.inputs["shards_rehashed"] == len(shards) <= 8
    assert low <= sampled.inputs["bytes_rehashed"] <= high and high < 10**9
    every = verify(data["out"], samples=8, inputs="all")
    low, high = _expected_bytes(data, data["manifest"]["shards"])
    assert every.ok and every.inputs["shards_rehashed"] == 100 and low <= every.inputs["bytes_rehashed"] <= high
    assert low == 2500 * WIDER * 4


def test_recomputing_samples_of_a_compressed_npz_reads_it_about_once(tmp_path):
    """A compressed ``.npz`` member seeks by decompressing from its start: each file is opened once and read
    forwards, not opened again per sample (40 samples read it ~20 times over: 25 MB for 1.3 MB)."""
    samples = np.random.default_rng(0).normal(size=(400, 784)).astype(np.float32)
    np.savez_compressed(tmp_path / "x.npz", x=samples)
    cfg = config.validate({"model": {"builtin": "mlp"}, "input": {"paths": [str(tmp_path / "x.npz")], "key": "x"},
                           "jacobian": {"outputs": [0]}, "output": {"path": str(tmp_path / "out")}})
    runner.run(cfg, [], show_progress=False)

    report = verify(tmp_path / "out", samples=40, inputs="none")

    assert report.ok and len(report.samples) == 40, report.problems
    assert report.inputs["bytes_read"] <= 1.2 * (tmp_path / "x.npz").stat().st_size, report.inputs
