"""The first hour of a new user: what ``inspect --plot``, ``inspect``, ``verify`` and ``run`` show is what
the output folder holds. Pictures are compared with the stored datasets, read here with h5py on their own."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, plot, runner
from jacobeam.pipeline.summary import run_summary

N = 6  # samples of each run

# name -> (factory, sample shape, jacobian config): one small real run each, made when a test first asks
RUNS = {
    "gray-none": ("tests.models:small_cnn", (8, 8, 1), {}),
    "gray-max": ("tests.models:small_cnn", (8, 8, 1), {"reduce": "max_abs_over_outputs"}),
    "gray-sum": ("tests.models:small_cnn", (8, 8, 1), {"reduce": "sum_abs_over_channels"}),
    "gray-top2": ("tests.models:small_cnn", (8, 8, 1), {"outputs": {"top_k": 2}}),
    "rgb-top2-sum": ("tests.first_hour_models:rgb_cnn", (5, 5, 3),
                     {"outputs": {"top_k": 2}, "reduce": "sum_abs_over_channels"}),
    "rgb-none": ("tests.first_hour_models:rgb_cnn", (5, 5, 3), {}),
    "rgb-max": ("tests.first_hour_models:rgb_cnn", (5, 5, 3), {"reduce": "max_abs_over_outputs"}),
    "rgb-sum": ("tests.first_hour_models:rgb_cnn", (5, 5, 3), {"reduce": "sum_abs_over_channels"}),
    "mlp-rows": ("tests.models:small_mlp", (12,), {"outputs": [4, 1]}),
    "frobenius": ("tests.models:square_softplus", (6,), {"reduce": "frobenius"}),
    "trace": ("tests.models:square_softplus", (6,), {"reduce": "trace"}),
    "slogdet": ("tests.models:square_softplus", (6,), {"reduce": "slogdet"}),
    "diagonal": ("tests.models:square_softplus", (6,), {"reduce": "diagonal"}),
    "vjp": ("tests.models:square_softplus", (6,), {"reduce": "vjp", "vectors": "VECTORS"}),
    "rgb-vjp": ("tests.first_hour_models:rgb_cnn", (5, 5, 3), {"reduce": "vjp", "vectors": "VECTORS3"}),
    "jvp": ("tests.models:square_softplus", (6,), {"reduce": "jvp", "vectors": "VECTORS"}),
    "project": ("tests.models:square_softplus", (6,), {"reduce": "project", "project": {"dim": 3}}),
    "basis": ("tests.models:square_softplus", (6,), {"reduce": "basis", "basis": {"input": "BASIS_IN", "output": "BASIS_OUT"}}),
}


def _make(root: Path, name: str) -> Path:
    factory, shape, jacobian = RUNS[name]
    data = root / f"{name}-data"
    data.mkdir()
    rng = np.random.default_rng(len(name))
    np.save(data / "x.npy", rng.normal(size=(N, *shape)).astype(np.float32))
    files = {"VECTORS": (2, 6), "VECTORS3": (2, 3), "BASIS_IN": (6, 3), "BASIS_OUT": (6, 2)}
    for key, size in files.items():
        np.save(data / f"{key}.npy", rng.normal(size=size))
    jacobian = json.loads(
        json.dumps(jacobian).replace('"VECTORS"', json.dumps(str(data / "VECTORS.npy")))
        .replace('"VECTORS3"', json.dumps(str(data / "VECTORS3.npy")))
        .replace('"BASIS_IN"', json.dumps(str(data / "BASIS_IN.npy")))
        .replace('"BASIS_OUT"', json.dumps(str(data / "BASIS_OUT.npy")))
    )
    out = root / name
    cfg = config.validate(
        {
            "model": {"factory": factory},
            "input": {"paths": [str(data / "x.npy")]},
            "jacobian": {"batch_size": 4, **jacobian},
            "output": {"path": str(out), "samples_per_shard": 4},
        }
    )
    runner.run(cfg, [], show_progress=False)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``folder(name)``: the output folder of run ``name`` of ``RUNS``, made once per module."""
    root = tmp_path_factory.mktemp("first-hour")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = _make(root, name)
        return made[name]

    return get


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figures ``inspect --plot`` saves, as they were drawn."""
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig

    def record(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return figures


def _plot(out: Path, tmp_path: Path, drawn: list, ids: str | None = None):
    picture = tmp_path / "plot.png"
    status = cli.main(["inspect", str(out), "--plot", str(picture), *(["--samples", ids] if ids else [])])
    assert status == 0
    assert picture.stat().st_size > 0
    (figure,) = drawn
    drawn.clear()
    assert_titles_fit(figure)
    return figure


def assert_titles_fit(figure) -> None:
    """Every title of ``figure`` (the figure's, each axis's) lies within the figure: none runs past its edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # laid out as saved
    renderer, edge = canvas.get_renderer(), figure.bbox
    for text in [figure._suptitle, *(axis.title for axis in figure.axes)]:
        if text is not None and text.get_text():
            extent = text.get_window_extent(renderer)
            assert edge.x0 - 1 <= extent.x0 and extent.x1 <= edge.x1 + 1, f"{text.get_text()!r} runs past the figure's edge"


