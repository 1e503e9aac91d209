"""The ``jacobian`` section: how the Jacobians are computed and what of them is stored, with its
sub-sections (``labels``, ``project``, ``basis``, ``self_check``) and ``outputs: {top_k: k}``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    ByteSize,
    Field,
    NonNegativeInt,
    PositiveInt,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from jacobeam.pipeline.config.section import Section, home_expanded, one_string_is_a_list
from jacobeam.transforms.engine.reductions import FULL, NEEDS_ALL_ROWS, PRODUCTS
from jacobeam.transforms.spec import EngineOptions, OutputSelection, ParameterSide, Reduction, SelfCheck

# What the parameter side can store of a per-sample gradient, and its projection's default width.
PARAMETER_REDUCTIONS = ("project", "frobenius", "none")
PARAMETER_PROJECT_DIM = 2048
# Keras losses of a class label (``jacobian.objective: {loss: name}``): transforms.engine.parameter_space.LOSSES.
LOSS_NAMES = ("sparse_categorical_crossentropy", "categorical_crossentropy")


class TopK(Section):
    """``jacobian.outputs: {top_k: k}``: each sample's ``k`` largest outputs, largest first."""

    top_k: PositiveInt = Field(
        description="How many of each sample's largest outputs to differentiate, largest first; at most the "
        "number of outputs.",
    )


class LabelsConfig(Section):
    """``jacobian.labels``: where ``jacobian.outputs: label`` finds each sample's label. One of three
    sources: ``key``, an array beside the samples in each input file; ``folders: true``, the class
    subfolder each file is in (as Keras's ``image_dataset_from_directory(labels="inferred")``); ``table``,
    a CSV or JSON table of file to label. The last two give each file one label, for all its samples
    (one, for an image); the manifest records them per file and, under ``labels``, the class names.
    A file whose label changes (the table edited) has its shards computed again; a file moved to another
    class folder is a file gone and a new one."""

    key: str | None = Field(
        None,
        description="The array (`.npz`) or dataset path (`.h5`) of the input files that holds their samples' "
        "labels, one per sample (shape `(n,)` or `(n, 1)`): integer flat output indices `0..m-1`. There is no "
        "default key: give `key`, `folders` or `table`.",
    )
    folders: bool = Field(
        False,
        description="`true`: each file's label is the index of its class, the first subfolder under the folder "
        "of `input.paths` that holds it (for a glob, under its part before the first wildcard). The classes are "
        "`class_names` where given, else the sorted names of the subfolders there (a local folder: every "
        "subfolder, as Keras lists them; remote: those holding input files). A file directly in that folder, "
        "or in a subfolder not in `class_names`, is an error. A later run may add class folders whose names "
        "sort after the recorded ones; one that sorts among them would renumber the classes: it is refused "
        "(a model retrained on more classes is another run: `--overwrite`).",
    )
    table: str | None = Field(
        None,
        description="A table of file to label: `.csv` with a header row naming the columns `file` and `label`, "
        "or `.json`, an object `{file: label}`. Files are named relative to the table's folder (or absolute); "
        "labels are integer flat output indices, or, with `class_names`, names in it. Every input file must "
        "be listed; rows for other files are ignored.",
    )
    class_names: list[str] | None = Field(
        None,
        description="The classes in output order (label `i` is `class_names[i]`): with `folders`, the "
        "subfolder names (fixed, whatever folders a later run finds); with `table`, the names its labels are "
        "given by. `null`: with `folders`, the sorted subfolder names; with `table`, the labels are integers.",
    )

    _home_path = field_validator("table", mode="before")(home_expanded)

    @model_validator(mode="after")
    def _one_source(self) -> LabelsConfig:
        given = [name for name, value in (("key", self.key), ("folders", self.folders), ("table", self.table)) if value]
        if len(given) != 1:
            found = f"{' and '.join(given)} are given" if given else "none is given"
            raise ValueError(f"give one of key: <array>, folders: true or table: <file> ({found})")
        if self.class_names is not None and self.key is not None:
            raise ValueError("class_names is for folders: true or table: <file>; key: labels are output indices")
        repeated = sorted({name for name in self.class_names or [] if self.class_names.count(name) > 1})
        if repeated:
            raise ValueError(f"class_names: each class once; {repeated} repeated")
        return self

    @model_serializer(mode="wrap")
    def _given_keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only the keys given: the run identity of a folder written before folders and table existed
        # (``{key: ...}``) stays what it was.
        return {name: value for name, value in handler(self).items() if value not in (None, False)}

    @property
    def per_file(self) -> bool:
        """Whether each file has one label (``folders`` or ``table``), rather than an array of them."""
        return self.key is None


