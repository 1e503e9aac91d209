"""The run configuration: one YAML file plus ``--set`` overrides, validated once at the edge.

The key names are a contract with users (see README, "Configuration"): add keys, never rename.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from jacobeam.transforms.engine.reductions import FULL, NEEDS_ALL_ROWS, PRODUCTS
from jacobeam.transforms.errors import JacobeamError
from jacobeam.transforms.inputs.types import ImageOptions
from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction, SelfCheck


class ConfigError(JacobeamError, ValueError):
    """A configuration that cannot be run; the message names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _one_string_is_a_list(value: Any) -> Any:
    """A list key given one string (``--set jacobian.aggregate=mean``) means a list of that one string,
    validated as any list."""
    return [value] if isinstance(value, str) else value


class ModelConfig(_Section):
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
    builtin: Literal["mlp", "cnn"] | None = Field(
        None,
        description="A built-in model with weights drawn from numpy seed 0: `mlp` maps samples of shape (784,) "
        "through Dense 512 tanh and Dense 512 tanh to 10 outputs; `cnn` maps (28, 28, 1) through two 3×3 "
        "convolutions (32 and 64 filters, ReLU), a 2×2 max-pool and Dense 128 ReLU to 10 outputs. "
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

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str | None) -> str | None:
        if value is not None and value.count(":") != 1:
            raise ValueError(f"expected 'package.module:callable', got {value!r}")
        return value


class ImageConfig(_Section):
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


class InputConfig(_Section):
    """``input``: the files whose samples are differentiated.

    A sample's id is its position in the concatenation of the matched files in sorted path order. The
    format follows from each file's name: ``.npy``, ``.npz``, ``.h5``/``.hdf5``, TFRecord
    (``.tfrecord``, ``.tfrecords``, either with ``.gz``) and PNG/JPEG images. Every sample is read once
    before the pipeline starts, so that a file of another sample shape or dtype, or a bad sample, stops
    the run before any output is touched.
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
        "a file that cannot be read at all): `error` stops the run before any output is touched, naming the "
        "file and row; `skip` leaves those samples out of the shards (they keep their ids; a file that "
        "cannot be opened gets none) and lists them in `rejected.jsonl`. Not part of the run identity.",
    )

    _one_glob_is_a_list = field_validator("paths", mode="before")(_one_string_is_a_list)

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


class TopK(_Section):
    """``jacobian.outputs: {top_k: k}``: each sample's ``k`` largest outputs, largest first."""

    top_k: PositiveInt = Field(
        description="How many of each sample's largest outputs to differentiate, largest first; at most the "
        "number of outputs.",
    )


class LabelsConfig(_Section):
    """``jacobian.labels``: where ``jacobian.outputs: label`` finds each sample's label."""

    key: str = Field(
        description="The array (`.npz`) or dataset path (`.h5`) of the input files that holds their samples' "
        "labels, one per sample (shape `(n,)` or `(n, 1)`): integer flat output indices `0..m-1`. Required "
        "when `labels` is given: there is no default key.",
    )


class ProjectConfig(_Section):
    """``jacobian.project``: the random projection of ``reduce: project``, which stores ``J P`` for a
    seeded ``P`` of shape ``(d, dim)`` (``d`` input entries), in forward mode, without forming ``J``.

    ``P`` is ``rng = numpy.random.default_rng(seed)``; rademacher: ``rng.choice([-1.0, 1.0], size=(d,
    dim))``, gaussian: ``rng.standard_normal((d, dim))``; both divided by ``sqrt(dim)``. Other reductions
    ignore these keys.
    """

    dim: PositiveInt = Field(
        256,
        description="Columns of `P`: each sample's dataset `projection` is `(*rows, dim)`.",
    )
    kind: Literal["rademacher", "gaussian"] = Field(
        "rademacher",
        description="The entries of `P` before the division by `sqrt(dim)`: `rademacher`, ±1 with equal "
        "probability; `gaussian`, standard normal.",
    )
    seed: int = Field(
        0,
        description="Seed of `numpy.random.default_rng`, which draws `P`; the manifest records it "
        "(`stored.projection`) so that `P` can be rebuilt.",
    )