def _maps(figure) -> dict[str, np.ndarray]:
    """Each drawn picture by its axis's title (wrapped into lines that fit its column: joined again)."""
    return {axis.get_title().replace("\n", " "): np.asarray(axis.images[0].get_array()) for axis in figure.axes if axis.images}


def _histograms(figure) -> dict[str, tuple[str, float, float, float]]:
    """Each histogram by its axis's title: (x label, samples counted, lowest left edge, highest right edge)."""
    found = {}
    for axis in figure.axes:
        bars = [patch for patch in axis.patches if patch.get_height() >= 0 and patch.get_width() > 0]
        if bars and not axis.images:
            lo = min(bar.get_x() for bar in bars)
            hi = max(bar.get_x() + bar.get_width() for bar in bars)
            found[axis.get_title()] = (axis.get_xlabel(), sum(bar.get_height() for bar in bars), lo, hi)
    return found


def _view(out: Path) -> dict[str, np.ndarray]:
    with h5py.File(out / "jacobians.h5") as view:
        names = []
        view.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
        return {name: view[name][()] for name in names}


def _one(maps: dict[str, np.ndarray], start: str) -> tuple[str, np.ndarray]:
    (found,) = [(title, array) for title, array in maps.items() if title.startswith(start)]
    return found


# --- 1. saliency pictures are the stored saliency -------------------------------------------------------


@pytest.mark.parametrize("name", ["gray-max", "rgb-max"])
def test_max_abs_saliency_is_drawn_as_stored(folder, tmp_path, drawn, name):
    out = folder(name)
    stored = _view(out)["saliency"].astype(np.float64)  # (n, H, W, C): max |J| over outputs
    assert stored.ndim == 4
    maps = _maps(_plot(out, tmp_path, drawn, "0,3,5"))
    for sample in (0, 3, 5):
        title, picture = _one(maps, f"sample {sample}: max |J| over outputs")
        np.testing.assert_allclose(picture, stored[sample].max(axis=-1), rtol=1e-6)  # the channel axis
        assert "summed" not in title and ("channels" in title) == (stored.shape[-1] > 1)
        _one(maps, f"sample {sample}: input")


@pytest.mark.parametrize("name", ["gray-sum", "rgb-sum"])
def test_sum_over_channels_saliency_is_drawn_as_stored(folder, tmp_path, drawn, name):
    out = folder(name)
    stored = _view(out)["saliency"].astype(np.float64)  # (n, outputs, H, W): |J| summed over channels
    assert stored.shape[1] == 3
    maps = _maps(_plot(out, tmp_path, drawn, "1,4"))
    for sample in (1, 4):
        title, picture = _one(maps, f"sample {sample}: |J| summed over channels")
        np.testing.assert_allclose(picture, stored[sample].sum(axis=0), rtol=1e-6)
        assert "3 outputs" in title


