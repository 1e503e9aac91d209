"""A model with several named inputs through ``jacobeam run``: one array per input from each file
(``input.key: {input name: array}``), ``jacobian/<input>`` datasets, checked against a per-sample
float64 tape loop; the errors for inputs that do not fit; incremental runs, skip, inspect, verify, plot."""

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.summary import run_summary
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs.checks import RangeFindings, checked_slices
from jacobeam.transforms.inputs.readers import assign_ids, describe, iter_slices, manifest_sources, open_samples
from jacobeam.transforms.output.inputs_table import folder_inputs, with_inputs
from tests import models as test_models
from tests.reference import assert_close, tape_loop_inputs
from tests.test_pipeline import folder_state

SIZES = {"b": 13, "a": 7, "c": 20}  # written out of order: ids follow sorted path order
KEY = {"image": "pixels", "meta": "side/info"}  # input name -> array (an .h5 dataset path may nest)


def write_files(folder: Path, suffix: str, sizes=SIZES, seed=0) -> dict[str, np.ndarray]:
    """Files holding an image array (n, 4, 4, 1) and a meta array (n, 3); returns the samples in id
    order, by input name."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for name, n in sizes.items():
        arrays = {"image": rng.normal(size=(n, 4, 4, 1)).astype(np.float32), "meta": rng.normal(size=(n, 3))}
        _save(folder / f"{name}{suffix}", {KEY[k]: v for k, v in arrays.items()})
        written[name] = arrays
    order = sorted(written)
    return {k: np.concatenate([written[name][k] for name in order]) for k in ("image", "meta")}


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    if path.suffix == ".npz":
        np.savez(path, **{key.replace("/", "_"): value for key, value in arrays.items()})
    else:
        with h5py.File(path, "w") as h5:
            for key, value in arrays.items():
                h5[key] = value


def _key(suffix: str) -> dict[str, str]:
    return {name: array.replace("/", "_") for name, array in KEY.items()} if suffix == ".npz" else KEY


def job(data: Path, out: Path, suffix=".npz", **jacobian) -> dict:
    return {
        "model": {"factory": "tests.models:two_inputs"},
        "input": {"paths": [str(data / f"*{suffix}")], "key": _key(suffix)},
        "jacobian": {"batch_size": 8, **jacobian},
        "output": {"path": str(out), "samples_per_shard": 16},
    }


def run(raw: dict) -> dict:
    return runner.run(config.validate(raw), [], show_progress=False).manifest


def reference(samples: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return tape_loop_inputs(test_models.two_inputs("float64"), samples)


@pytest.fixture(scope="module")
def npz_run(tmp_path_factory):
    """One run through the command line (YAML config) over three .npz files; tests must not modify it."""
    root = tmp_path_factory.mktemp("two")
    samples = write_files(root / "data", ".npz")
    cfg = root / "job.yaml"
    cfg.write_text(yaml.safe_dump(job(root / "data", root / "out")))
    assert cli.main(["-q", "run", str(cfg)]) == 0
    return root, samples, json.loads((root / "out" / "manifest.json").read_text())


# --- readers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_slices_are_dicts_of_each_inputs_rows(tmp_path, suffix):
    samples = write_files(tmp_path, suffix, sizes={"a": 5, "b": 6})
    files = assign_ids([describe(str(tmp_path / f"{name}{suffix}"), _key(suffix)) for name in ("b", "a")])
    assert files[0].sample_shape == {"image": (4, 4, 1), "meta": (3,)}
    assert files[0].dtype == {"image": "float32", "meta": "float64"} and files[0].num_samples == 5

    slices = list(iter_slices(files, 2, 9, max_rows=2))

    assert [ids.tolist() for ids, _, _ in slices] == [[2, 3], [4], [5, 6], [7, 8]]
    for name in ("image", "meta"):
        np.testing.assert_array_equal(np.concatenate([x[name] for _, x, _ in slices]), samples[name][2:9])


def test_checked_reading_of_several_inputs_names_the_input_and_hashes_independently_of_slicing(tmp_path):
    image = np.zeros((6, 4, 4, 1), np.float32)
    meta = np.ones((6, 3))
    meta[2, 1], image[2, 0, 0, 0], image[4, 1, 1, 0] = np.nan, np.inf, np.nan
    _save(tmp_path / "a.npz", {"pixels": image, "side_info": meta})
    files = assign_ids([describe(str(tmp_path / "a.npz"), _key(".npz"))])

    def read(source_files, max_rows):
        findings = RangeFindings(source_files)
        kept = [ids for ids, _, _ in checked_slices(source_files, 0, 6, max_rows, findings)]
        return np.concatenate(kept).tolist(), findings

    found = [read(files, rows) for rows in (1, 2, 100)]

    assert len({findings.digest.hexdigest() for _, findings in found}) == 1
    assert {tuple(ids) for ids, _ in found} == {(0, 1, 3, 5)}
    assert [(r.row, r.stop, r.reason) for r in found[0][1].rejected] == [
        (2, 3, "non-finite input image: holds Inf; non-finite input meta: holds NaN"),
        (4, 5, "non-finite input image: holds NaN"),
    ]
    single = read(assign_ids([describe(str(tmp_path / "a.npz"), "pixels")]), 100)[1]
    assert single.digest.hexdigest() != found[0][1].digest.hexdigest()  # one input's bytes are not both inputs'


@pytest.mark.parametrize(
    "arrays, key, message",
    [
        ({"pixels": np.zeros((5, 4, 4, 1)), "side_info": np.zeros((4, 3))}, None,
         r"a.npz: array 'side_info' \(input meta\) has 4 rows, array 'pixels' \(input image\) has 5; every input "
         r"needs one row per sample"),
        ({"pixels": np.zeros((5, 4, 4, 1))}, None, r"a.npz: no array 'side_info' \(input.key.meta\); found \['pixels'\]"),
        ({"pixels": np.zeros((5, 4, 4, 1)), "side_info": np.zeros(5)}, None,
         r"a.npz: array 'side_info' \(input.key.meta\): array of shape \(5,\); expected samples along the first axis"),
        ({"pixels": np.zeros((5, 4, 4, 1), np.int32), "side_info": np.zeros((5, 3))}, None,
         r"a.npz: array 'pixels' \(input.key.image\): dtype int32; expected a float array"),
    ],
)
def test_arrays_that_do_not_fit_together_are_errors_naming_file_and_keys(tmp_path, arrays, key, message):
    np.savez(tmp_path / "a.npz", **arrays)
    with pytest.raises(InputError, match=message):
        describe(str(tmp_path / "a.npz"), key or _key(".npz"))


def test_a_npy_file_holds_one_array_and_cannot_feed_several_inputs(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((3, 4)))
    with pytest.raises(InputError, match=r"a.npy: a .npy file holds one array, but input.key.image, input.key.meta "
                                         r"name one array per input; keep several inputs in .npz or .h5 files"):
        describe(str(tmp_path / "a.npy"), _key(".npz"))


# --- end to end ---------------------------------------------------------------------------------------


def test_two_inputs_from_npz_equal_the_reference(npz_run):
    root, samples, manifest = npz_run
    expected = reference(samples)
    with h5py.File(root / "out" / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], np.arange(40))
        assert view["jacobian/image"].shape == (40, 5, 4, 4, 1) and view["jacobian/meta"].shape == (40, 5, 3)
        assert_close(view["jacobian/image"][:], expected["image"], rtol=1e-5)
        assert_close(view["jacobian/meta"][:], expected["meta"], rtol=1e-5)
        model = test_models.two_inputs("float64")
        assert_close(view["output"][:], model([samples["image"], samples["meta"]]).numpy(), rtol=1e-5)
    assert manifest["input_shape"] == {"image": [4, 4, 1], "meta": [3]}
    assert set(manifest["datasets"]) == {"jacobian/image", "jacobian/meta", "output", "sample_id", "nonfinite",
                                         "source_file", "source_row"}
    assert folder_inputs(manifest["output_dir"])[0]["key"] == _key(".npz")
    assert folder_inputs(manifest["output_dir"])[0]["dtype"] == {"image": "float32", "meta": "float64"}
    with h5py.File(root / "out" / manifest["shards"][1]["file"]) as shard:
        assert json.loads(shard.attrs["input_shape"]) == {"image": [4, 4, 1], "meta": [3]}
        assert shard["jacobian/meta"].shape == (16, 5, 3)


def test_inspect_verify_and_plot_read_several_inputs(npz_run, tmp_path, capsys):
    from PIL import Image

    root, _, manifest = npz_run
    summary = run_summary(runner.RunResult(manifest=manifest, metrics={}))  # what `jacobeam run` prints
    assert "jacobian/image (n, 5, 4, 4, 1)" in summary and "f['jacobian/image'][:8]" in summary
    assert cli.main(["inspect", str(root / "out")]) == 0
    printed = capsys.readouterr().out
    assert "inputs image (4, 4, 1), meta (3,) -> output (5,)" in printed
    assert re.search(r"jacobians.h5:jacobian/image +shape \(40, 5, 4, 4, 1\) float32", printed), printed

    report = verify(root / "out", samples=5)
    assert report.ok, report.problems
    # Both inputs' Jacobians recomputed for each of the 5 samples, against a float64 copy of the model.
    assert {name: d["samples"] for name, d in report.checked.items() if name.startswith("jacobian/")} == {
        "jacobian/image": 5, "jacobian/meta": 5
    }, report.checked
    assert max(d["max_error"] for d in report.checked.values()) < 1e-5 and "float64" in report.method, report.as_dict()

    picture = tmp_path / "plot.png"
    assert cli.main(["inspect", str(root / "out"), "--plot", str(picture), "--samples", "0,39"]) == 0
    with Image.open(picture) as image:
        assert image.format == "PNG" and image.size[0] == 640 and image.size[1] >= 3 * 2 * 80


def test_verify_catches_a_wrong_value_in_one_inputs_jacobian(npz_run, tmp_path):
    import shutil

    root, _, manifest = npz_run
    copy = tmp_path / "out"
    shutil.copytree(root / "out", copy)
    with h5py.File(copy / manifest["shards"][0]["file"], "r+") as h5:
        h5["jacobian/meta"][3] = h5["jacobian/meta"][3] * 1.01  # a 1% error in one sample's Jacobian by meta
    report = verify(copy, samples=40)
    assert not report.ok
    assert any(re.match(r"sample 3 \(shards/shard-000000000000-000000000016.h5 row 3\): jacobian/meta differs from the "
                        r"reference \(.*\) by max relative error 0.01, bound 0.0001", p)
               for p in report.problems), report.problems
    assert not any("jacobian/image" in p for p in report.problems)  # the other input's Jacobian is right


def test_two_inputs_from_h5_with_wrt_a_subset(tmp_path):
    samples = write_files(tmp_path / "data", ".h5")
    manifest = run(job(tmp_path / "data", tmp_path / "out", ".h5", wrt=["meta"]))
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        assert "jacobian/image" not in view
        assert_close(view["jacobian/meta"][:], reference(samples)["meta"], rtol=1e-5)
    assert folder_inputs(manifest["output_dir"])[0]["key"] == KEY
    assert verify(tmp_path / "out", samples=3).ok


def test_incremental_run_with_several_inputs_computes_only_new_files(npz_run, tmp_path):
    _, samples, _ = npz_run
    data, out = tmp_path / "data", tmp_path / "out"
    write_files(data, ".npz")
    first = run(job(data, out))
    new = write_files(data, ".npz", sizes={"0new": 9}, seed=1)  # sorts first, yet comes after the old ids

    second = run(job(data, out))

    assert [(s["start"], s["stop"], s["computed_in_this_run"]) for s in second["shards"]] == [
        (0, 16, False), (16, 32, False), (32, 40, False), (40, 49, True)
    ]
    assert [s["crc32c"] for s in second["shards"][:3]] == [s["crc32c"] for s in first["shards"]]
    everything = {k: np.concatenate([samples[k], new[k]]) for k in samples}
    with h5py.File(out / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], np.arange(49))
        assert_close(view["jacobian/image"][:], reference(everything)["image"], rtol=1e-5)
    assert run(job(data, out))["run"]["samples_computed"] == 0


def test_skip_leaves_out_a_sample_bad_in_one_input(tmp_path):
    data = tmp_path / "data"
    samples = write_files(data, ".npz", sizes={"a": 7})
    samples["meta"][4, 2] = np.nan
    _save(data / "a.npz", {KEY[k]: v for k, v in samples.items()})
    raw = job(data, tmp_path / "out")
    raw["input"]["on_bad_sample"] = "skip"

    manifest = run(raw)

    lines = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["id"], r["row"], r["reason"]) for r in lines] == [(4, 4, "non-finite input meta: holds NaN")]
    assert manifest["num_rows"] == 6
    kept = [0, 1, 2, 3, 5, 6]
    with h5py.File(tmp_path / "out" / "jacobians.h5") as view:
        np.testing.assert_array_equal(view["sample_id"][:], kept)
        assert_close(view["jacobian/meta"][:], reference({k: v[kept] for k, v in samples.items()})["meta"], rtol=1e-5)


def _bad_cases(root: Path) -> dict[str, tuple[list[str], str]]:
    rows = root / "rows"
    rows.mkdir()
    _save(rows / "a.npz", {"pixels": np.zeros((5, 4, 4, 1)), "side_info": np.zeros((4, 3))})
    shapes = root / "shapes"
    write_files(shapes, ".npz", sizes={"a": 3})
    _save(shapes / "b.npz", {"pixels": np.zeros((2, 4, 4, 1)), "side_info": np.zeros((2, 4))})
    npy = root / "npy"
    npy.mkdir()
    np.save(npy / "a.npy", np.zeros((3, 3)))
    return {
        "row counts": ([f"input.paths=['{rows}/*.npz']"],
                       r"a.npz: array 'side_info' \(input meta\) has 4 rows, array 'pixels' \(input image\) has 5"),
        "missing key": (["input.key.meta=nope"], r"a.npz: no array 'nope' \(input.key.meta\); found \['pixels', 'side_info'\]"),
        "shape differs": ([f"input.paths=['{shapes}/*.npz']"],
                          r"b.npz: input meta \('side_info'\) has samples of shape \(4,\); expected \(3,\) "
                          r"\(input meta in .*a.npz\)"),
        "npy": ([f"input.paths=['{npy}/*.npy']"], r"a.npy: a .npy file holds one array"),
        "names differ": (["input.key={image: pixels, extra: side_info}"],
                         r"factory:tests.models:two_inputs takes inputs \['image', 'meta'\]; input.key names inputs "
                         r"\['extra', 'image'\]: they must be the same names"),
        "one array": (["input.key=pixels"], r"takes inputs \['image', 'meta'\]; the inputs hold one array per sample, "
                                            r"of shape \(4, 4, 1\) .*set input.key to a mapping"),
        "one input": (["model.factory=tests.models:small_mlp"],
                      r"small_mlp takes one input; input.key maps inputs \['image', 'meta'\] to arrays"),
        "wrt": (["jacobian.wrt=[pixels]"], r"jacobian.wrt: \['pixels'\] not among the inputs that input.key names"),
        "reduce": (["jacobian.reduce=frobenius"], r"jacobian.reduce: frobenius is for one-input models"),
        "aggregate": (["jacobian.aggregate=[mean]"], r"jacobian.aggregate: aggregates are for one-input models; "
                                                     r"input.key names inputs \['image', 'meta'\]"),
        "bad mapping": (["input.key={image: 3}"], r"input.key: input 'image': expected the name of an array, got 3"),
    }


@pytest.mark.parametrize("case", ["row counts", "missing key", "shape differs", "npy", "names differ", "one array",
                                  "one input", "wrt", "reduce", "aggregate", "bad mapping"])
def test_inputs_that_do_not_fit_the_model_are_clear_errors_and_nothing_is_written(npz_run, tmp_path, capsys, case):
    root, _, _ = npz_run
    out = tmp_path / "out"
    out.mkdir()
    before = folder_state(out)
    overrides, message = _bad_cases(tmp_path)[case]
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job(root / "data", out)))

    status = cli.main(["-q", "run", str(cfg), *[arg for o in overrides for arg in ("--set", o)]])

    err = capsys.readouterr().err
    assert status == (cli.USAGE if case in ("wrt", "reduce", "aggregate", "bad mapping") else cli.FAILED), err  # config or files
    assert err.startswith("jacobeam: error:") and re.search(message, err), err
    assert folder_state(out) == before


def test_open_samples_reads_one_row_as_verify_does(npz_run):
    root, samples, manifest = npz_run
    source = manifest_sources(with_inputs(str(root / "out"), manifest))[1]  # b.npz: ids 7..20
    with open_samples(source) as rows:
        row = rows.read(3, 4)
    np.testing.assert_array_equal(row["meta"], samples["meta"][10:11])


def test_a_users_pipeline_writes_several_inputs_jacobians(tmp_path):
    import apache_beam as beam
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    from jacobeam.transforms import ComputeJacobians, EngineOptions, ModelSource, WriteShards, pipeline_spec

    rng = np.random.default_rng(9)
    samples = {"image": rng.normal(size=(10, 4, 4, 1)).astype(np.float32), "meta": rng.normal(size=(10, 3)).astype(np.float32)}
    model, options = ModelSource(factory="tests.models:two_inputs"), EngineOptions(batch_size=4)
    shapes = {"image": (4, 4, 1), "meta": (3,)}
    out = tmp_path / "out"
    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        _ = (
            pipeline
            | beam.Create([(i, {k: v[i] for k, v in samples.items()}) for i in range(10)])
            | ComputeJacobians(model, shapes, options)
            | WriteShards(pipeline_spec(str(out), model, shapes, options, samples_per_shard=4))
        )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input_shape"] == {"image": [4, 4, 1], "meta": [3]}
    expected = reference(samples)
    with h5py.File(out / "jacobians.h5") as view:
        assert_close(view["jacobian/image"][:], expected["image"], rtol=1e-5)
        assert_close(view["jacobian/meta"][:], expected["meta"], rtol=1e-5)
