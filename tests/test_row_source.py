"""Every row of ``jacobians.h5`` names its source (``source_files[source_file[i]]``, ``source_row[i]``),
and two results join row by row by that key where their ids differ (a model update's ``--overwrite``
after files were added and removed)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.engine.models import seeded_weights
from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.finalize import input_root, row_sources
from jacobeam.transforms.inputs.types import SourceFile
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_more_inputs import job, run

ROOT = Path(__file__).resolve().parent.parent


def cnn_v2(dtype: str = "float32"):
    """``small_cnn`` with other weights: the model's next version."""
    model = test_models.small_cnn(dtype)
    seeded_weights(model, seed=9)
    return model


def _piece(path: str, first_id: int, num_samples: int, first_row: int = 0) -> SourceFile:
    return SourceFile(path, None, num_samples, (2,), "float32", first_id=first_id, first_row=first_row)


def _sources(out: Path) -> tuple[list[tuple[str, int]], str, np.ndarray]:
    """Each row's key (file, row) read from the view directly, its root, its sample ids."""
    with h5py.File(out / "jacobians.h5") as f:
        files = [name.decode() for name in f["source_files"][:]]
        keys = [(files[k], int(r)) for k, r in zip(f["source_file"][:], f["source_row"][:])]
        return keys, f.attrs["source_root"], f["sample_id"][:]


def _sample(root: str, key: tuple[str, int]) -> np.ndarray:
    return np.load(Path(root) / key[0])[key[1]]


# --- the mapping, against a loop over every id ---------------------------------------------------------


def test_each_id_maps_to_its_file_and_row_as_a_loop_over_the_pieces_finds():
    pieces = [
        _piece("/d/b.npy", 3, 4),
        _piece("/d/a.npy", 0, 3),
        SourceFile("/d/broken.npy", None, 0, (2,), "float32", first_id=7, unreadable="truncated"),
        _piece("/d/sub/c.npy", 7, 5),
        _piece("/d/a.npy", 12, 2, first_row=3),  # rows appended to a.npy after the first run: ids after all others
    ]
    ids = np.array([0, 2, 3, 4, 6, 8, 11, 12, 13])  # 1, 5, 7, 9 and 10 rejected: no rows
    found = row_sources(pieces, ids, "/d")

    expected = []
    for sample_id in ids.tolist():
        (piece,) = [p for p in pieces if p.first_id <= sample_id < p.first_id + p.num_samples]
        expected.append((piece.path[len("/d/"):], sample_id - piece.first_id + piece.first_row))
    assert [(found.files[k], r) for k, r in zip(found.file.tolist(), found.row.tolist())] == expected
    assert found.files == ["a.npy", "b.npy", "sub/c.npy"]  # a file appended to is one entry; in id order
    assert found.file.dtype == found.row.dtype == np.int64


def test_an_id_no_file_holds_is_refused():
    with pytest.raises(OutputError, match=r"jacobians.h5: row 1 holds sample id 9, which no input file's ids hold"):
        row_sources([_piece("/d/a.npy", 0, 3), _piece("/d/b.npy", 3, 2)], np.array([1, 9]), "/d")


def test_the_input_root_is_what_the_patterns_fix_and_stays_when_files_come():
    day1 = ["/data/day1/x.npy", "/data/day1/y.npy"]
    assert input_root(["/data/*/*.npy"], day1) == "/data"  # not /data/day1: day2's files keep the keys
    assert input_root(["/data/*/*.npy"], [*day1, "/data/day2/z.npy"]) == "/data"
    assert input_root(["/data/train"], ["/data/train/cat/1.png", "/data/train/cat/2.png"]) == "/data/train"
    assert input_root(["/data/train/"], ["/data/train/cat/1.png"]) == "/data/train"
    assert input_root(["/data/one.npy"], ["/data/one.npy"]) == "/data"
    assert input_root(["/a/x/*.npy", "/a/y/z.npy"], ["/a/x/1.npy", "/a/y/z.npy"]) == "/a"
    assert input_root(["/x/*.npy", "/y/*.npy"], ["/x/1.npy", "/y/1.npy"]) == "/"
    assert input_root(["gs://bucket/imgs/**.png"], ["gs://bucket/imgs/a/1.png"]) == "gs://bucket/imgs"


