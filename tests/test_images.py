"""Folders of PNG/JPEG images as inputs: read many per slice, resized and converted, the same id and
bad-sample rules as array files, and Jacobians equal to a per-sample tape loop on the images decoded
independently, with Pillow."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from jacobeam.pipeline import cli, config
from jacobeam.pipeline.verify import verify
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs import images
from jacobeam.transforms.inputs.readers import assign_ids, describe, iter_slices, open_samples
from jacobeam.transforms.inputs.types import ImageOptions
from jacobeam.transforms.output.inputs_table import folder_inputs
from tests import models as test_models
from tests.reference import assert_close, tape_loop
from tests.test_more_inputs import cli_error, job, run, view


def write_images(folder: Path, names: list[str], size=(8, 8), mode="L", seed=0) -> dict[str, np.ndarray]:
    """PNG images (``names`` relative to ``folder``, sub-folders allowed); returns their pixels by path,
    as Pillow reads them back."""
    rng = np.random.default_rng(seed)
    pixels = {}
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = (size[0], size[1]) if mode == "L" else (size[0], size[1], 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
        with Image.open(path) as image:
            pixels[str(path)] = np.asarray(image)
    return pixels


def as_samples(pixels: dict[str, np.ndarray], scale=1 / 255, mean=0.0, std=1.0) -> np.ndarray:
    """Pillow's pixels as the documented transform makes them: (n, H, W, 1) in sorted path order."""
    stacked = np.stack([pixels[path] for path in sorted(pixels)]).astype(np.float32)[..., None]
    return (stacked * np.float32(scale) - np.float32(mean)) / np.float32(std)


IMAGES = ["b.png", "a.png", "sub/c.png", "sub/deeper/d.png", "z.png"]


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """A folder of grayscale PNGs (nested), given as a folder, normalised with mean and std."""
    root = tmp_path_factory.mktemp("images")
    pixels = write_images(root / "images", IMAGES)
    (root / "images" / "notes.txt").write_text("not an image")
    raw = job([str(root / "images")], root / "out", image={"scale": "1/255", "mean": 0.5, "std": [0.25]})
    return root, pixels, raw, run(raw)


def test_a_folder_of_png_images_end_to_end(image_run):
    root, pixels, _, manifest = image_run
    samples = as_samples(pixels, mean=0.5, std=0.25)
    stored = view(root / "out")
    assert_close(stored["jacobian"], tape_loop(test_models.small_cnn(), samples), rtol=1e-5)
    assert_close(stored["output"], test_models.small_cnn()(samples).numpy(), rtol=1e-5)
    # ids: sorted path order over the folder and its sub-folders; every image is one sample
    assert [(Path(f["path"]).relative_to(root / "images").as_posix(), f["first_id"]) for f in folder_inputs(root / "out")] == [
        ("a.png", 0),
        ("b.png", 1),
        ("sub/c.png", 2),
        ("sub/deeper/d.png", 3),
        ("z.png", 4),
    ]
    assert manifest["input_shape"] == [8, 8, 1]
    assert manifest["run_identity"]["input.image"]["std"] == [0.25]
    report = verify(root / "out", samples=5)
    assert report.ok, report.problems
    assert cli.main(["inspect", str(root / "out"), "--plot", str(root / "plot.png"), "--samples", "0,4"]) == 0
    with Image.open(root / "plot.png") as picture:  # each image and its saliency, by sample
        assert picture.size[0] == 640 and picture.size[1] >= 3 * 2 * 80


def test_more_images_are_an_incremental_run(image_run, tmp_path):
    root, pixels, raw, _ = image_run
    images, out = tmp_path / "images", tmp_path / "out"
    first = write_images(images, IMAGES)
    raw = {**raw, "input": {**raw["input"], "paths": [str(images)]}, "output": {**raw["output"], "path": str(out)}}
    run(raw)
    added = write_images(images, ["0.png", "sub/e.png"], seed=1)

    manifest = run(raw)

    assert [(s["start"], s["stop"], s["computed_in_this_run"]) for s in manifest["shards"]] == [
        (0, 5, False),
        (5, 7, True),
    ]
    samples = np.concatenate([as_samples(first, mean=0.5, std=0.25), as_samples(added, mean=0.5, std=0.25)])
    assert_close(view(out)["jacobian"], tape_loop(test_models.small_cnn(), samples), rtol=1e-5)


