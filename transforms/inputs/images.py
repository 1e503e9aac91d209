"""Images: PNG and JPEG files, one sample each.

A file is read whole through Beam's ``FileSystems`` (remote paths work the same as local ones) and
decoded by TensorFlow to 8-bit values ``(H, W, C)``, which become float32 as ``input.image``
(``ImageOptions``) says: resized, converted to a number of channels, scaled and normalized. Many
images are decoded at once, in threads. TensorFlow is imported only when an image is decoded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jacobeam.transforms.output import storage
from jacobeam.transforms.errors import CorruptInputError, InputError, first_line

if TYPE_CHECKING:
    from jacobeam.transforms.inputs.readers import Key, SourceFile


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """How an image file becomes a sample (``input.image``): decoded to 8-bit values ``(H, W, C)``,
    resized (bilinear) to ``size`` if given, converted to ``channels`` if given, then ``x * scale`` and
    ``(x - mean) / std`` (numbers, or one per channel)."""

    size: tuple[int, int] | None = None
    channels: int | None = None
    scale: float = 1 / 255
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def from_config(cls, image: Mapping[str, Any] | None) -> ImageOptions:
        """From ``input.image`` as plain data (the config, or a manifest's copy of it)."""
        image = dict(image or {})

        def numbers(value: Any) -> tuple[float, ...] | None:
            return None if value is None else tuple(float(v) for v in (value if isinstance(value, list) else [value]))

        size = image.get("size")
        return cls(
            size=None if size is None else (int(size[0]), int(size[1])),
            channels=image.get("channels"),
            scale=float(image.get("scale", 1 / 255)),
            mean=numbers(image.get("mean")),
            std=numbers(image.get("std")),
        )


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


def describe(path: str, key: Key, options: ImageOptions) -> tuple[tuple[int, ...], str]:
    """The shape of an image's sample, decoded, and the sha256 of the file's bytes."""
    if key is not None:
        raise InputError(f"{path}: an image is one sample; input.key ({key}) is for .npz, .h5 and TFRecord files")
    data = _image_bytes(path)
    sample = _decode_image(path, data, options)
    return sample.shape, hashlib.sha256(data).hexdigest()


def read_images(sources: Sequence[SourceFile]) -> np.ndarray:
    """Many image files at once, decoded in threads (decoding releases the GIL): ``(len(sources), H, W, C)``."""
    def one(source: SourceFile) -> np.ndarray:
        return _decode_image(source.path, _image_bytes(source.path), source.image or ImageOptions())

    with concurrent.futures.ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1, 8)) as pool:
        return np.stack(list(pool.map(one, sources)))