# --- a run's view: each row's source is its sample ---------------------------------------------------


def test_rows_name_their_file_and_row_across_an_appended_file_and_rejected_samples(tmp_path):
    rng = np.random.default_rng(5)
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    arrays = {"a.npy": rng.normal(size=(6, 8, 8, 1)), "b.npy": rng.normal(size=(9, 8, 8, 1)),
              "sub/c.npy": rng.normal(size=(5, 8, 8, 1))}
    arrays["b.npy"][4, 2, 2, 0] = np.nan  # rejected under skip: no row
    for name, array in arrays.items():
        np.save(data / name, array.astype(np.float32))
    raw = job([str(data / "**.npy")], tmp_path / "out", on_bad_sample="skip")
    run(raw)
    grown = np.concatenate([arrays["a.npy"], rng.normal(size=(3, 8, 8, 1))])  # rows appended: ids after c.npy's
    np.save(data / "a.npy", grown.astype(np.float32))
    arrays["a.npy"] = grown
    manifest = run(raw)

    keys, root, ids = _sources(tmp_path / "out")
    assert root == str(data)
    assert ids.tolist() == [i for i in range(manifest["num_samples"]) if i != 10]  # id 10: b.npy row 4
    expected_keys = ([("a.npy", r) for r in range(6)] + [("b.npy", r) for r in range(9) if r != 4]
                     + [("sub/c.npy", r) for r in range(5)] + [("a.npy", r) for r in range(6, 9)])
    assert keys == expected_keys
    samples = np.stack([arrays[name][row] for name, row in keys]).astype(np.float32)
    with h5py.File(tmp_path / "out" / "jacobians.h5") as f:
        assert_close(f["jacobian"][:], tape_loop(test_models.small_cnn(), samples), rtol=1e-5)
        assert [name.decode() for name in f["source_files"][:]] == ["a.npy", "b.npy", "sub/c.npy"]
    assert manifest["datasets"]["source_file"] == manifest["datasets"]["source_row"] == {"shape": ["n"], "dtype": "int64"}
    assert verify(tmp_path / "out").ok


def test_verify_finds_a_row_whose_source_is_wrong(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("a.npy", 3), ("b.npy", 4)):
        np.save(data / name, np.random.default_rng(n).normal(size=(n, 8, 8, 1)).astype(np.float32))
    run(job([str(data / "*.npy")], tmp_path / "out"))
    with h5py.File(tmp_path / "out" / "jacobians.h5", "r+") as f:
        f["source_row"][5] = 0  # b.npy row 2 claims to be b.npy row 0
    report = verify(tmp_path / "out")
    assert report.problems == [
        "jacobians.h5: row 5 (sample 5) names b.npy row 0 as its source, its id comes from b.npy row 2 (1 row(s) differ)"
    ]


# --- joining two model versions' results by the key ---------------------------------------------------


def _docs_join_snippet() -> str:
    text = (ROOT / "docs" / "output.md").read_text()
    (snippet,) = [body for body in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S) if "def row_keys" in body]
    return snippet


