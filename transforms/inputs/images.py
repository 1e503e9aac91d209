"""Images: PNG and JPEG files, one sample each.

A file is read whole through Beam's ``FileSystems`` (remote paths work the same as local ones) and
decoded by TensorFlow to 8-bit values ``(H, W, C)``, which become float32 as ``input.image``
(``ImageOptions``) says: resized, converted to a number of channels, scaled and normalized. Many
images are decoded at once, in threads. TensorFlow is imported only when an image is decoded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
from collections.abc import Sequence

import numpy as np

from jacobeam.transforms.errors import CorruptInputError, InputError, first_line
from jacobeam.transforms.inputs.types import ImageOptions, Key, Shape, SourceFile
from jacobeam.transforms.output import storage

SUFFIXES = {".png": "image", ".jpg": "image", ".jpeg": "image"}


def _decode_image(path: str, data: bytes, options: ImageOptions) -> np.ndarray:
    """An image file's bytes as one sample ``(H, W, C)`` float32 (see ``ImageOptions``)."""
    import tensorflow as tf

    channels = options.channels or 0
    try:
        if tf.io.is_jpeg(data):  # decode_image's JPEG default is the fast, less accurate IDCT
            pixels = tf.io.decode_jpeg(data, channels=channels, dct_method="INTEGER_ACCURATE")
        else:
            pixels = tf.io.decode_image(data, channels=channels, dtype=tf.uint8, expand_animations=False)
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        raise CorruptInputError(f"{path}: cannot be decoded as an image: {first_line(err)}",
                                reason=f"corrupt: cannot be decoded as an image: {first_line(err)}") from err
    values = tf.cast(pixels, tf.float32)
    if options.size is not None:
        values = tf.image.resize(values, options.size, method="bilinear")
    values = values.numpy() * np.float32(options.scale)
    if options.mean is not None:
        values -= np.asarray(options.mean, np.float32)
    if options.std is not None:
        values /= np.asarray(options.std, np.float32)
    return values


def _image_bytes(path: str) -> bytes:
    with storage.open_input(path) as stream:
        try:
            return stream.read()
        except OSError as err:
            raise CorruptInputError(f"{path}: cannot be read: {err}", reason=f"unreadable: {err}") from err


class Image:
    """An image file: one sample (row 0)."""

    def __init__(self, path: str, options: ImageOptions):
        self._path, self._options = path, options

    def read(self, start: int, stop: int) -> np.ndarray:
        return _decode_image(self._path, _image_bytes(self._path), self._options)[None][start:stop]


def open_samples(source: SourceFile) -> contextlib.AbstractContextManager[Image]:
    """An image file's one sample, decoded when read."""
    return contextlib.nullcontext(Image(source.path, source.image or ImageOptions()))


def describe(path: str, key: Key, sample_shape: Shape | None = None, image: ImageOptions | None = None) -> SourceFile:
    """An image is decoded (it is its only sample): its shape, and the sha256 of the file's bytes.
    ``sample_shape`` is not used (``readers.check_consistent`` compares it with the decoded shape)."""
    if key is not None:
        raise InputError(f"{path}: an image is one sample; input.key ({key}) is for .npz, .h5 and TFRecord files")
    options = image or ImageOptions()
    data = _image_bytes(path)
    sample = _decode_image(path, data, options)
    return SourceFile(
        path=path, key=None, num_samples=1, sample_shape=sample.shape, dtype="float32",
        data_sha256=hashlib.sha256(data).hexdigest(), image=options,
    )


def read_images(sources: Sequence[SourceFile]) -> np.ndarray:
    """Many image files at once, decoded in threads (decoding releases the GIL): ``(len(sources), H, W, C)``."""
    def one(source: SourceFile) -> np.ndarray:
        return _decode_image(source.path, _image_bytes(source.path), source.image or ImageOptions())

    with concurrent.futures.ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1, 8)) as pool:
        return np.stack(list(pool.map(one, sources)))
