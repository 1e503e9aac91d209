"""Images: PNG and JPEG files, one sample each.

Describing an image reads its header only (``image_header``: PNG chunks up to the pixel data, JPEG
segments up to the frame header), or nothing where ``input.image`` gives both ``size`` and ``channels``.
Reading it reads the file whole through Beam's ``FileSystems`` (remote paths work the same as local
ones) and decodes it with TensorFlow to 8-bit values ``(H, W, C)``, which become float32 as
``input.image`` (``ImageOptions``) says: resized, converted to a number of channels, scaled and
normalized. TensorFlow is imported only when an image is decoded.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Sequence
from typing import IO

import numpy as np

from jacobeam.transforms.errors import CorruptInputError, InputError, first_line
from jacobeam.transforms.inputs.types import ImageOptions, Key, Shape, SourceFile
from jacobeam.transforms.output import storage

SUFFIXES = {".png": "image", ".jpg": "image", ".jpeg": "image"}
_JPEG = b"\xff\xd8\xff"  # how a JPEG file begins (the test of tf.io.is_jpeg)


def _decode_image(path: str, data: bytes, options: ImageOptions, contents=None) -> np.ndarray:
    """An image file's bytes as one sample ``(H, W, C)`` float32 (see ``ImageOptions``). ``contents``: the
    same bytes as a scalar string tensor, where the caller made one (``read_images``)."""
    import tensorflow as tf

    channels = options.channels or 0
    contents = data if contents is None else contents
    # One TensorFlow op per image, the raw op: tf.io.decode_image's wrapper (a name scope, checks) costs as
    # much as decoding a small image, and so does an eager op given bytes, not a tensor (TensorFlow's slow
    # path); the JPEG test (tf.io.is_jpeg's) and the cast to float32 (exact from 8 bits) are numpy's.
    try:
        if data[:3] == _JPEG:  # decode_image's JPEG default is the fast, less accurate IDCT
            pixels = tf.raw_ops.DecodeJpeg(contents=contents, channels=channels, dct_method="INTEGER_ACCURATE")
        else:
            pixels = tf.raw_ops.DecodeImage(contents=contents, channels=channels, dtype=tf.uint8, expand_animations=False)
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        raise CorruptInputError(f"{path}: cannot be decoded as an image: {first_line(err)}",
                                reason=f"corrupt: cannot be decoded as an image: {first_line(err)}") from err
    if options.size is not None:
        values = tf.image.resize(tf.cast(pixels, tf.float32), options.size, method="bilinear").numpy() * np.float32(options.scale)
    else:
        values = np.multiply(pixels.numpy(), np.float32(options.scale), dtype=np.float32)  # x -> float32(x) * scale
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


_PNG = b"\x89PNG\r\n\x1a\n"
# PNG colour type -> channels as TensorFlow decodes it: a palette expands to RGB, and to RGBA where a
# tRNS chunk gives it transparency (grey and RGB images keep their channels whatever tRNS says).
_PNG_CHANNELS = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}
_PALETTE = 3
_JPEG_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _exactly(stream: IO[bytes], count: int) -> bytes:
    data = stream.read(count)
    if len(data) != count:
        raise ValueError("the file ends inside its header")
    return data


def _png_header(stream: IO[bytes]) -> tuple[int, int, int]:
    height = width = channels = colour = None
    while True:
        length, kind = struct.unpack(">I4s", _exactly(stream, 8))
        if kind == b"IHDR":
            data = _exactly(stream, length)
            width, height = struct.unpack(">II", data[:8])
            colour = data[9]
            if colour not in _PNG_CHANNELS:
                raise ValueError(f"PNG colour type {colour}")
            channels = _PNG_CHANNELS[colour]
            stream.seek(4, os.SEEK_CUR)
            continue
        if channels is None:
            raise ValueError("no IHDR chunk first")
        if kind == b"tRNS" and colour == _PALETTE:
            channels = 4
        if kind in (b"IDAT", b"IEND"):
            return height, width, channels
        stream.seek(length + 4, os.SEEK_CUR)


def _jpeg_header(stream: IO[bytes]) -> tuple[int, int, int]:
    while True:
        marker = _exactly(stream, 2)
        if marker[0] != 0xFF:
            raise ValueError("not a JPEG marker")
        while marker[1] == 0xFF:  # fill bytes
            marker = marker[1:] + _exactly(stream, 1)
        if marker[1] in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            continue
        (length,) = struct.unpack(">H", _exactly(stream, 2))
        if marker[1] in _JPEG_FRAMES:
            _, height, width, components = struct.unpack(">BHHB", _exactly(stream, 6))
            return height, width, 1 if components == 1 else 3  # TensorFlow decodes CMYK/YCCK to RGB
        if marker[1] == 0xDA:
            raise ValueError("no frame header before the scan")
        stream.seek(length - 2, os.SEEK_CUR)


def image_header(path: str) -> tuple[int, int, int]:
    """An image's ``(height, width, channels)`` as TensorFlow decodes it, from its header alone
    (``CorruptInputError`` where it is not a PNG or JPEG header)."""
    with storage.open_input(path, headers=True) as stream:
        try:
            magic = stream.read(8)
            if magic == _PNG:
                return _png_header(stream)
            if magic[:2] == b"\xff\xd8":
                stream.seek(2)
                return _jpeg_header(stream)
            raise ValueError("neither a PNG nor a JPEG header")
        except (ValueError, struct.error, OSError) as err:
            raise CorruptInputError(f"{path}: cannot be decoded as an image: {err}",
                                    reason=f"corrupt: cannot be decoded as an image: {err}") from err


def describe(path: str, key: Key, sample_shape: Shape | None = None, image: ImageOptions | None = None) -> SourceFile:
    """An image is one sample: its shape from ``input.image`` (``size`` and ``channels``) where it gives
    both, else from the file's header (``image_header``), not decoded. ``sample_shape`` is not used
    (``readers.check_consistent`` compares it with this shape)."""
    if key is not None:
        raise InputError(f"{path}: an image is one sample; input.key ({key}) is for .npz, .h5 and TFRecord files")
    options = image or ImageOptions()
    if options.size is not None and options.channels is not None:
        shape = (*options.size, options.channels)
    else:
        height, width, channels = image_header(path)
        shape = (*(options.size or (height, width)), options.channels or channels)
    return SourceFile(path=path, key=None, num_samples=1, sample_shape=tuple(int(d) for d in shape),
                      dtype="float32", image=options)


def read_images(sources: Sequence[SourceFile], errors: bool = False) -> np.ndarray | list:
    """Many image files, decoded one after the other: ``(len(sources), H, W, C)``. Their bytes enter
    TensorFlow as one tensor, unstacked: an eager op given a tensor takes TensorFlow's fast path, 12 us
    for a 28x28 PNG where given bytes it took 29 us (benchmarks/README.md). (In two threads they decoded
    slower, small PNGs and 224x224 JPEGs alike: reading has one thread of its own beside the engine's,
    ``read._ahead``.) ``errors``: a list instead, in which an image that cannot be read or decoded is
    its ``CorruptInputError``."""
    import tensorflow as tf

    datas: list[bytes | CorruptInputError] = []
    for source in sources:
        try:
            datas.append(_image_bytes(source.path))
        except CorruptInputError as err:
            datas.append(err)
    readable = [data for data in datas if isinstance(data, bytes)]
    tensors = iter(tf.unstack(tf.constant(readable)) if readable else ())
    found: list = []
    for source, data in zip(sources, datas, strict=True):
        try:
            if isinstance(data, CorruptInputError):
                raise data
            found.append(_decode_image(source.path, data, source.image or ImageOptions(), next(tensors)))
        except CorruptInputError as err:
            if not errors:
                raise
            found.append(err)
    return found if errors else np.stack(found)