def test_two_model_versions_join_row_by_row_by_their_keys(tmp_path, monkeypatch):
    """The issue's story: v1 computed; then a file is added (sorting first) and one removed, the model
    updated, and ``--overwrite`` renumbers every id. The join of docs/output.md pairs the rows of the same
    file and row, and each side is its model's Jacobian of that very sample."""
    rng = np.random.default_rng(3)
    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("b.npy", 4), ("c.npy", 3), ("d.npy", 5)):
        np.save(data / name, rng.normal(size=(n, 8, 8, 1)).astype(np.float32))
    out = tmp_path / "out" / "v2"
    run(job([str(data / "*.npy")], out))  # v1, written where the scheduled job writes
    shutil.copytree(out, tmp_path / "out" / "v1")  # kept: the view's sources are relative, the copy reads
    (data / "c.npy").unlink()
    np.save(data / "a.npy", rng.normal(size=(2, 8, 8, 1)).astype(np.float32))
    raw = job([str(data / "*.npy")], out, factory="tests.test_row_source:cnn_v2")
    runner.run(config.validate(raw), [], show_progress=False, overwrite=True)

    before, root, ids_before = _sources(tmp_path / "out" / "v1")
    after, _, ids_after = _sources(out)
    # Ids moved: b.npy row 0 was id 0, is id 2 now; a join by sample_id would pair other samples.
    assert ids_before[before.index(("b.npy", 0))] == 0 and ids_after[after.index(("b.npy", 0))] == 2

    monkeypatch.chdir(tmp_path)
    found: dict = {}
    exec(_docs_join_snippet(), found)  # the documented join, as written
    pairs = found["pairs"]
    joined = [before[row] for row in pairs[:, 0]]
    assert joined == [("b.npy", r) for r in range(4)] + [("d.npy", r) for r in range(5)]  # c gone, a new
    assert [after[row] for row in pairs[:, 1]] == joined
    samples = np.stack([_sample(root, key) for key in joined])
    assert_close(found["old"], tape_loop(test_models.small_cnn(), samples), rtol=1e-5)
    assert_close(found["new"], tape_loop(cnn_v2(), samples), rtol=1e-5)
    assert found["change"].shape == (len(joined),) and (found["change"] > 0).all()


# --- a pipeline of your own; the plot's titles ---------------------------------------------------------


def test_a_users_pipeline_has_one_source_whose_row_is_the_id(tmp_path):
    import apache_beam as beam
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.testing import test_pipeline

    from jacobeam.transforms import ComputeJacobians, EngineOptions, ModelSource, WriteShards, pipeline_spec

    model, shape = ModelSource(factory="tests.models:small_cnn"), (8, 8, 1)
    samples = np.random.default_rng(2).normal(size=(5, *shape)).astype(np.float32)
    spec = pipeline_spec(str(tmp_path / "out"), model, shape, EngineOptions(batch_size=4), samples_per_shard=4)
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as pipeline:
        _ = pipeline | beam.Create(list(enumerate(samples))) | ComputeJacobians(model, shape, EngineOptions()) | WriteShards(spec)
    keys, root, ids = _sources(tmp_path / "out")
    assert keys == [("(pipeline)", i) for i in ids.tolist()] and ids.tolist() == list(range(5)) and root == ""
    assert verify(tmp_path / "out").ok


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figures ``inspect --plot`` saves, as they were drawn."""
    import matplotlib.figure

    figures, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k)))
    return figures


def _plot_titles(out: Path, ids: str, drawn: list) -> list[str]:
    """The titles of the figure ``jacobeam inspect OUT --plot`` draws for ``--samples ids``."""
    from jacobeam.pipeline import cli

    assert cli.main(["inspect", str(out), "--plot", str(out.parent / "plot.png"), "--samples", ids]) == 0
    figure = drawn.pop()
    return [axis.get_title().replace("\n", " ") for axis in figure.axes]


def test_plot_titles_name_each_samples_file_and_row(tmp_path, drawn):
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("a.npy", 3), ("b.npy", 4)):
        np.save(data / name, np.random.default_rng(n).normal(size=(n, 8, 8, 1)).astype(np.float32))
    run(job([str(data / "*.npy")], tmp_path / "arrays"))
    titles = _plot_titles(tmp_path / "arrays", "1,5", drawn)
    assert "sample 1: input, a.npy row 1" in titles and "sample 5: input, b.npy row 2" in titles

    images = tmp_path / "images"
    for name in ("cat/001.png", "dog/002.png"):
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.random.default_rng(7).integers(0, 256, (8, 8), dtype=np.uint8), "L").save(images / name)
    run(job([str(images)], tmp_path / "pictures"))
    assert _sources(tmp_path / "pictures")[:2] == ([("cat/001.png", 0), ("dog/002.png", 0)], str(images))
    assert "sample 1: input, 002.png" in _plot_titles(tmp_path / "pictures", "1", drawn)
