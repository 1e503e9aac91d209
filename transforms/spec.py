"""The plain, picklable description of a job that the transforms share.

Beam pickles every DoFn and ships it to workers, so what they hold is plain data: this module
imports neither TensorFlow nor Beam.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import json
import pickle
import zlib
from collections.abc import Iterator
from importlib import metadata
from typing import Any, Literal

import numpy as np

from jacobeam.transforms.inputs.types import Shape, SourceFile


def version() -> str:
    try:
        return metadata.version("jacobeam")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Exactly one of a model file/directory, a ``"pkg.module:callable"`` factory, or a built-in name;
    ``logits``: differentiate the model without its last layer's softmax (``model.logits``)."""

    path: str | None = None
    factory: str | None = None
    builtin: str | None = None
    logits: bool = False

    def load(self, keep: bool = False):
        from jacobeam.transforms.engine import models

        return models.load(path=self.path, factory=self.factory, builtin=self.builtin, logits=self.logits, keep=keep)


@dataclasses.dataclass(frozen=True)
class Rejected:
    """Consecutive samples of one file rejected for one reason (``input.on_bad_sample: skip``).

    Ids ``[start, stop)`` are rows ``row .. row + stop - start`` of ``file``. A file that cannot be opened
    at all holds no samples and has no ids: ``start``, ``stop`` and ``row`` are then ``None``.
    Rejected samples keep their ids; they are absent from the shards and listed in ``rejected.jsonl``.
    """

    file: str
    reason: str
    row: int | None = None
    start: int | None = None
    stop: int | None = None

    @property
    def num_samples(self) -> int:
        return 0 if self.start is None else self.stop - self.start

    def lines(self) -> Iterator[dict[str, Any]]:
        """One ``rejected.jsonl`` record per sample (one for a file without ids)."""
        if self.start is None:
            yield {"id": None, "file": self.file, "row": None, "reason": self.reason}
            return
        for offset in range(self.stop - self.start):
            yield {"id": self.start + offset, "file": self.file, "row": self.row + offset, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class OutputSelection:
    """Which output rows to differentiate: all, fixed flat ``indices``, each sample's ``argmax``,
    its ``label``, or its ``top_k`` outputs (largest first)."""

    rule: Literal["all", "indices", "argmax", "label", "top_k"] = "all"
    indices: tuple[int, ...] = ()
    k: int = 1

    @property
    def count(self) -> int | None:
        """Rows per sample; None for all rows."""
        return {"all": None, "indices": len(self.indices), "argmax": 1, "label": 1, "top_k": self.k}[self.rule]


@dataclasses.dataclass(frozen=True)
class Reduction:
    """What to keep of each sample's Jacobian (``jacobian.reduce`` and its parameters)."""

    kind: str = "none"
    vectors: str | None = None  # .npy of fixed vectors for vjp (over outputs) / jvp (over inputs)
    project_dim: int = 256
    project_kind: Literal["rademacher", "gaussian"] = "rademacher"
    project_seed: int = 0
    project_structure: Literal["dense", "kronecker"] = "dense"  # kronecker: the parameter side only
    basis_input: str | None = None  # .npy (d, q): V in U^T J V
    basis_output: str | None = None  # .npy (m, p): U in U^T J V


def run_key(identity: dict[str, Any]) -> str:
    """The hash of a run's identity (``JobSpec.run_key``): what its shards are checked against."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def store_dtype(name: str) -> np.dtype:
    """The numpy dtype of a ``store_dtype`` name (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclasses.dataclass(frozen=True)
class ParameterSide:
    """``jacobian.wrt: parameters``: differentiate the model's trainable weights (``layers``: those of the
    named layers or weights; None: all) instead of its inputs, of its outputs (``objective: outputs``) or
    of a per-sample objective of the label (``margin``, TRAK's; ``loss``, the Keras loss named ``loss``)."""

    layers: tuple[str, ...] | None = None
    objective: Literal["outputs", "margin", "loss"] = "outputs"
    loss: str | None = None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the engine computes Jacobians (see ``transforms.engine.JacobianEngine``)."""

    batch_size: int = 256
    mode: Literal["auto", "reverse", "reverse_loop", "forward", "autotune"] = "auto"
    jit_compile: bool | Literal["auto"] = False
    memory_budget: int = 2 * 2**30  # bytes for one block's working set, results included
    wrt: tuple[str, ...] | None = None  # model inputs to differentiate by; None: all
    compute_dtype: Literal["float32", "float64"] = "float32"
    store_dtype: Literal["float16", "bfloat16", "float32", "float64"] = "float32"
    check_batch_independence: bool = True
    outputs: OutputSelection = OutputSelection()
    reduce: Reduction = Reduction()
    aggregate: tuple[str, ...] = ()  # any of mean, mean_abs, jtj
    parameters: ParameterSide | None = None  # None: the Jacobians with respect to the inputs

    @property
    def needs_labels(self) -> bool:
        """Whether each sample's label is read with it: ``outputs: label``, or an objective of the label."""
        return self.outputs.rule == "label" or (self.parameters is not None and self.parameters.objective != "outputs")

    def one_input_only(self) -> str | None:
        """Why these options need a one-input model, or None: a reduction or an aggregate is of one
        input's Jacobian. The engine (for the model's inputs) and the config (for ``input.key``) refuse
        them for several inputs with this reason."""
        if self.parameters is not None:  # per-sample gradients of the weights: any number of inputs
            return None
        if self.reduce.kind != "none":
            return f"jacobian.reduce: {self.reduce.kind} is for one-input models"
        if self.aggregate:
            return "jacobian.aggregate: aggregates are for one-input models"
        return None


@dataclasses.dataclass(frozen=True)
class SelfCheck:
    """The run's self-check (``jacobian.self_check``): in each shard, ``samples`` samples per 4,096 ids,
    rounded up (at least one; chosen by a seeded generator keyed by the shard's first id), are recomputed
    one at a time by an independent per-sample method and judged against what the compute dtype achieves
    on the model at that sample (``transforms.self_check``); ``on_mismatch`` says whether a value beyond
    that bound stops the run (``fail``) or is logged and recorded (``warn``).
    ``samples`` 0 turns it off. Not part of the run's identity: it decides how results are checked,
    not what they are."""

    samples: int = 4
    on_mismatch: Literal["fail", "warn"] = "fail"


@dataclasses.dataclass(frozen=True)
class ShardRange:
    """Sample ids ``[start, stop)``: one Beam element, one shard.

    Which of its samples are bad is found by the worker that reads the range
    (``transforms.inputs.checks``): the shard holds the others, and lists the bad ones (its
    ``ShardRecord.rejected``). A range whose samples are all rejected has a shard of no rows.
    """

    start: int
    stop: int

    @property
    def rows(self) -> int:
        """The range's ids: the most rows its shard can hold."""
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class JobSpec:
    model: ModelSource
    files: tuple[SourceFile, ...]
    output_dir: str
    run_key: str  # identifies what the shards hold; shards from another run are never mixed in
    engine: EngineOptions = EngineOptions()
    samples_per_shard: int = 4096
    compression: str = "none"
    tf_threads: int | None = None  # TensorFlow threads per worker process; None keeps TF's default
    label_key: str | None = None  # the array of per-sample labels in each input file (outputs: label)
    # outputs: label with one label per file (``SourceFile.label``; ``jacobian.labels`` folders or table):
    # how the labels were given and the class names, the manifest's ``labels``. None otherwise.
    labels: dict[str, Any] | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the resolved config, for the manifest
    started_at: float = 0.0
    # Set by the planner (pipeline.plan); the defaults describe a fresh run.
    shard_ranges: tuple[ShardRange, ...] = ()  # empty: consecutive ranges of samples_per_shard from id 0
    file_rejects: tuple[Rejected, ...] = ()  # files that could not be opened at all (they have no ids)
    id_segments: tuple[tuple[int, int], ...] = ()  # id ranges added by successive (incremental) runs
    identity: dict[str, Any] = dataclasses.field(default_factory=dict)  # what run_key hashes, for messages
    # The loaded model's weights (``LoadedModel.fingerprint``), as found by the launcher's model check or
    # recorded by the shards this run keeps: a worker that loads other weights refuses to write.
    model_fingerprint: str | None = None
    # ``transforms.model_identity.model_identity`` of the model, read by the launcher (empty for a user's
    # pipeline): stored in every shard, and a worker that loads another model refuses to write.
    model_identity: dict[str, Any] = dataclasses.field(default_factory=dict)
    self_check: SelfCheck = SelfCheck()  # jacobian.self_check
    # The samples of a user's pipeline (``transforms.write_shards.pipeline_spec``): not planned from files, their
    # ids 0..n-1 are counted when every shard is written.
    open_ended: bool = False
    # This run's id (hex; its lease's), carried by its temporary files' names: at its end a run removes
    # only its own.
    run_id: str = ""
    # Whether the run holds the output folder's lease under ``run_id``: then each of its commits proves
    # it still does (``transforms.output.fence``).
    fenced: bool = False
    # input.on_bad_sample: "skip" leaves bad samples out and lists them; "error" stops the job at the first.
    on_bad_sample: Literal["error", "skip"] = "error"
    # Shards (names, ``layout.shard_name``) on disk computed from input files whose stamp changed since
    # (``pipeline.folder.stale_shards``): each stays until its replacement is committed. The worker keeps
    # one whose samples read as before (``samples_sha256``), else computes its range and the commit
    # replaces it (``transforms.job``); one already computed from the current stamps (a retried bundle)
    # is complete.
    stale: tuple[str, ...] = ()
    # Shard files (relative to the output folder) of this folder that no range of this run replaces:
    # deleted only once the new manifest is in place (``transforms.finalize``).
    obsolete: tuple[str, ...] = ()
    # The pieces of input files gone since the folder was computed (``SourceFile.removed``), in id order:
    # their ids stay taken, but no shard stores or rejects them (``transforms.trim``); not in ``files``.
    removed: tuple[SourceFile, ...] = ()
    # The folder's manifest's CRC32C of each of its shards that still holds the samples the manifest lists
    # for it (``samples_sha256``), by name: a kept shard whose bytes differ was changed after its run
    # committed it (edited, damaged on disk), and is computed again (``transforms.job``).
    listed_crc32c: tuple[tuple[str, str], ...] = ()

    def __reduce__(self):
        # Beam pickles the spec into every step, several times (a check, the graph, each bundle), and
        # compresses each pickle: a million files cost minutes and a copy of them per step. The files
        # travel as one compressed blob made once, under a token; a process that has them (the launcher,
        # a worker after its first step) takes its own copy instead of decoding another.
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "files"}
        token, blob = _packed(self.files)
        return _unpack_spec, (state, token, blob)

    @property
    def sample_shape(self) -> Shape:
        """One sample's shape, or ``{input name: shape}`` when the inputs name one array per model input."""
        return next((f.sample_shape for f in self.files if f.unreadable is None), self.files[0].sample_shape)

    @property
    def num_samples(self) -> int:
        return max(f.stop_id for f in (*self.files, *self.removed))

    @property
    def labelled(self) -> bool:
        """Whether the samples are read with labels (``outputs: label``): an array of each file
        (``label_key``) or each file's label (``labels``)."""
        return self.engine.needs_labels and (self.label_key is not None or self.labels is not None)

    def removed_in(self, start: int, stop: int) -> int:
        """How many ids of ``[start, stop)`` belong to removed files (``removed``)."""
        return sum(max(0, min(stop, f.stop_id) - max(start, f.first_id)) for f in self.removed)

    def ranges(self) -> list[ShardRange]:
        if self.shard_ranges:
            return list(self.shard_ranges)
        step = self.samples_per_shard
        return [ShardRange(lo, min(lo + step, self.num_samples)) for lo in range(0, self.num_samples, step)]


_last_index: tuple[Any, Any] = (None, None)  # the files last searched, and their index (``_id_index``)


_packed_files: dict[str, tuple[SourceFile, ...]] = {}  # by token: the files of the specs this process holds
_blobs: dict[int, tuple[Any, str, bytes]] = {}  # by id of the files packed: the files, their token and blob
_KEPT = 4  # tokens kept (a process runs one job at a time; tests run many)


def _packed(files: tuple[SourceFile, ...]) -> tuple[str, bytes]:
    """The token and compressed pickle of ``files``, made once for each of the last files packed."""
    seen, token, blob = _blobs.get(id(files), (None, "", b""))
    if seen is not files:
        blob = zlib.compress(pickle.dumps(files, protocol=pickle.HIGHEST_PROTOCOL), 1)
        token = hashlib.sha256(blob).hexdigest()
        _remember(token, files)
        _blobs[id(files)] = (files, token, blob)
        while len(_blobs) > _KEPT:
            del _blobs[next(iter(_blobs))]
    return token, blob


def _remember(token: str, files: tuple[SourceFile, ...]) -> None:
    _packed_files[token] = files
    while len(_packed_files) > _KEPT:
        del _packed_files[next(iter(_packed_files))]


def _unpack_spec(state: dict[str, Any], token: str, blob: bytes) -> JobSpec:
    files = _packed_files.get(token)
    if files is None:
        files = pickle.loads(zlib.decompress(blob))
        _remember(token, files)
    return JobSpec(files=files, **state)


def _id_index(files: tuple[SourceFile, ...] | list[SourceFile]) -> tuple[list[int], list[int]] | None:
    """Each file's first id and the largest stop id up to it, for files in order of first id (as planned);
    None for files in another order. Kept for the files last searched: each shard range searches the
    same job's files, a million of them in a large job."""
    global _last_index
    searched, index = _last_index
    if searched is not files:
        starts = [f.first_id for f in files]
        reach = list(itertools.accumulate((f.stop_id for f in files), max))
        index = (starts, reach) if all(a <= b for a, b in zip(starts, starts[1:])) else None
        _last_index = (files, index)
    return index


def overlapping(files: tuple[SourceFile, ...] | list[SourceFile], start: int, stop: int) -> list[SourceFile]:
    """The files (pieces) holding samples of ids ``[start, stop)``, in their order."""
    index = _id_index(files)
    if index is None:
        candidates = files
    else:  # the files from the first that reaches past ``start`` to the last that begins before ``stop``
        starts, reach = index
        candidates = files[bisect.bisect_right(reach, start):bisect.bisect_left(starts, stop)]
    return [f for f in candidates if f.num_samples and f.first_id < stop and start < f.stop_id]


def shard_inputs(files: tuple[SourceFile, ...] | list[SourceFile], start: int, stop: int) -> list[list[Any]]:
    """The input files whose ids overlap ``[start, stop)``: ``[path, key, first_id, num_samples, data_sha256]``
    (``data_sha256`` None since the plan reads headers only; a shard written before lists its file's), and
    ``first_row`` after them for the rows appended to a file (``SourceFile.first_row``).

    A shard stores this, so that a later run can tell whether the shard's ids still mean the same samples.
    """
    return [[f.path, f.key, f.first_id, f.num_samples, f.data_sha256, *([f.first_row] if f.first_row else [])]
            for f in overlapping(files, start, stop)]


def input_labels(files: tuple[SourceFile, ...] | list[SourceFile], start: int, stop: int) -> dict[str, int | None]:
    """The labels (``SourceFile.label``) of the input files whose ids overlap ``[start, stop)``, by path: a
    shard stores them (``jacobian.labels`` folders or table), and a later run that finds another label for
    one of its files computes it again (``pipeline.labels.relabelled_shards``)."""
    return {f.path: f.label for f in overlapping(files, start, stop)}


def input_stamps(files: tuple[SourceFile, ...] | list[SourceFile], start: int, stop: int) -> dict[str, str | None]:
    """The stamps (``SourceFile.stamp``: size and time of the last change) of the input files whose ids
    overlap ``[start, stop)``, by path: a shard stores them, and a later run that finds another stamp
    reads the shard's samples again (``JobSpec.stale``)."""
    return {f.path: f.stamp for f in overlapping(files, start, stop)}
