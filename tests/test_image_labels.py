"""Labels for image folders (``jacobian.outputs: label``): each file's class subfolder, as Keras's
``image_dataset_from_directory(labels="inferred")`` numbers them, or its row of a CSV/JSON table. The stored
``output_index`` is the class index and the Jacobian row the per-sample tape's row of that class; a day's
new files are computed alone; a changed label computes its shard again; verify passes."""

import json
import logging
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, config, runner
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.errors import InputError, OutputError
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_images import as_samples, write_images
from tests.test_more_inputs import cli_error, job, run


def label_job(folder: Path, out: Path, labels: dict, **input_keys) -> dict:
    raw = job([str(folder)], out, **input_keys)
    raw["jacobian"].update(outputs="label", labels=labels)
    return raw


def stored(out: Path) -> dict[str, np.ndarray]:
    with h5py.File(out / "jacobians.h5") as h5:
        return {name: h5[name][:] for name in ("sample_id", "output_index", "jacobian")}


def check_rows(out: Path, pixels: dict[str, np.ndarray], classes: dict[str, int]) -> None:
    """Rows in id order (``pixels``' paths in that order): output_index the class index, the Jacobian the
    tape's row of that class."""
    paths = list(pixels)
    samples = np.concatenate([as_samples({path: pixels[path]}) for path in paths])
    want = np.array([classes[path] for path in paths])
    rows = stored(out)
    np.testing.assert_array_equal(rows["sample_id"], np.arange(len(paths)))
    np.testing.assert_array_equal(rows["output_index"], want[:, None])
    full = tape_loop(test_models.small_cnn(), samples)  # (n, 3, 8, 8, 1)
    assert_close(rows["jacobian"][:, 0], full[np.arange(len(paths)), want], rtol=1e-5)


def recorded_labels(out: Path) -> dict[str, int]:
    """Each input file's label (by name) as the folder's table of input files, inputs.h5, holds it."""
    with h5py.File(out / "inputs.h5") as h5:
        paths = [Path(path.decode()).name for path in h5["columns/path"][:]]
        return dict(zip(paths, h5["columns/label"][:].tolist(), strict=True))


# --- class subfolders ------------------------------------------------------------------------------------


def test_class_subfolders_label_saliency_and_a_day_of_new_files(tmp_path, capsys):
    images, out = tmp_path / "images", tmp_path / "out"
    first = write_images(images, ["dog/d1.png", "cat/c1.png", "cat/sub/c2.png", "dog/d2.png"])
    (images / "bird").mkdir()  # an empty class folder counts, as Keras lists classes: bird 0, cat 1, dog 2
    raw = label_job(images, out, {"folders": True})
    del raw["jacobian"]["batch_size"], raw["output"]["samples_per_shard"]  # label saliency at the defaults

    manifest = run(raw)

    assert manifest["labels"] == {"source": "folders", "class_names": ["bird", "cat", "dog"]}
    classes = {str(images / p): c for p, c in [("cat/c1.png", 1), ("cat/sub/c2.png", 1), ("dog/d1.png", 2),
                                                 ("dog/d2.png", 2)]}
    ordered = {path: first[path] for path in sorted(first)}
    check_rows(out, ordered, classes)
    assert recorded_labels(out) == {"c1.png": 1, "c2.png": 1, "d1.png": 2, "d2.png": 2}
    report = verify(out, samples=4)
    assert report.ok, report.problems
    assert cli.main(["inspect", str(out)]) == 0
    assert "listed in output_index); labels from folders: 0 bird, 1 cat, 2 dog\n" in capsys.readouterr().out

    day = write_images(images, ["bird/b1.png", "cat/c3.png"], seed=1)  # a day's files, in class folders
    manifest = run(raw)

    assert [(s["start"], s["stop"], s["computed_in_this_run"]) for s in manifest["shards"]] == [(0, 4, False), (4, 6, True)]
    classes.update({str(images / "bird/b1.png"): 0, str(images / "cat/c3.png"): 1})
    check_rows(out, {**ordered, **{path: day[path] for path in sorted(day)}}, classes)
    assert verify(out, samples=6).ok