class BasisConfig(_Section):
    """``jacobian.basis``: the fixed bases of ``reduce: basis``, which stores ``U^T J V`` of shape
    ``(n, p, q)`` (dataset ``basis_projection``). A side left ``null`` is the identity; ``reduce: basis``
    needs at least one. Other reductions ignore these keys."""

    input: str | None = Field(
        None,
        description="`.npy` file of `V`, shape `(d, q)`: one column per basis vector of the flattened input "
        "(`d` entries). `null`: the identity.",
    )
    output: str | None = Field(
        None,
        description="`.npy` file of `U`, shape `(m, p)`: one column per basis vector of the flattened output "
        "(`m` entries). `null`: the identity.",
    )


class SelfCheckConfig(_Section):
    """``jacobian.self_check``: every shard recomputes a few of its samples one at a time, independently
    of the engine's batched computation, in the compute dtype and in a float64 copy of the model (the
    truth), and records how far the stored values are from the truth (shard attribute ``self_check``, the
    manifest's ``self_check.precision``, the run's summary and ``inspect``).

    A stored value fails when it is further from the truth than the tolerance and than 4 times an
    independent per-sample computation in the compute dtype (on a deep ReLU net float32 itself is about
    1e-3 off): docs/verifying.md. Not part of the run identity: it decides how results are checked, not
    what they are.
    """

    samples: NonNegativeInt = Field(
        4,
        description="Samples recomputed per shard, drawn from its stored samples by a generator seeded with "
        "the shard's first id (a resumed run checks what an uninterrupted one does); all of them when the "
        "shard holds fewer. `0` turns the self-check off.",
    )
    on_mismatch: Literal["fail", "warn"] = Field(
        "fail",
        description="What a stored value beyond the bound does: the bound is the larger of the tolerance of "
        "the compute dtype (1e-4 for float32, 1e-9 for float64, at least twice the epsilon of the store dtype) "
        "and 4 times the error of an independent per-sample computation in the compute dtype, both against a "
        "float64 copy of the model. `fail` stops the run, naming the shard, sample, input file and row, and "
        "dataset; `warn` logs it, records it in the shard and the manifest, and goes on.",
    )

    def spec(self) -> SelfCheck:
        return SelfCheck(samples=self.samples, on_mismatch=self.on_mismatch)