class ProjectConfig(Section):
    """``jacobian.project``: the random projection of ``reduce: project``, which stores ``J P`` for a
    seeded ``P`` of shape ``(d, dim)`` (``d`` input entries): in forward mode without forming ``J``, or,
    where the output rows are fewer than ``dim`` (one label's row, say), the rows in reverse mode times ``P``.

    ``P`` is ``rng = numpy.random.default_rng(seed)``; rademacher: ``rng.choice([-1.0, 1.0], size=(d,
    dim))``, gaussian: ``rng.standard_normal((d, dim))``; both divided by ``sqrt(dim)``. With ``wrt:
    parameters`` it is drawn block by block from TensorFlow's Philox stream instead (docs/what-to-store.md),
    and ``dim`` defaults to 2,048. Other reductions ignore these keys.
    """

    dim: PositiveInt = Field(
        256,
        description="Columns of `P`: each sample's dataset `projection` is `(*rows, dim)`. With `wrt: parameters` "
        f"the default is {PARAMETER_PROJECT_DIM:,} (TRAK's).",
    )
    kind: Literal["rademacher", "gaussian"] = Field(
        "rademacher",
        description="The entries of `P` before the division by `sqrt(dim)`: `rademacher`, ±1 with equal "
        "probability; `gaussian`, standard normal.",
    )
    seed: int = Field(
        0,
        description="Seed of `numpy.random.default_rng`, which draws `P` (with `wrt: parameters`, of its Philox "
        "block stream: docs/what-to-store.md); the manifest records it (`stored.projection`) so that `P` can be "
        "rebuilt.",
    )
    structure: Literal["dense", "kronecker"] = Field(
        "dense",
        description="`wrt: parameters` only: `dense`, every entry of `P` drawn; `kronecker`, each weight of two "
        "or more axes (a matrix `(i, o)`) projected by `kron(A, B)`, `A` `(i, k_in)` and `B` `(o, k_out)` with "
        "`k_in * k_out = dim` (LoGra's projection: a layer's inputs and output gradients projected before "
        "their product, at about the cost of a backward pass; see docs/what-to-store.md).",
    )


class ParametersWrt(Section):
    """``jacobian.wrt: {parameters: [names]}``: the trainable weights of the named layers (or single weights,
    by their path such as ``dense/kernel``) only."""

    parameters: list[str] = Field(
        description="Layer names (all their trainable weights) or weight paths (`layer/kernel`) to differentiate "
        "by, in any order; the stored parameter axis follows the model's order of its weights.",
        min_length=1,
    )

    _one_name_is_a_list = field_validator("parameters", mode="before")(one_string_is_a_list)


class LossObjective(Section):
    """``jacobian.objective: {loss: name}``: each sample's Keras loss against its label."""

    loss: Literal[LOSS_NAMES] = Field(
        description="The Keras loss, by name, of the sample's logits against its label (`from_logits`; a model "
        "whose last layer ends in a softmax is differentiated without it): `sparse_categorical_crossentropy` or "
        "`categorical_crossentropy` (the label one-hot).",
    )


class BasisConfig(Section):
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

    _home_paths = field_validator("input", "output", mode="before")(home_expanded)