def test_a_folder_whose_name_holds_a_bracket(tmp_path, monkeypatch):
    """``exp[1]``: given as a folder it matched no files (``[1]`` read as a glob's character class), a
    working directory so named failed every relative path, and an escaped glob (``exp[[]1]/*/*.png``) took
    ``exp[1]`` for the class of every image. Now each names its own folders, and the labels are the classes'."""
    experiment = tmp_path / "exp[1]"
    images = experiment / "train"
    pixels = write_images(images, ["cat/c1.png", "dog/d1.png"])
    classes = {str(images / "cat/c1.png"): 0, str(images / "dog/d1.png"): 1}
    for name, given in (("folder", str(images)), ("escaped", str(tmp_path / "exp[[]1]" / "train" / "*" / "*.png"))):
        raw = label_job(images, tmp_path / name, {"folders": True})
        raw["input"]["paths"] = [given]
        assert run(raw)["labels"]["class_names"] == ["cat", "dog"], name
        check_rows(tmp_path / name, {path: pixels[path] for path in sorted(pixels)}, classes)
    from jacobeam.pipeline.discover import list_inputs

    odd = images / "cat" / "c[2].png"  # a file so named, listed by its name: the glob "c[2].png" is c2.png's
    odd.write_bytes((images / "cat" / "c1.png").read_bytes())
    assert list(list_inputs([str(odd)])) == [str(odd)]
    odd.unlink()
    monkeypatch.chdir(experiment)  # relative paths, from a working directory whose name holds the bracket
    raw = label_job(images, tmp_path / "relative", {"folders": True})
    raw["input"]["paths"] = ["train/*/*.png"]
    assert run(raw)["labels"]["class_names"] == ["cat", "dog"]
    check_rows(tmp_path / "relative", {path: pixels[path] for path in sorted(pixels)}, classes)


def test_verify_derives_a_class_folder_s_label_again_from_the_file_s_path(tmp_path, monkeypatch):
    """A planner that numbered the classes wrongly (each folder's index shifted by one) stored every image
    with another class's row, consistently: the run's check and verify read the manifest's labels, and
    passed it. verify derives each file's label again, from its folder and the recorded class names."""
    from jacobeam.pipeline import labels

    images, out = tmp_path / "images", tmp_path / "out"
    write_images(images, ["cat/c1.png", "dog/d1.png", "frog/f1.png"])
    planned = labels._folder_labels

    def shifted(*args, **kwargs):
        by_path, names, differences = planned(*args, **kwargs)
        return {path: (label + 1) % len(names) for path, label in by_path.items()}, names, differences

    monkeypatch.setattr(labels, "_folder_labels", shifted)
    run(label_job(images, out, {"folders": True}))
    monkeypatch.undo()
    report = verify(out, samples=3)
    assert [p for p in report.problems if "recorded for" in p] == [
        f"sample {i} (shards/shard-000000000000-000000000003.h5 row {i}): label {(i + 1) % 3} recorded for "
        f"{images / name}/{name[0]}1.png, but its class folder {name!r} is class {i} of ['cat', 'dog', 'frog']"
        for i, name in enumerate(["cat", "dog", "frog"])
    ], report.problems
    assert len([p for p in report.problems if "differs from the reference" in p or "output_index" in p]) == 3


def test_a_new_class_folder_after_the_recorded_ones_is_added_one_among_them_is_refused(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, ["cat/c1.png", "dog/d1.png"])
    raw = label_job(images, out, {"folders": True})
    run(raw)
    pixels.update(write_images(images, ["emu/e1.png"], seed=1))  # sorts after cat and dog: index 2

    manifest = run(raw)

    assert manifest["labels"]["class_names"] == ["cat", "dog", "emu"]
    assert [s["computed_in_this_run"] for s in manifest["shards"]] == [False, True]
    check_rows(out, pixels, {str(images / "cat/c1.png"): 0, str(images / "dog/d1.png"): 1, str(images / "emu/e1.png"): 2})

    write_images(images, ["ant/a1.png"], seed=2)  # would be class 0: every index computed would change
    with pytest.raises(OutputError, match=r"new class folder\(s\) \['ant'\] sort among the classes recorded "
                                          r"\['cat', 'dog', 'emu'\]"):
        run(raw)

    # a model retrained on ant, cat and dog (emu gone): --overwrite numbers the classes afresh, sorted
    (images / "emu" / "e1.png").unlink()
    (images / "emu").rmdir()
    manifest = runner.run(config.validate(raw), [], show_progress=False, overwrite=True).manifest
    assert manifest["labels"]["class_names"] == ["ant", "cat", "dog"]
    np.testing.assert_array_equal(stored(out)["output_index"][:, 0], [0, 1, 2])


