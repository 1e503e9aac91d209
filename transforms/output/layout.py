"""The output folder's layout: every file, dataset and attribute name jacobeam writes, in one place.

Imports nothing else of jacobeam. ::

    OUT/
      shards/shard-<first id>-<stop id>.h5   one per id range; datasets: jacobian (or jacobian/<input>),
                                             output, output_index, reductions, sample_id, nonfinite;
                                             rejected_samples/runs (the range's rejected samples)
      shards/shard-....h5.crc32c             a remote shard's checksum sidecar (shards written before
                                             CRC32C: shard-....h5.sha256)
      jacobians.h5                           the virtual view over every shard, and each row's source
                                             (source_file, source_row, source_files)
      inputs.h5                              the input files, one row each (``inputs_table``)
      aggregates.h5                          aggregate statistics (jacobian.aggregate)
      rejected.jsonl                         samples rejected under on_bad_sample: skip
      engine-plan.json                       the engine's set-up decisions, a cache (see ENGINE_PLAN)
      manifest.json                          written last: the output exists once it does
      .jacobeam-overwrite/                   an --overwrite's new result, until it replaces the folder's
                                             (``pipeline.overwrite``): laid out as the folder
"""

from __future__ import annotations

import re

SHARDS_DIR = "shards"
MANIFEST = "manifest.json"
VIEW = "jacobians.h5"
AGGREGATES = "aggregates.h5"
INPUTS_TABLE = "inputs.h5"  # the input files' table (``transforms.output.inputs_table``); the manifest points at it
# The table the folder's manifest points at, kept while a run replaces it (``inputs_table.keep_previous``).
INPUTS_PREVIOUS = "inputs.previous.h5"
REJECTED_FILE = "rejected.jsonl"
CRC32C_SUFFIX = ".crc32c"  # a remote shard's sidecar: the CRC32C of its bytes
CHECKSUM_SUFFIX = ".sha256"  # the sidecar of a remote shard written before CRC32C: their sha256
CHECKSUM_SUFFIXES = (CRC32C_SUFFIX, CHECKSUM_SUFFIX)
# The engine's set-up decisions (path, sizes, output shape) for one model fingerprint, configuration,
# TensorFlow version and device, written by the worker that probed: a resumed or incremental run's
# workers reuse them instead of probing again. Only a cache: unreadable or for another key, it is ignored.
ENGINE_PLAN = "engine-plan.json"
# The one-writer lease (``transforms.output.lease``): created exclusively by the run that writes the
# folder, removed when it ends; jacobeam's own file, never alien, never removed for another run.
LEASE = ".jacobeam-lease.json"
# Where ``--overwrite`` computes the result that replaces the folder's (``pipeline.overwrite``).
OVERWRITE_DIR = ".jacobeam-overwrite"

# Datasets and attributes of a shard.
JACOBIAN = "jacobian"
SAMPLE_ID = "sample_id"
NONFINITE = "nonfinite"
SELF_CHECK = "self_check"  # the shard's self-check, as JSON
# The samples of the shard's range that its worker rejected (input.on_bad_sample: skip): a group holding
# one dataset, ``runs``, a JSON list of [file, reason, row, first id, stop id].
REJECTED_GROUP = "rejected_samples"
SAMPLES_SHA256 = "samples_sha256"  # attribute: sha256 of the stored samples' bytes as read, in id order
LABELS_SHA256 = "labels_sha256"  # attribute (outputs: label): sha256 of the stored samples' labels as read
INPUT_STAMPS = "input_stamps"  # attribute: {input path: stamp} of the files the shard's ids come from
INPUT_LABELS = "input_labels"  # attribute (jacobian.labels folders or table): {input path: label} of those files
OUTPUT = "output"
OUTPUT_INDEX = "output_index"
# Where each row of ``jacobians.h5`` came from (the view's own datasets, written at finalize, not read from
# the shards): ``source_file`` (n,) indexes ``source_files`` (m,), the input files' paths relative to the
# attribute ``source_root``; ``source_row`` (n,) is the row within that file.
SOURCE_FILE = "source_file"
SOURCE_ROW = "source_row"
SOURCE_FILES = "source_files"
SOURCE_ROOT = "source_root"
# Datasets that go with every result: the outputs, which rows were kept, ids, nonfinite flags, sources.
ROW_DATASETS = (OUTPUT, OUTPUT_INDEX, SAMPLE_ID, NONFINITE, SOURCE_FILE, SOURCE_ROW, SOURCE_FILES)