class JacobianConfig(_Section):
    """``jacobian``: how the Jacobians are computed and what of them is stored.

    Each worker builds the Jacobian function once and checks it before trusting it; what ran and why is
    written to the manifest under ``engine``. Combinations that make no sense are refused when the config
    is read. Every key but ``threads`` and ``self_check`` is part of the run identity.
    """

    batch_size: PositiveInt = Field(
        256,
        description="Samples per call of the compiled Jacobian function (and per batch read from the inputs). "
        "The engine uses fewer when one sample's Jacobian is large for `memory_budget`.",
    )
    mode: Literal["auto", "reverse", "reverse_loop", "forward", "autotune"] = Field(
        "auto",
        description="How to differentiate: `reverse`, `batch_jacobian` vectorised by pfor (cost grows with the "
        "output rows); `reverse_loop`, a graph-mode loop of batched gradients, one per output row, without "
        "pfor; `forward`, forward mode over a batch of basis tangents (cost grows with the input entries); "
        "`auto`, forward when the input entries are at most as many as the output rows, else reverse; "
        "`autotune`, times every mode on a full batch and keeps the fastest that agrees with the reference. "
        "Under `auto` and `autotune` a mode that fails falls back to the reverse ones. `reduce` products "
        "set the direction themselves: `jvp`, `project` and `basis` with `basis.input` run forward; `vjp` "
        "and `basis` with only `basis.output` run reverse.",
    )
    jit_compile: bool | Literal["auto"] = Field(
        False,
        description="XLA: `false`, the plain graph only; `true`, XLA, an error if it cannot compile or "
        "disagrees with the plain graph on a probe batch; `auto`, XLA where it compiles, agrees with the "
        "plain graph and ran a full batch faster than it at set-up, else the plain graph. A timed choice "
        "(`auto`, or `mode: autotune`) can differ between worker processes: use `true` or `false` where "
        "shards must be reproducible bit for bit.",
    )
    memory_budget: ByteSize = Field(
        ByteSize(2 * 2**30),
        description="Bytes for one block's working set, results included: a positive number of bytes, or a "
        "size such as `512MiB` or `2GiB` (binary) or `2GB` (decimal). The engine estimates the working set "
        "from the traced graph and sizes batches and blocks (output rows in reverse mode, input entries in "
        "forward mode) to fit; an out-of-memory error re-plans with half the rows per block, then half the "
        "samples.",
    )
    wrt: Literal["all"] | list[str] = Field(
        "all",
        description="The model inputs to differentiate by: `all`, or a list of input names (with a mapping "
        "`input.key`, names of that mapping; a single name is read as a list of one). A model with several "
        "inputs gets one dataset `jacobian/<input name>` per input differentiated.",
    )
    compute_dtype: Literal["float32", "float64"] = Field(
        "float32",
        description="The dtype samples are cast to and the model computes in; `float64` runs a float64 twin "
        "of a Keras model (same weights; other models cannot) and checks paths against each other to 1e-9 "
        "instead of 1e-4.",
    )
    store_dtype: Literal["float16", "bfloat16", "float32", "float64"] = Field(
        "float32",
        description="The dtype of the floating-point datasets the shards store per sample (`output`, "
        "`jacobian` or what `reduce` stores instead); results are cast to it. `bfloat16` is stored as a "
        "2-byte HDF5 float that h5py reads as float32.",
    )
    check_batch_independence: bool = Field(
        True,
        description="Refuse a model whose outputs for a sample depend on the other samples in its batch "
        "(BatchNorm in training mode, batch statistics), found by comparing one probe batch with its two "
        "halves: per-sample Jacobians by `batch_jacobian` would be wrong. `false` skips the check.",
    )
    outputs: Literal["all", "argmax", "label"] | list[NonNegativeInt] | TopK = Field(
        "all",
        description="Which output rows to differentiate (only these are computed): `all`; a non-empty list "
        "of flat output indices such as `[3, 7]`; `argmax`, each sample's largest output; `label`, each "
        "sample's label (needs `labels`); `{top_k: k}`, each sample's `k` largest outputs, largest first. "
        "Other than `all`, the chosen indices are stored as `output_index` `(n, k)` and `jacobian` as "
        "`(n, k, *input_shape)`, and `reduce` cannot be any of " + ", ".join(f"`{kind}`" for kind in NEEDS_ALL_ROWS)
        + ".",
    )
    labels: LabelsConfig | None = Field(
        None,
        description="Where `outputs: label` finds each sample's label: `{key: <array>}`, an array of the same "
        "input files (see `jacobian.labels`). Required for `outputs: label` and unused otherwise; "
        "`null`: no labels (there is no default key).",
    )
    reduce: Literal[FULL + PRODUCTS] = Field(
        "none",
        description="What to keep of each sample's Jacobian `J` (`m` outputs, `d` input entries; the dataset "
        "in parentheses): `none`, `J` itself (`jacobian`); `frobenius`, its Frobenius norm (`frobenius`); "
        "`diagonal`, `trace` and `slogdet`, for square Jacobians only (`diagonal`; `trace`; `sign` and "
        "`logabsdet`); `max_abs_over_outputs`, the maximum of `|J|` over the output rows (`saliency`); "
        "`sum_abs_over_channels`, `|J|` summed over the last input axis (`saliency`); `vjp` and `jvp`, the "
        "products `u^T J` and `J v` with the vectors of `vectors` (`vjp`, `jvp`); `project`, `J P` (see "
        "`jacobian.project`; `projection`); `basis`, `U^T J V` (see `jacobian.basis`; `basis_projection`). "
        "The products (" + ", ".join(f"`{kind}`" for kind in PRODUCTS) + ") never form `J`. A model with "
        "several inputs allows only `none`.",
    )
    vectors: str | None = Field(
        None,
        description="`.npy` file of the fixed vectors of `reduce: vjp`, vectors `u` over the outputs of shape "
        "`(r, *output_shape)`, or `reduce: jvp`, vectors `v` over the inputs of shape `(r, *input_shape)`; "
        "one vector may come without the `r` axis. Required for `vjp` and `jvp`, unused otherwise.",
    )
    project: ProjectConfig = Field(
        ProjectConfig(),
        description="The random projection `P` of `reduce: project` (see `jacobian.project`).",
    )
    basis: BasisConfig = Field(
        BasisConfig(),
        description="The bases of `reduce: basis` (see `jacobian.basis`): at least one of `basis.input` and "
        "`basis.output` is required for it.",
    )
    aggregate: list[Literal["mean", "mean_abs", "jtj"]] = Field(
        [],
        description="Sums over every stored sample, written with `count` to `aggregates.h5`: `mean`, the mean "
        "Jacobian, and `mean_abs`, the mean `|J|`, both shaped like one sample's stored `jacobian`; `jtj`, "
        "`sum_i J_i^T J_i` of shape `(d, d)`. Summed in float64 in a fixed order: the same bits however the "
        "work was split. Not with a `reduce` product, nor for a model with several inputs. A single name is read "
        "as a list of one; `[]`: none.",
    )
    threads: PositiveInt | Literal["auto"] = Field(
        "auto",
        description="TensorFlow intra-op threads per worker process. `auto`: on a local runner, the machine's "
        "cores divided by its worker processes (`--direct_num_workers` under `multi_processing`) so that they "
        "do not oversubscribe the CPU; on other runners, TensorFlow's default. Not part of the run identity, though "
        "on some CPUs the last bits of a float32 result depend on it ([engine](engine.md)): keep it fixed where "
        "shards must match bit for bit.",
    )
    self_check: SelfCheckConfig = Field(
        SelfCheckConfig(),
        description="Each shard recomputes a few of its samples independently and records the error (see "
        "`jacobian.self_check`). Not part of the run identity.",
    )

    _one_aggregate_is_a_list = field_validator("aggregate", mode="before")(_one_string_is_a_list)

    @field_validator("wrt", mode="before")
    @classmethod
    def _one_input_is_a_list(cls, value: Any) -> Any:
        return value if value == "all" else _one_string_is_a_list(value)

    @model_validator(mode="after")
    def _consistent_products(self) -> JacobianConfig:
        rule = self.outputs if isinstance(self.outputs, str) else "selection"
        if self.outputs == []:
            raise ValueError("outputs: an empty list selects nothing; use all or give indices")
        if rule == "label" and self.labels is None:
            raise ValueError("outputs: label needs labels: {key: <array of labels in the input files>}")
        if rule != "all" and self.reduce in NEEDS_ALL_ROWS:
            raise ValueError(f"reduce: {self.reduce} needs every output row; it cannot follow outputs: {self.outputs}")
        if self.reduce in ("vjp", "jvp") and self.vectors is None:
            raise ValueError(f"reduce: {self.reduce} needs vectors: <.npy file of fixed vectors>")
        if self.reduce == "basis" and self.basis.input is None and self.basis.output is None:
            raise ValueError("reduce: basis needs basis.input and/or basis.output (.npy files)")
        if self.aggregate and self.reduce in PRODUCTS:
            raise ValueError(f"aggregate: needs the Jacobian, which reduce: {self.reduce} never forms")
        return self

    @field_validator("memory_budget")
    @classmethod
    def _positive_budget(cls, value: ByteSize) -> ByteSize:
        if value <= 0:
            raise ValueError("must be a positive size such as 2GiB or 512MB")
        return value

    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            batch_size=self.batch_size,
            mode=self.mode,
            jit_compile=self.jit_compile,
            memory_budget=int(self.memory_budget),
            wrt=None if self.wrt == "all" else tuple(self.wrt),
            compute_dtype=self.compute_dtype,
            store_dtype=self.store_dtype,
            check_batch_independence=self.check_batch_independence,
            outputs=self._selection(),
            reduce=Reduction(
                kind=self.reduce,
                vectors=self.vectors,
                project_dim=self.project.dim,
                project_kind=self.project.kind,
                project_seed=self.project.seed,
                basis_input=self.basis.input,
                basis_output=self.basis.output,
            ),
            aggregate=tuple(self.aggregate),
        )

    def _selection(self) -> OutputSelection:
        if isinstance(self.outputs, TopK):
            return OutputSelection("top_k", k=self.outputs.top_k)
        if isinstance(self.outputs, list):
            return OutputSelection("indices", indices=tuple(self.outputs))
        return OutputSelection(self.outputs)