def test_fixed_class_names_and_files_outside_a_class_folder(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, ["dog/d1.png", "cat/c1.png"])
    manifest = run(label_job(images, out, {"folders": True, "class_names": ["horse", "dog", "cat"]}))
    assert manifest["labels"]["class_names"] == ["horse", "dog", "cat"]
    classes = {str(images / "cat/c1.png"): 2, str(images / "dog/d1.png"): 1}
    check_rows(out, {path: pixels[path] for path in sorted(pixels)}, classes)

    write_images(images, ["owl/o1.png"])
    with pytest.raises(InputError, match=r"o1.png: its class folder 'owl' is not among jacobian.labels.class_names"):
        run(label_job(images, tmp_path / "out2", {"folders": True, "class_names": ["horse", "dog", "cat"]}))
    write_images(images, ["loose.png"])
    with pytest.raises(InputError) as found:
        run(label_job(images, tmp_path / "out3", {"folders": True}))
    assert str(found.value).startswith(f"{images / 'loose.png'}: not in a class subfolder of {images}")
    assert "\n" not in str(found.value)


def test_hidden_files_and_folders_of_an_image_folder_are_not_inputs_nor_classes(tmp_path):
    """A folder copied from a Mac holds ``._name.jpg`` resource forks beside each image, and a notebook's folder
    ``.ipynb_checkpoints``: they stopped a run (``._d1.png``: neither a PNG nor a JPEG header) and made a class.
    Hidden names are left out, as Keras does for classes."""
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, ["dog/d1.png", "cat/c1.png"])
    (images / "dog" / "._d1.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble resource fork")
    write_images(images, [".ipynb_checkpoints/c1-checkpoint.png", "cat/.thumbs/c1.png"])
    manifest = run(label_job(images, out, {"folders": True}))
    assert manifest["labels"]["class_names"] == ["cat", "dog"]
    check_rows(out, {path: pixels[path] for path in sorted(pixels)},
               {str(images / "cat/c1.png"): 0, str(images / "dog/d1.png"): 1})
    # A glob's * matches hidden folders: the checkpoint was a class ".ipynb_checkpoints" that came first,
    # every label shifted by one, and nothing said so.
    (images / "dog" / "._d1.png").unlink()  # a glob's * matches it too: an image that cannot be decoded
    glob = label_job(images, tmp_path / "glob", {"folders": True})
    glob["input"]["paths"] = [str(images / "*" / "*.png")]
    with pytest.raises(InputError, match=r"c1-checkpoint.png: in the hidden folder '.ipynb_checkpoints' of .*images, "
                       r"which is no class"):
        run(glob)


def test_images_of_formats_not_read_in_a_folder_are_named_in_a_warning(tmp_path, caplog):
    """A folder with BMP or GIF images among its PNGs (Keras reads those too): they are left out, not silently."""
    from jacobeam.pipeline.discover import list_inputs

    images = tmp_path / "images"
    write_images(images, ["cat/c1.png"])
    (images / "dog").mkdir()
    for name in ("cat/c2.bmp", "dog/d1.gif", "dog/d2.GIF", "cat/.c3.bmp", "notes.txt"):
        (images / name).write_bytes(b"not read")
    with caplog.at_level(logging.WARNING, logger="jacobeam"):
        assert list(list_inputs([str(images)])) == [str(images / "cat/c1.png")]
    assert f"input.paths {str(images)!r}: 3 image(s) left out (1 .bmp, 2 .gif): jacobeam reads PNG and JPEG" in caplog.text
    caplog.clear()
    (images / "cat" / "c2.bmp").unlink()
    with caplog.at_level(logging.WARNING, logger="jacobeam"):
        list_inputs([str(images / "cat")])  # PNG images, and a hidden BMP: nothing to say
    assert "left out" not in caplog.text