class SelfCheckConfig(Section):
    """``jacobian.self_check``: every shard recomputes a few of its samples, each on its own, independently
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
        description="Samples recomputed per 4,096 sample ids of a shard (the default shard's size), rounded "
        "up: at least one in every shard, all of them when it holds fewer, the same share of a run whatever "
        "the shard size. Drawn from the shard's stored samples by a generator seeded with its first id (a "
        "resumed run checks what an uninterrupted one does). `0` turns the self-check off.",
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


class JacobianConfig(Section):
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
        "Under `auto` and `autotune` a mode that fails falls back to the reverse ones. `vjp` and `basis` "
        "with only `basis.output` always run reverse; for `jvp`, `project` and `basis` with `basis.input`, "
        "`auto` counts their input-side vectors instead of the input entries (forward runs one JVP per "
        "vector; reverse computes the output rows, then their product with the vectors).",
    )
    jit_compile: bool | Literal["auto"] = Field(
        False,
        description="XLA: `false`, the plain graph only; `true`, XLA, an error if it cannot compile or "
        "disagrees with the plain graph on a probe batch; `auto`, XLA where it compiles, agrees with the "
        "plain graph and ran a full batch faster than it at set-up, else the plain graph. On `wrt: "
        "parameters` the chosen per-sample gradient path is compiled, judged against the loop of per-sample "
        "tapes (XLA's random numbers make dense projections slower). A timed choice (`auto`, or `mode: "
        "autotune`) can differ between worker processes: use `true` or `false` where shards must be "
        "reproducible bit for bit.",
    )
    memory_budget: ByteSize = Field(
        ByteSize(2 * 2**30),
        description="Bytes for one block's working set, results included: a positive number of bytes, or a "
        "size such as `512MiB` or `2GiB` (binary) or `2GB` (decimal). The engine estimates the working set "
        "from the traced graph and sizes batches and blocks (output rows in reverse mode, input entries in "
        "forward mode) to fit; an out-of-memory error re-plans with half the rows per block, then half the "
        "samples.",
    )
    wrt: Literal["all", "parameters"] | list[str] | ParametersWrt = Field(
        "all",
        description="What to differentiate by: `all` the model inputs, or a list of input names (with a mapping "
        "`input.key`, names of that mapping; a single name is read as a list of one); a model with several "
        "inputs gets one dataset `jacobian/<input name>` per input differentiated. `parameters`: the trainable "
        "weights of a Keras model instead (per-sample gradients; `{parameters: [layer names]}` for some layers, "
        "taken in the model's order whatever the list's), "
        "of its outputs or of `objective`; `reduce` is then `project` (the gradient times a seeded random "
        "projection, `projection`), `frobenius` (its norm, in total and per layer: `frobenius`, "
        "`frobenius_by_layer`) or `none` (the gradient itself, `gradient`, where it is small): "
        "docs/what-to-store.md.",
    )
    objective: Literal["outputs", "margin"] | LossObjective = Field(
        "outputs",
        description="With `wrt: parameters`, what is differentiated: `outputs`, the output rows `outputs` "
        "selects; `margin`, TRAK's margin `log p_y - log(1 - p_y)` of the sample's label `y`, as "
        "`z_y - logsumexp(z_j, j != y)` of the logits `z`; `{loss: name}`, a Keras loss of the label. A model "
        "whose last layer ends in a softmax is differentiated without it for these (its probabilities saturate "
        "in float32), its stored `output` still the probabilities. `margin` and a loss need `labels` and "
        "`outputs: all`, and store the value as `objective` `(n,)`.",
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
        "input files; `{folders: true}`, each file's class subfolder; `{table: <csv or json>}`, a table of file "
        "to label (see `jacobian.labels`). Required for `outputs: label` and, with `wrt: parameters`, for "
        "`objective: margin` or a loss; unused otherwise; `null`: no labels.",
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

    _one_aggregate_is_a_list = field_validator("aggregate", mode="before")(one_string_is_a_list)
    _home_vectors = field_validator("vectors", mode="before")(home_expanded)

    @field_validator("wrt", mode="before")
    @classmethod
    def _one_input_is_a_list(cls, value: Any) -> Any:
        return value if value in ("all", "parameters") or isinstance(value, dict) else one_string_is_a_list(value)

    @model_validator(mode="before")
    @classmethod
    def _parameter_projection_width(cls, data: Any) -> Any:
        # The parameter side projects a far longer axis: its projection is wider unless dim is given.
        if not isinstance(data, dict) or not (data.get("wrt") == "parameters" or isinstance(data.get("wrt"), dict)):
            return data
        project = data.get("project")
        if isinstance(project, ProjectConfig):
            if "dim" in project.model_fields_set:
                return data
            project = project.model_dump(exclude_unset=True)
        project = dict(project or {})
        project.setdefault("dim", PARAMETER_PROJECT_DIM)
        return {**data, "project": project}

    @property
    def on_parameters(self) -> bool:
        """Whether the weights are differentiated (``wrt: parameters``), not the inputs."""
        return self.wrt == "parameters" or isinstance(self.wrt, ParametersWrt)

    @property
    def needs_labels(self) -> bool:
        """Whether each sample's label is read: ``outputs: label``, or an objective of the label."""
        return self.outputs == "label" or self.objective != "outputs"

    @model_validator(mode="after")
    def _parameter_side(self) -> JacobianConfig:
        if not self.on_parameters:
            if self.objective != "outputs":
                typo = f" (wrt is {self.wrt}: did you mean parameters?)" if self.wrt == ["parameter"] else ""
                raise ValueError("objective: is what wrt: parameters differentiates; the input side differentiates "
                                 f"the outputs{typo}")
            if self.project.structure != "dense":
                raise ValueError("project.structure: kronecker projects the weights of wrt: parameters; the input "
                                 "side's P is dense")
            return self
        if self.reduce not in PARAMETER_REDUCTIONS:
            raise ValueError(f"reduce: {self.reduce} is not for wrt: parameters; use one of "
                             f"{', '.join(PARAMETER_REDUCTIONS)}")
        if self.aggregate:
            raise ValueError("aggregate: is for the input side; wrt: parameters stores per-sample values only")
        if self.objective != "outputs" and self.outputs != "all":
            raise ValueError(f"objective: {self._objective_name()} is one value per sample; outputs must be all")
        if self.objective != "outputs" and self.labels is None:
            raise ValueError(f"objective: {self._objective_name()} needs labels: {{key: <array>}}, {{folders: true}} or "
                             "{table: <csv or json of file to label>}")
        return self

    def _objective_name(self) -> str:
        return self.objective if isinstance(self.objective, str) else f"{{loss: {self.objective.loss}}}"

    @model_validator(mode="after")
    def _consistent_products(self) -> JacobianConfig:
        rule = self.outputs if isinstance(self.outputs, str) else "selection"
        if self.outputs == []:
            raise ValueError("outputs: an empty list selects nothing; use all or give indices")
        if rule == "label" and self.labels is None:
            raise ValueError("outputs: label needs labels: {key: <array in the input files>}, {folders: true} or "
                             "{table: <csv or json of file to label>}")
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
            wrt=None if self.wrt == "all" or self.on_parameters else tuple(self.wrt),
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
                project_structure=self.project.structure,
                basis_input=self.basis.input,
                basis_output=self.basis.output,
            ),
            aggregate=tuple(self.aggregate),
            parameters=self._parameter_side_options(),
        )

    def _parameter_side_options(self) -> ParameterSide | None:
        if not self.on_parameters:
            return None
        layers = tuple(self.wrt.parameters) if isinstance(self.wrt, ParametersWrt) else None
        if isinstance(self.objective, LossObjective):
            return ParameterSide(layers=layers, objective="loss", loss=self.objective.loss)
        return ParameterSide(layers=layers, objective=self.objective)

    def _selection(self) -> OutputSelection:
        if isinstance(self.outputs, TopK):
            return OutputSelection("top_k", k=self.outputs.top_k)
        if isinstance(self.outputs, list):
            return OutputSelection("indices", indices=tuple(self.outputs))
        return OutputSelection(self.outputs)
