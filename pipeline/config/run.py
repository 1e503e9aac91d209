"""``Config``, the whole run configuration, and its ``output`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from jacobeam.pipeline.config.inputs import InputConfig, ModelConfig
from jacobeam.pipeline.config.jacobian import JacobianConfig
from jacobeam.pipeline.config.section import Section, home_expanded


class OutputConfig(Section):
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

    _home_path = field_validator("path", mode="before")(home_expanded)


class Config(Section):
    """The run configuration: one YAML file plus ``--set KEY=VALUE`` overrides, validated once at start-up.

    An unknown or mistyped key, a wrong type or a missing required key is an error naming the key (and the
    closest known key, for an unknown one), and the ``--set`` override that gave it, if one did.
    ``--set a.b=VALUE`` overrides any key (VALUE is parsed as YAML). Relative paths are relative to the
    directory jacobeam runs in, and a path starting with ``~`` is in your home folder. The run identity
    (the model source, ``input.key``, ``input.sample_shape`` and ``input.image`` where given,
    ``output.samples_per_shard`` and every ``jacobian`` key but ``threads`` and ``self_check``) decides
    what is stored for a sample: an output folder written with another identity holds another run's result.

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
        unknown = [name for name in jacobian.wrt if name not in names] if isinstance(jacobian.wrt, list) else []
        if unknown:
            raise ValueError(f"jacobian.wrt: {unknown} not among the inputs that input.key names, {list(names)}")
        return self