def test_a_glob_takes_its_classes_under_its_part_before_the_wildcard(tmp_path):
    images = tmp_path / "images"
    pixels = write_images(images, ["a/x.png", "b/y.png", "b/z.png"])
    raw = job([str(images / "*" / "*.png")], tmp_path / "out")
    raw["jacobian"].update(outputs="label", labels={"folders": True})
    manifest = run(raw)
    assert manifest["labels"]["class_names"] == ["a", "b"]
    check_rows(tmp_path / "out", {p: pixels[p] for p in sorted(pixels)},
               {str(images / "a/x.png"): 0, str(images / "b/y.png"): 1, str(images / "b/z.png"): 1})


# --- a table of file to label ----------------------------------------------------------------------------


def write_csv(path: Path, rows: list[tuple[str, object]]) -> None:
    path.write_text("file,label\n" + "".join(f"{name},{label}\n" for name, label in rows))


def test_a_csv_table_labels_saliency_an_edited_label_and_a_day_of_new_files(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, [f"day1_{i}.png" for i in range(6)])
    table = images / "labels.csv"
    labels = {f"day1_{i}.png": i % 3 for i in range(6)}
    write_csv(table, sorted(labels.items()))
    raw = label_job(images, out, {"table": str(table)})
    del raw["jacobian"]["batch_size"]  # the defaults but for two shards: an edited label computes one again
    raw["output"]["samples_per_shard"] = 3

    manifest = run(raw)

    assert manifest["labels"] == {"source": "table", "table": str(table), "class_names": None}
    check_rows(out, pixels, {str(images / n): label for n, label in labels.items()})
    assert recorded_labels(out) == labels
    assert verify(out, samples=6).ok

    labels["day1_4.png"] = 0  # the table edited: its shard is computed again, the other kept
    write_csv(table, sorted(labels.items()))
    manifest = run(raw)
    assert [(s["start"], s["computed_in_this_run"]) for s in manifest["shards"]] == [(0, False), (3, True)]
    check_rows(out, pixels, {str(images / n): label for n, label in labels.items()})
    assert recorded_labels(out) == labels
    assert run(raw)["run"]["samples_computed"] == 0  # and the next run trusts it

    day = write_images(images, ["day2_0.png", "day2_1.png"], seed=3)
    labels.update({"day2_0.png": 2, "day2_1.png": 1})
    write_csv(table, sorted(labels.items()))
    manifest = run(raw)
    assert [(s["start"], s["computed_in_this_run"]) for s in manifest["shards"]] == [(0, False), (3, False), (6, True)]
    check_rows(out, {**pixels, **{p: day[p] for p in sorted(day)}}, {str(images / n): label for n, label in labels.items()})
    assert verify(out, samples=8).ok


def test_a_json_table_with_class_names(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, ["a.png", "b.png", "c.png"])
    (tmp_path / "labels.json").write_text(json.dumps({"images/a.png": "zebra", "images/b.png": "ant",
                                                      "images/c.png": "zebra", "images/other.png": "bee"}))
    manifest = run(label_job(images, out, {"table": str(tmp_path / "labels.json"), "class_names": ["ant", "bee", "zebra"]}))
    assert manifest["labels"]["class_names"] == ["ant", "bee", "zebra"]
    check_rows(out, pixels, {str(images / "a.png"): 2, str(images / "b.png"): 0, str(images / "c.png"): 2})


def test_table_errors_name_the_file(tmp_path):
    images = tmp_path / "images"
    write_images(images, ["a.png", "b.png"])
    table = images / "labels.csv"
    write_csv(table, [("a.png", 1)])
    with pytest.raises(InputError, match=rf"^{images / 'b.png'}: has no row in jacobian.labels.table {table}; "):
        run(label_job(images, tmp_path / "out", {"table": str(table)}))
    write_csv(table, [("a.png", 1), ("b.png", "cat")])
    with pytest.raises(InputError, match=r"labels.csv: line 3 \(b.png\): label 'cat' is not an integer output index"):
        run(label_job(images, tmp_path / "out", {"table": str(table)}))
    table.write_text("name,class\na.png,1\n")
    with pytest.raises(InputError, match=r"needs a header row naming the columns file and label"):
        run(label_job(images, tmp_path / "out", {"table": str(table)}))