def test_images_are_resized_and_converted(tmp_path):
    write_images(tmp_path, ["a.png"], size=(10, 12), mode="L")
    with Image.open(tmp_path / "a.png") as image:
        gray = np.asarray(image).astype(np.float32)
        rgb = np.asarray(image.convert("RGB")).astype(np.float32)
    options = ImageOptions(size=(8, 8), channels=3, scale=2.0, mean=(1.0, 2.0, 3.0))

    source = describe(str(tmp_path / "a.png"), None, image=options)
    with open_samples(source) as rows:
        sample = rows.read(0, 1)[0]

    assert source.sample_shape == (8, 8, 3) and source.num_samples == 1
    np.testing.assert_array_equal(rgb, np.repeat(gray[..., None], 3, axis=-1))  # Pillow: gray to RGB
    expected = tf.image.resize(rgb, (8, 8), method="bilinear").numpy() * 2.0 - np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(sample, expected, rtol=1e-6, atol=1e-5)


def test_jpeg_images_decode_as_pillow_does(tmp_path):
    rng = np.random.default_rng(2)
    smooth = (np.add.outer(np.arange(8), np.arange(8)) * 12 + rng.integers(0, 4, (8, 8))).astype(np.uint8)
    Image.fromarray(smooth, "L").save(tmp_path / "a.jpg", quality=95)
    with Image.open(tmp_path / "a.jpg") as image:
        by_pillow = np.asarray(image).astype(np.float32)
    with open_samples(describe(str(tmp_path / "a.jpg"), None, image=ImageOptions(scale=1.0))) as rows:
        decoded = rows.read(0, 1)[0, ..., 0]
    assert np.abs(decoded - by_pillow).max() <= 2  # two JPEG decoders: equal up to IDCT rounding


@pytest.mark.parametrize("mode, suffix", [("L", ".png"), ("LA", ".png"), ("RGB", ".png"), ("RGBA", ".png"),
                                          ("P", ".png"), ("I;16", ".png"), ("L", ".jpg"), ("RGB", ".jpg")])
@pytest.mark.parametrize("channels", [None, 1, 3])
def test_images_decode_bit_for_bit_as_tensorflows_own_functions_do(tmp_path, mode, suffix, channels):
    """The raw ops the reader calls are what tf.io.decode_image and tf.io.decode_jpeg (accurate IDCT) run:
    the same values, bit for bit, whatever the mode and channels (folders computed before resume)."""
    rng = np.random.default_rng(3)
    if mode == "I;16":
        image = Image.fromarray(rng.integers(0, 65536, (9, 7), dtype=np.uint16))
    else:
        image = Image.fromarray(rng.integers(0, 256, (9, 7, 3), dtype=np.uint8), "RGB")
        image = image.convert(mode) if mode != "P" else image.convert("P", palette=Image.Palette.ADAPTIVE, colors=7)
    image.save(tmp_path / f"a{suffix}", **({"quality": 90} if suffix == ".jpg" else {}))
    data = (tmp_path / f"a{suffix}").read_bytes()
    if suffix == ".jpg":
        want = tf.io.decode_jpeg(data, channels=channels or 0, dct_method="INTEGER_ACCURATE")
    else:
        want = tf.io.decode_image(data, channels=channels or 0, dtype=tf.uint8, expand_animations=False)
    options = ImageOptions(channels=channels, scale=1 / 255)
    got = images.read_images([describe(str(tmp_path / f"a{suffix}"), None, image=options)])[0]
    np.testing.assert_array_equal(got, want.numpy().astype(np.float32) * np.float32(1 / 255))