def test_a_vjp_of_images_is_drawn_as_one_map_per_vector(folder, tmp_path, drawn):
    out = folder("rgb-vjp")
    stored = np.abs(_view(out)["vjp"].astype(np.float64))  # (n, vectors, H, W, C): u_k^T J
    assert stored.shape[1:] == (2, 5, 5, 3)
    maps = _maps(_plot(out, tmp_path, drawn, "0,2"))
    for sample in (0, 2):
        for k in (0, 1):
            _, picture = _one(maps, f"sample {sample}: |u{k}^T J| (vector {k + 1} of 2), summed over the channels")
            np.testing.assert_allclose(picture, stored[sample, k].sum(axis=-1), rtol=1e-6)


@pytest.mark.parametrize("name", ["gray-none", "rgb-none", "gray-top2"])
def test_full_jacobian_saliency_is_drawn_as_stored(folder, tmp_path, drawn, name):
    out = folder(name)
    view = _view(out)
    jacobian = np.abs(view["jacobian"].astype(np.float64))  # (n, rows, H, W, C)
    maps = _maps(_plot(out, tmp_path, drawn, "2,5"))
    for sample in (2, 5):
        title, picture = _one(maps, f"sample {sample}: |J| summed over")
        np.testing.assert_allclose(picture, jacobian[sample].sum(axis=(0, 3)), rtol=1e-6)
        if "output_index" in view:  # the rows stored: this sample's two largest outputs
            assert f"output rows {view['output_index'][sample].tolist()}" in title
        else:
            assert "the 3 outputs" in title


@pytest.mark.parametrize("name", ["gray-top2", "rgb-top2-sum"])
def test_top_k_draws_a_map_of_each_class(folder, tmp_path, drawn, name):
    """Each of a sample's k classes gets its own map (the sum over them hides which pixels speak for which)."""
    out = folder(name)
    view = _view(out)
    index = view["output_index"]  # (n, 2): each sample's two largest outputs, largest first
    outputs = view["output"]
    np.testing.assert_array_equal(index, np.argsort(-outputs, axis=1, kind="stable")[:, :2])
    # per row: |J| over the pixels, summed over the channels (reduce: none) or as stored (summed over them)
    rows = (np.abs(view["jacobian"].astype(np.float64)).sum(axis=-1) if "jacobian" in view
            else view["saliency"].astype(np.float64))
    assert rows.shape[1] == 2
    maps = _maps(_plot(out, tmp_path, drawn, "1,4"))
    for sample in (1, 4):
        for rank in (0, 1):
            _, picture = _one(maps, f"sample {sample}: |J| of output {index[sample, rank]} (rank {rank + 1} of 2)")
            np.testing.assert_allclose(picture, rows[sample, rank], rtol=1e-6)
        assert not np.allclose(rows[sample, 0], rows[sample, 1])  # two classes, two different maps


# --- 2. every reduction draws what it holds -----------------------------------------------------------


@pytest.mark.parametrize(
    "name, dataset, label",
    [("frobenius", "frobenius", "Frobenius norm"), ("trace", "trace", "trace"), ("slogdet", "logabsdet", "log |det J|")],
)
def test_scalar_reductions_are_a_histogram_of_every_sample(folder, tmp_path, drawn, name, dataset, label):
    out = folder(name)
    values = _view(out)[dataset]
    histograms = _histograms(_plot(out, tmp_path, drawn))
    (title, (xlabel, counted, lo, hi)), = histograms.items()
    title = title.replace("\n", " ")
    assert label in xlabel and counted == N
    assert lo == pytest.approx(values.min()) and hi == pytest.approx(values.max())
    if name == "slogdet":
        assert f"{int((_view(out)['sign'] > 0).sum())} positive" in title