def test_a_label_beyond_the_outputs_is_a_bad_sample(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, ["a.png", "b.png", "c.png"])
    write_csv(images / "labels.csv", [("a.png", 0), ("b.png", 3), ("c.png", 2)])  # the model has 3 outputs
    raw = label_job(images, out, {"table": str(images / "labels.csv")}, on_bad_sample="skip")
    manifest = run(raw)
    assert manifest["rejected"]["ids"] == [[1, 2]]
    with open(out / "rejected.jsonl") as lines:
        assert [json.loads(line)["reason"] for line in lines] == ["label 3 is not an output index 0..2"]
    rows = stored(out)
    np.testing.assert_array_equal(rows["sample_id"], [0, 2])
    np.testing.assert_array_equal(rows["output_index"][:, 0], [0, 2])
    paths = sorted(pixels)
    full = tape_loop(test_models.small_cnn(), as_samples({p: pixels[p] for p in (paths[0], paths[2])}))
    assert_close(rows["jacobian"][:, 0], full[[0, 1], [0, 2]], rtol=1e-5)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({}, "give one of key: <array>, folders: true or table: <file> (none is given)"),
        ({"key": "y", "table": "t.csv"}, "(key and table are given)"),
        ({"folders": True, "class_names": ["a", "a"]}, "class_names: each class once; ['a'] repeated"),
        ({"key": "y", "class_names": ["a"]}, "class_names is for folders: true or table: <file>"),
    ],
)
def test_label_settings_are_validated(labels, message):
    raw = label_job(Path("images"), Path("out"), labels)
    with pytest.raises(config.ConfigError) as found:
        config.validate(raw)
    assert message in str(found.value)


def test_labels_keep_the_identity_of_folders_written_with_a_key():
    """The keys added (folders, table, class_names) enter the config as written only where given."""
    raw = label_job(Path("data"), Path("out"), {"key": "y"})
    assert config.to_dict(config.validate(raw))["jacobian"]["labels"] == {"key": "y"}


def test_a_file_lost_leaves_with_its_rows_and_a_label_changed_beside_it_is_computed_again(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, [f"{c}/{i}.png" for c in ("cat", "dog") for i in range(3)])
    raw = label_job(images, out, {"folders": True})
    raw["output"]["samples_per_shard"] = 3
    run(raw)

    (images / "dog" / "0.png").unlink()  # from the second shard: its other rows are kept
    del pixels[str(images / "dog" / "0.png")]
    manifest = run(raw)

    rows = stored(out)
    np.testing.assert_array_equal(rows["sample_id"], [0, 1, 2, 4, 5])
    np.testing.assert_array_equal(rows["output_index"][:, 0], [0, 0, 0, 1, 1])
    assert manifest["run"]["samples_computed"] == 0
    assert verify(out, samples=5).ok

    # In the first shard, a file lost and another moved to another class folder (a new file there):
    # the shard is not copied with the old label; the moved file's rows come with its new class.
    (images / "cat" / "0.png").unlink()
    (images / "cat" / "1.png").rename(images / "dog" / "9.png")
    manifest = run(raw)
    rows = stored(out)
    np.testing.assert_array_equal(rows["sample_id"], [2, 4, 5, 6])
    np.testing.assert_array_equal(rows["output_index"][:, 0], [0, 1, 1, 1])
    order = ["cat/2.png", "dog/1.png", "dog/2.png", "cat/1.png"]  # cat/1.png is now dog/9.png, id 6
    samples = np.concatenate([as_samples({name: pixels[str(images / name)]}) for name in order])
    full = tape_loop(test_models.small_cnn(), samples)
    assert_close(rows["jacobian"][:, 0], full[np.arange(4), [0, 1, 1, 1]], rtol=1e-5)
    assert verify(out, samples=4).ok


