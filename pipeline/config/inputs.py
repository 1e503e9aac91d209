"""The sections of what is differentiated: ``model`` and ``input`` (with ``input.image``)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from jacobeam.pipeline.config.section import Section, home_expanded, one_string_is_a_list
from jacobeam.transforms.inputs.types import ImageOptions


class ModelConfig(Section):
    """``model``: the model to differentiate, from exactly one of ``path``, ``factory`` or ``builtin``.

    A Keras model is called with ``training=False``. Before the pipeline starts, the model is loaded once
    and called on one sample of the inputs' shape. Python code runs only where ``factory`` names it: model files
    load with Keras' ``safe_mode`` on, and there is no switch to turn it off.
    """

    path: str | None = Field(
        None,
        description="A Keras model file (`.keras`, or a legacy Keras `.h5` file), loaded with `compile=False` and "
        "`safe_mode` on, so that a file that would run Python code when loaded (a pickled `Lambda`) is refused; "
        "or a TensorFlow SavedModel directory, called through its `serve` endpoint, else its `__call__`, else "
        "its `serving_default` signature (one input, one output). "
        "Exactly one of `path`, `factory` and `builtin` is given; `null`: not this source.",
    )
    factory: str | None = Field(
        None,
        description="A Python callable as `package.module:callable` (exactly one `:`), imported and called with "
        "no arguments; it returns a Keras model, or a callable (a `tf.Module`, say) that takes one batch. "
        "The module must be importable by the workers too. "
        "Exactly one of `path`, `factory` and `builtin` is given; `null`: not this source.",
    )
    builtin: Literal["mlp", "cnn", "cifar_resnet"] | None = Field(
        None,
        description="A built-in model with weights drawn from numpy seed 0: `mlp` maps samples of shape (784,) "
        "through Dense 512 tanh and Dense 512 tanh to 10 outputs; `cnn` maps (28, 28, 1) through two 3×3 "
        "convolutions (32 and 64 filters, ReLU), a 2×2 max-pool and Dense 128 ReLU to 10 outputs; `cifar_resnet` "
        "maps (32, 32, 3) through a ResNet-20 (three stages of three residual blocks of 16, 32 and 64 channels, "
        "BatchNorm in inference mode; 0.27M weights) to 10 logits. "
        "Exactly one of `path`, `factory` and `builtin` is given; `null`: not this source.",
    )
    logits: bool = Field(
        False,
        description="`true`: differentiate the model's logits, its outputs before the softmax of its last layer "
        "(as tf-keras-vis' `ReplaceToLinear` does; saliency wants them: where a probability is 1e-14 its "
        "gradient is about as small). The last layer's softmax is removed before differentiating: a `Dense` "
        "or convolution layer with `activation='softmax'` gets a linear activation (same weights); a final "
        "`Softmax` layer or `Activation('softmax')` layer is dropped, the outputs taken from its input. A "
        "model whose last layer has no softmax is refused with a one-line error naming the last layer and "
        "its activation; so is a model that is not a Keras model (a SavedModel, a `tf.Module`). The user's "
        "model is not changed; the weight fingerprint is the same. Part of the run identity. `false`: the "
        "model's outputs as they are.",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        given = [name for name in ("path", "factory", "builtin") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, factory or builtin (got {given or 'none'})")
        return self

    _home_path = field_validator("path", mode="before")(home_expanded)

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str | None) -> str | None:
        if value is not None and value.count(":") != 1:
            raise ValueError(f"expected 'package.module:callable', got {value!r}")
        return value


class ImageConfig(Section):
    """``input.image``: how a PNG or JPEG file becomes one sample.

    Each image is decoded to 8-bit values ``(H, W, C)`` (16-bit PNGs are scaled down to 8 bits, JPEGs
    decoded with the accurate integer IDCT) with ``channels`` channels, resized (bilinear) to ``size``,
    and turned into float32 ``x * scale``, then ``(x - mean) / std`` (per channel when lists). Other
    input formats ignore these keys.
    """

    size: tuple[PositiveInt, PositiveInt] | None = Field(
        None,
        description="`[height, width]` in pixels: every image is resized (bilinear) to it. "
        "`null`: every image keeps its own size, and images of different sizes are an error naming the file "
        "and both shapes.",
    )
    channels: Literal[1, 3] | None = Field(
        None,
        description="`1`: grayscale, `3`: RGB; an image stored otherwise is converted when it is decoded. "
        "`null`: as stored in the files.",
    )
    scale: float = Field(
        1 / 255,
        description="Factor on the 8-bit values: a finite number other than 0, or a fraction such as `1/255` "
        "(YAML reads it as text). The default, 1/255, maps the values into [0, 1].",
    )
    mean: float | list[float] | None = Field(
        None,
        description="Subtracted after scaling: one number, or a list of one number per channel (a list of "
        "more than one must have `channels` numbers when `channels` is given); finite. `null`: nothing is "
        "subtracted.",
    )
    std: float | list[float] | None = Field(
        None,
        description="Divides after `mean` is subtracted: one positive number, or one per channel (as for "
        "`mean`). `null`: no division.",
    )

    @field_validator("scale", mode="before")
    @classmethod
    def _fraction(cls, value: Any) -> Any:
        """``1/255`` is how people write it; YAML reads it as a string."""
        if isinstance(value, str):
            try:
                return float(Fraction(value.replace(" ", "")))
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"expected a number such as 0.5 or 1/255, got {value!r}") from None
        return value

    @model_validator(mode="after")
    def _usable(self) -> ImageConfig:
        if not math.isfinite(self.scale) or self.scale == 0:
            raise ValueError(f"scale: must be a finite number other than 0, got {self.scale}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [] if value is None else [value]
            if value == []:
                raise ValueError(f"{name}: an empty list; give one number, or one per channel")
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"{name}: must be finite numbers, got {value}")
            if name == "std" and any(v <= 0 for v in values):
                raise ValueError(f"std: must be positive, got {value}")
            if isinstance(value, list) and len(value) > 1 and self.channels is not None and len(value) != self.channels:
                raise ValueError(f"{name}: {len(value)} values for {self.channels} channel(s)")
        return self

    def options(self) -> ImageOptions:
        return ImageOptions.from_config(self.model_dump(mode="json"))


class InputConfig(Section):
    """``input``: the files whose samples are differentiated.

    A sample's id is its position in the concatenation of the matched files in sorted path order. The
    format follows from each file's name: ``.npy``, ``.npz``, ``.h5``/``.hdf5``, TFRecord
    (``.tfrecord``, ``.tfrecords``, either with ``.gz``) and PNG/JPEG images. The files' headers are read
    before the pipeline starts, so that a file of another sample shape or dtype stops the run before any
    output is touched; each sample is read once, by the worker that reads its range, which checks it.
    """

    paths: list[str] = Field(
        min_length=1,
        description="One or more globs (a single string is read as a list of one), matched through Beam's "
        "`FileSystems` (local, `gs://`, `s3://`, ...); each must match at least one file. A path without "
        "wildcards that names a folder, or ends in `/`, stands for every `.png`, `.jpg` and `.jpeg` image "
        "under it, at any depth. A local path is taken relative to the directory jacobeam runs in (`*.npy` "
        "matches there) and made absolute in the plan, so that workers need not share that directory. "
        "Required. Not part of the run identity: an incremental run may add files.",
    )
    key: str | dict[str, str] | None = Field(
        None,
        description="The array of samples: its name in `.npz` files, its dataset path in `.h5`/`.hdf5` files, "
        "the float feature of TFRecord files (required there). `null`: the file's only array or dataset. "
        "Not used by `.npy` files; must be `null` for images. For a model with several inputs, a mapping "
        "`{model input name: array}` that reads one array (or feature) per model input from each file.",
    )
    sample_shape: list[PositiveInt] | dict[str, list[PositiveInt]] | None = Field(
        None,
        description="One sample's shape, e.g. `[8, 8, 1]`; a mapping `{input name: shape}` with the same names "
        "when `input.key` is a mapping. Required for TFRecord files, whose features are flat lists of floats "
        "(a sample's values in C order); for other files a check that their samples have this shape. "
        "`null`: the samples' shape as found in the files, the same in all of them.",
    )
    image: ImageConfig | None = Field(
        None,
        description="How PNG/JPEG images become samples (see `input.image`). `null`: the defaults of "
        "`input.image`.",
    )
    on_bad_sample: Literal["error", "skip"] = Field(
        "error",
        description="What a bad sample does (one holding NaN or Inf, a row of a truncated or corrupt file, "
        "a file that cannot be read at all): `error` stops the run naming the file and row (before any output "
        "where the file's headers are bad; else in the worker that reads the sample, the shards already "
        "complete kept for the rerun); `skip` leaves those samples out of the shards (they keep their ids; a file that "
        "cannot be opened gets none) and lists them in `rejected.jsonl`. Not part of the run identity.",
    )

    _one_glob_is_a_list = field_validator("paths", mode="before")(one_string_is_a_list)
    _home_paths = field_validator("paths", mode="after")(home_expanded)

    @field_validator("key", mode="before")
    @classmethod
    def _key_form(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"expected an array name, or a mapping {{input name: array name}}, got {value!r}")
        if not value:
            raise ValueError("an empty mapping names no input; give {input name: array name, ...}")
        for name, array in value.items():
            if not isinstance(name, str) or not isinstance(array, str) or not array:
                raise ValueError(f"input {name!r}: expected the name of an array, got {array!r}")
        return value

    @model_validator(mode="after")
    def _shapes_match_keys(self) -> InputConfig:
        several, shapes = isinstance(self.key, dict), self.sample_shape
        if isinstance(shapes, dict) and not several:
            raise ValueError("sample_shape: a mapping by input name needs input.key to map the same inputs")
        if several and shapes is not None and (not isinstance(shapes, dict) or set(shapes) != set(self.key)):
            raise ValueError(f"sample_shape: give one shape per input of input.key, {{{', '.join(self.key)}: [...]}}")
        return self

    def image_options(self) -> ImageOptions:
        return (self.image or ImageConfig()).options()

    def shape(self) -> tuple[int, ...] | dict[str, tuple[int, ...]] | None:
        """``sample_shape`` as the readers take it."""
        if isinstance(self.sample_shape, dict):
            return {name: tuple(dims) for name, dims in self.sample_shape.items()}
        return None if self.sample_shape is None else tuple(self.sample_shape)