def test_diagonal_is_drawn_per_sample_and_its_trace_over_all(folder, tmp_path, drawn):
    out = folder("diagonal")
    diagonal = _view(out)["diagonal"]
    figure = _plot(out, tmp_path, drawn, "0,2")
    lines = {
        axis.get_title().replace("\n", " "): axis.lines[0].get_ydata() for axis in figure.axes if axis.lines and axis.get_title()
    }
    for sample in (0, 2):
        (ydata,) = [y for title, y in lines.items() if title.startswith(f"sample {sample}: diagonal of J")]
        np.testing.assert_allclose(ydata, diagonal[sample], rtol=1e-6)
    (xlabel, counted, lo, hi), = _histograms(figure).values()
    assert "trace" in xlabel and counted == N
    assert lo == pytest.approx(diagonal.sum(axis=1).min(), rel=1e-5)


@pytest.mark.parametrize(
    "name, dataset, title",
    [
        ("vjp", "vjp", "u^T J for 2 vectors"),
        ("jvp", "jvp", "J v for 2 vectors"),
        ("project", "projection", "J P"),
        ("basis", "basis_projection", "U^T J V"),
        ("mlp-rows", "jacobian", "Jacobian (output rows [4, 1]"),
    ],
)
def test_products_and_selected_rows_are_drawn_as_stored_matrices(folder, tmp_path, drawn, name, dataset, title):
    out = folder(name)
    stored = _view(out)[dataset].astype(np.float64)
    figure = _plot(out, tmp_path, drawn, "1,3")
    maps = _maps(figure)
    for sample in (1, 3):
        _, picture = _one(maps, f"sample {sample}: {title}")
        np.testing.assert_allclose(picture, stored[sample].reshape(len(picture), -1), rtol=1e-6)
    (xlabel, counted, _, _), = _histograms(figure).values()
    assert "Frobenius norm" in xlabel and counted == N


def test_every_reduction_is_tested_here():
    from jacobeam.transforms.engine.reductions import FULL, PRODUCTS

    covered = {jacobian.get("reduce", "none") for _, _, jacobian in RUNS.values()}
    assert covered == set(FULL) | set(PRODUCTS)


# --- 3. a folder of a user's own pipeline -------------------------------------------------------------


@pytest.fixture(scope="module")
def users_folder(tmp_path_factory):
    """A folder written by ``WriteShards(pipeline_spec(...))`` (see tests/test_beam_api.py)."""
    import apache_beam as beam
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    from jacobeam.transforms import ComputeJacobians, EngineOptions, ModelSource, WriteShards, pipeline_spec

    model, shape = ModelSource(factory="tests.models:small_cnn"), (8, 8, 1)
    samples = np.random.default_rng(3).normal(size=(10, *shape)).astype(np.float32)
    out = tmp_path_factory.mktemp("users") / "out"
    spec = pipeline_spec(str(out), model, shape, EngineOptions(batch_size=4), samples_per_shard=4)
    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        _ = (
            pipeline
            | beam.Create(list(enumerate(samples)))
            | ComputeJacobians(model, shape, EngineOptions(batch_size=4))
            | WriteShards(spec)
        )
    return out


def test_verify_checks_the_structure_of_a_users_pipeline_folder(users_folder, tmp_path, capsys):
    assert cli.main(["verify", str(users_folder)]) == 0  # --samples 8 by default
    printed = capsys.readouterr().out
    assert "verified" in printed and "3 checked against the manifest's checksums" in printed
    assert "ids         10 checked" in printed
    (note,) = [line for line in printed.splitlines() if line.startswith("  note:")]
    assert "pipeline of your own" in note and "no sample recomputed" in note

    copy = tmp_path / "out"
    shutil.copytree(users_folder, copy)
    shard = copy / "shards" / "shard-000000000004-000000000008.h5"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert cli.main(["verify", str(copy)]) == 1
    assert "shards/shard-000000000004-000000000008.h5: crc32c differs from the manifest's" in capsys.readouterr().out


def test_plot_of_a_users_pipeline_folder_draws_what_it_holds(users_folder, tmp_path, drawn, capsys):
    maps = _maps(_plot(users_folder, tmp_path, drawn, "0,9"))
    printed = capsys.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith("plot: note:")]
    assert len(notes) == 1 and "pipeline of your own" in notes[0], printed
    jacobian = np.abs(_view(users_folder)["jacobian"].astype(np.float64))
    for sample in (0, 9):
        _, picture = _one(maps, f"sample {sample}: |J| summed over")
        np.testing.assert_allclose(picture, jacobian[sample].sum(axis=(0, 3)), rtol=1e-6)
    assert not [title for title in maps if "input" in title.split(":")[-1]]