def test_a_label_edited_beside_a_file_lost_is_not_copied_with_the_old_label(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, [f"{i}.png" for i in range(6)])
    table = images / "labels.csv"
    labels = {f"{i}.png": i % 2 for i in range(6)}
    write_csv(table, sorted(labels.items()))
    raw = label_job(images, out, {"table": str(table)})
    raw["output"]["samples_per_shard"] = 3
    run(raw)

    (images / "0.png").unlink()  # the first shard loses a file, and another of its files changes label
    labels["1.png"] = 2
    write_csv(table, sorted(labels.items()))
    run(raw)

    rows = stored(out)
    np.testing.assert_array_equal(rows["sample_id"], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(rows["output_index"][:, 0], [2, 0, 1, 0, 1])
    samples = np.concatenate([as_samples({str(images / f"{i}.png"): pixels[str(images / f"{i}.png")]}) for i in range(1, 6)])
    full = tape_loop(test_models.small_cnn(), samples)
    assert_close(rows["jacobian"][:, 0], full[np.arange(5), [2, 0, 1, 0, 1]], rtol=1e-5)
    assert verify(out, samples=5).ok


def test_an_interrupted_run_resumed_with_an_edited_label_computes_its_shard_again(tmp_path):
    """Without a manifest (a run stopped before its end) the shards' own ``input_labels`` tell."""
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, [f"{i}.png" for i in range(4)])
    table = images / "labels.csv"
    labels = {f"{i}.png": 1 for i in range(4)}
    write_csv(table, sorted(labels.items()))
    raw = label_job(images, out, {"table": str(table)})
    raw["output"]["samples_per_shard"] = 2
    run(raw)
    (out / "manifest.json").unlink()

    labels["3.png"] = 2
    write_csv(table, sorted(labels.items()))
    manifest = run(raw)

    assert [(s["start"], s["computed_in_this_run"]) for s in manifest["shards"]] == [(0, False), (2, True)]
    check_rows(out, pixels, {str(images / n): label for n, label in labels.items()})


def test_class_folders_with_a_saliency_reduction(tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    pixels = write_images(images, ["a/1.png", "b/2.png", "c/3.png"])
    raw = label_job(images, out, {"folders": True})
    raw["jacobian"]["reduce"] = "max_abs_over_outputs"
    run(raw)
    with h5py.File(out / "jacobians.h5") as h5:
        saliency, index = h5["saliency"][:], h5["output_index"][:]
    np.testing.assert_array_equal(index[:, 0], [0, 1, 2])
    full = tape_loop(test_models.small_cnn(), as_samples(pixels))
    assert_close(saliency, np.abs(full[np.arange(3), [0, 1, 2]]), rtol=1e-5)


def test_a_table_labels_array_files_each_sample_of_a_file_with_its_label(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    rng = np.random.default_rng(5)
    arrays = {"a.npy": rng.random((1, 8, 8, 1), np.float32), "b.npy": rng.random((2, 8, 8, 1), np.float32),
              "c.npy": rng.random((1, 8, 8, 1), np.float32)}
    for name, values in arrays.items():
        np.save(data / name, values)
    write_csv(data / "labels.csv", [("a.npy", 2), ("b.npy", 0), ("c.npy", 1)])
    raw = job([str(data / "*.npy")], out)
    raw["jacobian"].update(outputs="label", labels={"table": str(data / "labels.csv")})
    run(raw)
    rows = stored(out)
    want = [2, 0, 0, 1]  # both samples of b.npy take its label
    np.testing.assert_array_equal(rows["output_index"][:, 0], want)
    full = tape_loop(test_models.small_cnn(), np.concatenate(list(arrays.values())))
    assert_close(rows["jacobian"][:, 0], full[np.arange(4), want], rtol=1e-5)
    assert verify(out, samples=4).ok


def test_a_labels_key_on_images_points_to_labels_per_file(tmp_path):
    images = tmp_path / "images"
    write_images(images, ["cat/a.png"])
    with pytest.raises(InputError) as found:
        run(label_job(images, tmp_path / "out", {"key": "labels"}))
    assert str(found.value) == (
        f"{images / 'cat' / 'a.png'}: jacobian.labels.key 'labels': labels are not read from image files; labels need "
        "a named array beside the samples, in .npz or .h5 files, or give each file one label: jacobian.labels "
        "{folders: true} (its class subfolder) or {table: <.csv or .json of file to label>}"
    )


def test_the_command_line_names_a_file_outside_the_class_folders_in_one_line(tmp_path, capsys):
    images = tmp_path / "images"
    write_images(images, ["cat/a.png", "stray.png"])
    err = cli_error(label_job(images, tmp_path / "out", {"folders": True}), tmp_path, capsys)
    assert err == (
        f"jacobeam: error: {images / 'stray.png'}: not in a class subfolder of {images} (jacobian.labels.folders: each "
        "file's label is the subfolder that holds it); move it into one, or out of the input folder\n"
    )
    assert not (tmp_path / "out").exists()