class OutputConfig(_Section):
    """``output``: where and how the results are written.

    The folder holds ``shards/`` (one HDF5 file per id range), ``jacobians.h5`` (virtual datasets over
    all shards), ``rejected.jsonl``, ``aggregates.h5`` (with ``jacobian.aggregate``), ``engine-plan.json``
    (the engine's set-up decisions, a cache for resumed and incremental runs) and, written last,
    ``manifest.json``: the folder is complete exactly when it exists.
    """

    path: str = Field(
        description="The output folder: a local path, or a remote one (`gs://`, `s3://`, `hdfs://`, any Beam "
        "file system). It must be writable and must not hold another run's result (`--overwrite` replaces "
        "one); a folder holding this run's shards is resumed or extended. Required.",
    )
    samples_per_shard: PositiveInt = Field(
        4096,
        description="Sample ids per shard file; one shard is one unit of work, written under a temporary name "
        "and renamed when complete.",
    )
    compression: Literal["none", "lzf", "gzip"] = Field(
        "none",
        description="HDF5 compression of the shards' datasets: `none`, `lzf` or `gzip`. Not part of the run "
        "identity.",
    )


class Config(_Section):
    """The run configuration: one YAML file plus ``--set KEY=VALUE`` overrides, validated once at start-up.

    An unknown or mistyped key, a wrong type or a missing required key is an error naming the key (and the
    closest known key, for an unknown one), and the ``--set`` override that gave it, if one did.
    ``--set a.b=VALUE`` overrides any key (VALUE is parsed as YAML). Relative paths are relative to the
    directory jacobeam runs in. The run identity (the model source, ``input.key``, ``input.sample_shape``
    and ``input.image`` where given, ``output.samples_per_shard`` and every ``jacobian`` key but
    ``threads`` and ``self_check``) decides what is stored for a sample: an output folder written with
    another identity holds another run's result.

    Note:
        Build one with ``load`` (a YAML file and overrides) or ``validate`` (plain data), which report
        every offending key in one ``ConfigError``.

    Raises:
        pydantic.ValidationError: when built directly (``Config(...)``, ``Config.model_validate``);
            ``validate`` and ``load`` raise it as a ``ConfigError``.
    """

    model: ModelConfig = Field(description="Where the model comes from (see `model`). Required.")
    input: InputConfig = Field(description="The input files and how they are read (see `input`). Required.")
    jacobian: JacobianConfig = Field(
        JacobianConfig(),
        description="How the Jacobians are computed and what of them is stored (see `jacobian`); every key has "
        "a default.",
    )
    output: OutputConfig = Field(description="Where and how the results are written (see `output`). Required.")

    @model_validator(mode="after")
    def _several_inputs(self) -> Config:
        """What a mapping ``input.key`` (a model with several inputs) allows in ``jacobian``."""
        names, jacobian = self.input.key, self.jacobian
        if not isinstance(names, dict):
            return self
        refusal = jacobian.engine_options().one_input_only()
        if refusal:
            raise ValueError(f"{refusal}; input.key names inputs {list(names)}")
        unknown = [name for name in jacobian.wrt if name not in names] if jacobian.wrt != "all" else []
        if unknown:
            raise ValueError(f"jacobian.wrt: {unknown} not among the inputs that input.key names, {list(names)}")
        return self


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=VALUE`` into its key path and its YAML-parsed value.

    Args:
        text: one ``--set`` argument, ``KEY=VALUE`` with a dotted key.

    Returns:
        The key's parts (``["a", "b"]``) and the value as YAML reads it.

    Raises:
        ConfigError: ``text`` is not ``KEY=VALUE``, or VALUE is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE (e.g. output.path=out/), got {text!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {err}") from err
    return key.strip().split("."), value


def apply_override(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``value`` at the key path ``keys`` of the raw config ``raw`` (in place), creating sections.

    Raises:
        ConfigError: a key on the path holds a value, not a section.
    """
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


# What a key of several forms accepts, said once instead of one pydantic error per member of its union.
_FORMS = {
    "input.sample_shape": "a shape such as [8, 8, 1], or a mapping {input name: shape}",
    "input.image.mean": "a number, or a list of one number per channel",
    "input.image.std": "a positive number, or a list of one per channel",
    "jacobian.jit_compile": "true, false or auto",
    "jacobian.wrt": "all, or a list of input names",
    "jacobian.outputs": "all, argmax, label, a list of output indices such as [3, 7], or {top_k: K}",
    "jacobian.threads": "auto, or a positive integer",
}


def _section_keys(path: tuple[Any, ...]) -> list[str]:
    """The keys of the section at ``path`` (keys from the top level), for a did-you-mean; none when
    ``path`` does not lead to a single section."""
    section: type[BaseModel] = Config
    for part in path:
        field = section.model_fields.get(part)
        models = [kind for kind in _member_types(field.annotation) if issubclass(kind, BaseModel)] if field else []
        if len(models) != 1:
            return []
        section = models[0]
    return list(section.model_fields)


def _member_types(annotation: Any) -> list[type]:
    """The classes an annotation names, through ``X | None`` and the like."""
    if isinstance(annotation, type):
        return [annotation]
    return [kind for arg in get_args(annotation) for kind in _member_types(arg)]


def _did_you_mean(word: Any, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1) if isinstance(word, str) else []
    return f"; did you mean {close[0]}?" if close else ""


def _problems(error: ValidationError) -> list[tuple[str, str]]:
    """``(dotted key, what is wrong with it)`` for each problem of ``error``."""
    problems = []
    for item in error.errors():
        loc, given = item["loc"], item.get("input")
        key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "(top level)"
        union = next((name for name in _FORMS if key.startswith(name + ".")), None)
        if union:
            # The first error of the union is its first member's, which was given the whole value.
            if all(known != union for known, _ in problems):
                problems.append((union, f"{given!r} is not one of {_FORMS[union]}"))
        elif item["type"] == "extra_forbidden":
            problems.append((key, "unknown key" + _did_you_mean(loc[-1], _section_keys(loc[:-1]))))
        elif item["type"] == "missing":
            problems.append((key, "required key is missing"))
        elif item["type"] == "literal_error":
            choices = re.findall(r"'([^']*)'", item["ctx"]["expected"])
            problems.append((key, f"{item['msg']} (got {given!r}){_did_you_mean(given, choices)}"))
        elif item["type"] == "value_error" and isinstance(given, dict):
            # A section-level check, whose message may start with the key inside the section (or, at
            # the top level, with the dotted key).
            message = item["msg"].removeprefix("Value error, ")
            inner = re.match(r"^([\w.]+): (.*)$" if not loc else r"^(\w+): (.*)$", message)
            if inner and not loc:
                problems.append(inner.groups())
            elif inner:
                problems.append((f"{key}.{inner[1]}", inner[2]))
            else:
                problems.append((key, message))
        else:
            problems.append((key, f"{item['msg']} (got {given!r})"))
    return problems


def _describe(error: ValidationError, source: str, overridden: Sequence[str]) -> str:
    """One line per problem, a problem under a key that ``--set`` gave blamed on that override (it
    replaced what the file said), any other on ``source``."""

    def by_override(key: str) -> bool:
        return any(key == set_key or key.startswith((set_key + ".", set_key + "[")) for set_key in overridden)

    lines = [(f"--set {key}" if by_override(key) else key) + f": {message}" for key, message in _problems(error)]
    if len(lines) == 1:
        return lines[0] if lines[0].startswith("--set ") else f"{source}: {lines[0]}"
    header = source if any(not line.startswith("--set ") for line in lines) else "the --set overrides"
    return f"{header} {'is' if header == source else 'are'} not valid:\n" + "\n".join(f"  {line}" for line in lines)


def validate(raw: dict[str, Any], source: str = "config", overridden: Sequence[str] = ()) -> Config:
    """Validate a raw config (plain data, as YAML reads it).

    Args:
        raw: the config as a mapping.
        source: what the config came from, for the error message (a file name).
        overridden: the dotted keys that ``--set`` overrides gave, whose problems the message blames on them.

    Returns:
        The validated ``Config``, with every default filled in.

    Raises:
        ConfigError: ``raw`` is not a mapping, or not a valid config; the message names every offending
            key.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a YAML mapping at the top level, got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source, overridden)) from None


def load(path: str | Path | None, overrides: list[str] = (), base: dict[str, Any] | None = None) -> Config:
    """Read a YAML config (or start from ``base``), apply ``--set`` overrides, validate.

    Args:
        path: the YAML file; None starts from ``base`` alone.
        overrides: ``--set`` arguments, ``KEY=VALUE``, applied in order after the file is read.
        base: the raw config to start from (copied) when ``path`` is None; a file replaces it.

    Returns:
        The validated ``Config``.

    Raises:
        ConfigError: the file cannot be read or is not a YAML mapping, an override is malformed, or the
            result is not a valid config.
    """
    raw: dict[str, Any] = copy.deepcopy(base or {})
    source = "config"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    overridden = []
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(raw, keys, value)
        overridden.append(".".join(keys))
    return validate(raw, source, overridden)


def to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data (for the manifest)."""
    return config.model_dump(mode="json")