# --- 4. inspect and the end-of-run summary name what was stored ------------------------------------------


def test_inspect_names_every_dataset_of_a_reduced_folder(folder, capsys):
    out = folder("rgb-max")
    assert cli.main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    for name, shape in (("saliency", (N, 5, 5, 3)), ("output", (N, 3)), ("sample_id", (N,)), ("nonfinite", (N,))):
        assert re.search(rf"jacobians.h5:{name} +shape {re.escape(str(shape))}", printed), printed
    assert re.search(r"result +saliency \(6, 5, 5, 3\) float32: max \|J\| over outputs", printed), printed
    assert cli.main(["inspect", "--json", str(out)]) == 0
    assert set(json.loads(capsys.readouterr().out)["view"]) == {"saliency", "output", "sample_id", "nonfinite",
                                                                      "source_file", "source_row", "source_files"}


def test_inspect_into_a_reader_that_stopped_ends_without_a_traceback(folder, monkeypatch, capsys):
    """``jacobeam inspect out | head -1``: the pipe is closed while inspect still prints."""
    out = folder("rgb-max")  # written first: the run that makes it must not print into the closed pipe
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write raises BrokenPipeError
    with os.fdopen(write_end, "w") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        assert cli.main(["inspect", str(out)]) == cli.FAILED
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("name", ["rgb-max", "slogdet", "gray-top2"])
def test_the_read_it_snippet_reads_what_was_stored(folder, name):
    out = folder(name)
    manifest = json.loads((out / "manifest.json").read_text())
    summary = run_summary(runner.RunResult(manifest=manifest, metrics={}))
    snippet = textwrap.dedent(summary.split("read it:\n", 1)[1])
    read: dict = {}
    exec(snippet, read)  # the snippet as printed runs, and reads every dataset it names
    stored = set(_view(out)) - {"output", "sample_id", "nonfinite", "output_index"}
    named = set(re.findall(r"f\['([^']+)'\]", snippet))
    assert stored <= named and named <= set(_view(out)), snippet
    assert "jacobian" in named if name == "gray-top2" else "jacobian" not in named
    for line in snippet.splitlines():
        found = re.match(r"\s+(\w+) = f\['([^']+)'\]\[:8\] +# \(([\d, ]*)\)", line)
        if found:
            variable, dataset, shape = found.groups()
            assert read[variable].shape == tuple(int(d) for d in shape.replace(" ", "").split(",") if d), line


def test_a_title_keeps_a_number_with_the_word_before_it_and_fits_its_columns():
    from jacobeam.pipeline.plot import TITLE_CHARS, _wrapped

    title = "sample 1: input, part-000.npy row 12 of the 10 outputs over all 2,048 samples"
    for columns in (1, 2):
        lines = _wrapped(title, columns).split("\n")
        assert " ".join(lines) == title and all(len(line) <= TITLE_CHARS * columns for line in lines)
        assert not any(line.split()[0][0].isdigit() for line in lines[1:]), lines  # no line begins with a number
    assert _wrapped("first line\nsecond") == "first line\nsecond"  # its own breaks kept


def test_a_chosen_sample_whose_value_is_not_finite_is_said_not_drawn():
    """The histogram marks the chosen samples with dashed lines; one whose value is not finite has none, and
    the title says so rather than calling it dashed."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots()
    try:
        values = np.array([1.0, np.inf, 2.0, 3.0])
        plot._draw_histogram(axis, plot._Histogram(values, "norm", [1.0, float("inf")]), [0, 1])
        title = axis.get_title().replace("\n", " ")
        assert "dashed: sample(s) 0 " in title and "not finite, not drawn: sample(s) 1" in title, title
        assert "(1 non-finite left out)" in title and len(axis.lines) == 1
    finally:
        plt.close(figure)