def test_images_are_read_many_per_slice(tmp_path, monkeypatch):
    pixels = write_images(tmp_path, [f"{i:02d}.png" for i in range(10)])
    files = assign_ids([describe(path, None, image=ImageOptions(scale=1.0)) for path in pixels])
    calls = []
    real = images.read_images
    monkeypatch.setattr(images, "read_images", lambda sources: calls.append(len(sources)) or real(sources))

    slices = list(iter_slices(files, 1, 10, max_rows=4))

    assert calls == [4, 4, 1] and [ids.tolist() for ids, _, _ in slices] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    np.testing.assert_array_equal(np.concatenate([x for _, x, _ in slices]), as_samples(pixels, scale=1.0)[1:])


def test_images_of_different_sizes_need_a_size(tmp_path, capsys):
    write_images(tmp_path / "images", ["a.png", "b.png"])
    write_images(tmp_path / "images", ["c.png"], size=(8, 9))
    raw = job([str(tmp_path / "images" / "*.png")], tmp_path / "out")
    err = cli_error(raw, tmp_path, capsys)
    assert re.search(
        r"c.png: samples of shape \(8, 9, 1\); expected \(8, 8, 1\) \(the sample shape of .*a.png\)", err
    ), err
    raw["input"]["image"] = {"size": [8, 8]}
    assert run(raw)["num_samples"] == 3


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_an_undecodable_image_is_an_error_or_left_out(tmp_path, capsys, policy):
    pixels = write_images(tmp_path / "images", ["a.png", "c.png"])
    (tmp_path / "images" / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    raw = job([str(tmp_path / "images")], tmp_path / "out", on_bad_sample=policy)
    if policy == "error":
        err = cli_error(raw, tmp_path, capsys)
        assert re.search(r"^jacobeam: error: .*/images/b.png: cannot be decoded as an image", err, re.M), err
        assert not (tmp_path / "out").exists()
        return
    manifest = run(raw)
    lines = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["id"], Path(r["file"]).name, r["row"]) for r in lines] == [(None, "b.png", None)]
    assert lines[0]["reason"].startswith("corrupt: cannot be decoded as an image")
    assert manifest["num_samples"] == 2  # an image that cannot be decoded holds no sample, hence no id
    assert_close(view(tmp_path / "out")["jacobian"], tape_loop(test_models.small_cnn(), as_samples(pixels)), rtol=1e-5)


def test_a_folder_without_images_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.txt").write_text("")
    err = cli_error(job([str(tmp_path / "empty")], tmp_path / "out"), tmp_path, capsys)
    assert re.search(r"input.paths: '.*/empty' holds no PNG or JPEG images", err), err


@pytest.mark.parametrize(
    "image, message",
    [
        ({"scale": "1/0"}, r"input.image.scale: Value error, expected a number such as 0.5 or 1/255, got '1/0'"),
        ({"std": [1.0, 0.0]}, r"input.image.std: must be positive"),
        ({"channels": 3, "mean": [0.1, 0.2]}, r"input.image.mean: 2 values for 3 channel\(s\)"),
        ({"channels": 2}, r"input.image.channels: Input should be 1 or 3"),
        ({"size": [8]}, r"input.image.size"),
    ],
)
def test_image_settings_are_validated(image, message):
    with pytest.raises(config.ConfigError, match=message):
        config.validate(job(["x"], Path("out"), image=image))


def test_image_scale_may_be_written_as_a_fraction():
    cfg = config.validate(job(["x"], Path("out"), image={"scale": "1/255", "size": [4, 5], "mean": [0.1, 0.2, 0.3]}))
    assert cfg.input.image_options() == ImageOptions(size=(4, 5), channels=None, scale=1 / 255, mean=(0.1, 0.2, 0.3))
    with pytest.raises(
        InputError, match=r"a.png: an image is one sample; input.key \(x\) is for .npz, .h5 and TFRecord"
    ):
        describe("/nowhere/a.png", "x")