# The input path that the manifest of a user's pipeline's folder records (``pipeline_spec``): no file.
PIPELINE_INPUT = "(pipeline)"

WRITE_PROBE_PREFIX = ".jacobeam-write-test-"  # a writability probe's name: the prefix and a random hex

_SHARD_NAME = re.compile(r"^shard-(\d{12})-(\d{12})\.h5$")
# A temporary name ends in ``.tmp-<run id>-<random hex>`` (``.tmp-<hex>`` before runs had ids).
_TEMP_TAG = r"\.tmp-(?:(?P<run>[0-9a-f]+)-)?[0-9a-f]+$"
_SHARD_TEMP = re.compile(r"^\.shard-\d{12}-\d{12}\.h5" + _TEMP_TAG)
_FILE_TEMP = re.compile(
    r"^\.("
    + "|".join(re.escape(name) for name in (MANIFEST, VIEW, REJECTED_FILE, AGGREGATES, ENGINE_PLAN, INPUTS_TABLE,
                                                          INPUTS_PREVIOUS))
    + r")" + _TEMP_TAG
)
_PROBE = re.compile("^" + re.escape(WRITE_PROBE_PREFIX) + "[0-9a-f]+$")


def jacobian_dataset(input_name: str, several_inputs: bool) -> str:
    """The dataset of the Jacobian by one model input: ``jacobian``, or ``jacobian/<input>`` for a model
    with several inputs."""
    return f"{JACOBIAN}/{input_name}" if several_inputs else JACOBIAN


def result_datasets(names) -> list[str]:
    """The datasets among ``names`` (of a shard, ``jacobians.h5`` or the manifest's ``datasets``) that hold
    what ``jacobian.reduce`` kept: ``jacobian`` (or ``jacobian/<input>``), ``saliency``, ``sign`` and
    ``logabsdet``, ...; every per-sample dataset but ``ROW_DATASETS``, in the order given."""
    return [name for name in names if name not in ROW_DATASETS]


def shard_name(start: int, stop: int) -> str:
    return f"shard-{start:012d}-{stop:012d}.h5"


def shard_ids(name: str) -> tuple[int, int]:
    """The ids ``(start, stop)`` of a shard's file name (``shard_name``'s)."""
    found = _SHARD_NAME.match(name)
    return int(found.group(1)), int(found.group(2))


def shard_file(start: int, stop: int) -> str:
    """The shard's path relative to the output folder, as the manifest and the view name it."""
    return f"{SHARDS_DIR}/{shard_name(start, stop)}"


def temp_name(name: str, tag: str, run_id: str = "") -> str:
    """The temporary name under which ``name`` is written before its rename (``tag``: hex), carrying the
    id of the run writing it (hex), so that a run can tell its own temporary files from another's."""
    return f".{name}.tmp-{run_id}-{tag}" if run_id else f".{name}.tmp-{tag}"


def temp_run(name: str) -> str | None:
    """The run id in a temporary name (``temp_name``'s), or None (no run id, or not a temporary name)."""
    found = _SHARD_TEMP.match(name) or _FILE_TEMP.match(name)
    return found.group("run") if found else None


def is_shard_file(name: str) -> bool:
    return bool(_SHARD_NAME.match(name))


def is_checksum_file(name: str) -> bool:
    return any(name.endswith(suffix) and is_shard_file(name[: -len(suffix)]) for suffix in CHECKSUM_SUFFIXES)


def is_shard_temp(name: str) -> bool:
    """A shard's temporary file, or a writability probe, in ``shards/``."""
    return bool(_SHARD_TEMP.match(name) or _PROBE.match(name))


def is_folder_temp(name: str) -> bool:
    """A temporary file of the folder's own files, or a writability probe, at its top."""
    return bool(_FILE_TEMP.match(name) or _PROBE.match(name))
