"""What flows between the transforms: batches of samples in, batches of Jacobian records out.

A Beam element is a batch, never one sample (per-element overhead in the Python SDK is tens of
microseconds). Both types are plain numpy and picklable; between fused steps Beam passes them by
reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jacobeam.transforms.spec import Rejected, ShardRange

Inputs = np.ndarray | dict[str, np.ndarray]  # (n, *input_shape), or per input name for several inputs


@dataclasses.dataclass(frozen=True)
class RangeRead:
    """What reading a planned range found (``transforms.inputs.checks.RangeFindings`` as plain data): its
    rejected samples and the sha256 of the samples kept. ``ReadSamples`` sets it on a range's last batch,
    ``ComputeJacobians`` hands it on, ``WriteShards`` stores it in the range's shard."""

    rejected: tuple[Rejected, ...]
    samples_sha256: str


@dataclasses.dataclass
class SampleBatch:
    """``n`` samples: ``ids`` ``(n,)`` (int64 sample ids, or a user's keys), ``inputs`` ``(n, *input_shape)``
    (or a dict per input name), ``labels`` ``(n,)`` each sample's target output (``outputs: label``).

    ``shard`` is the planned shard the samples belong to (``ReadSamples`` sets it); ``WriteShards``
    writes such batches as they come, without grouping them first.
    """

    ids: np.ndarray
    inputs: Inputs
    labels: np.ndarray | None = None
    shard: ShardRange | None = None
    read: RangeRead | None = None  # on a planned range's last batch: what reading the range found

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass
class JacobianBatch:
    """The datasets to store for ``n`` samples, as ``JacobianEngine.compute`` makes them (``"jacobian"``
    ``(n, *output_shape, *input_shape)``, ``"output"`` ``(n, *output_shape)``, ...), with the samples'
    ``ids`` and ``shard``.

    ``partial`` holds the batch's float64 partial sums for ``jacobian.aggregate``; ``seconds`` the
    compute time; ``engine`` what the engine ran (``JacobianEngine.describe()``) and ``worker`` the
    process (``pid``, ``engine_builds``), for the manifest. ``checks`` are the records of the self-check
    of samples of this batch (``transforms.self_check``), if any. The arrays may be read-only views of
    the engine's result buffers (copy one to change it in place).
    """

    ids: np.ndarray
    datasets: dict[str, np.ndarray]
    shard: ShardRange | None = None
    partial: dict[str, np.ndarray] | None = None
    seconds: float = 0.0
    engine: dict[str, Any] | None = None
    worker: dict[str, int] | None = None
    checks: list[dict[str, Any]] | None = None
    read: RangeRead | None = None  # on a planned range's last batch (``SampleBatch.read``)

    def __len__(self) -> int:
        return len(self.ids)

    def records(self) -> Iterator[tuple[Any, dict[str, np.ndarray]]]:
        """One ``(id, {dataset: array})`` per sample, e.g. ``| beam.FlatMap(JacobianBatch.records)``."""
        for i, key in enumerate(self.ids):
            yield _plain(key), {name: values[i] for name, values in self.datasets.items()}


def _plain(key: Any) -> Any:
    return key.item() if isinstance(key, np.generic) else key


def stack_samples(examples: list[Any]) -> SampleBatch:
    """A ``SampleBatch`` of single samples: arrays, dicts of arrays (several inputs), or ``(key, sample)``.

    Unkeyed samples get no ids (``ids`` of ``None`` keys); ``WriteShards`` needs integer ids.
    """
    keyed = isinstance(examples[0], tuple)
    keys = [example[0] for example in examples] if keyed else [None] * len(examples)
    samples = [example[1] for example in examples] if keyed else examples
    if isinstance(samples[0], Mapping):
        inputs: Inputs = {name: np.stack([sample[name] for sample in samples]) for name in samples[0]}
    else:
        inputs = np.stack(samples)
    if all(isinstance(key, (int, np.integer)) and not isinstance(key, bool) for key in keys):
        ids = np.asarray(keys, np.int64)
    else:
        ids = np.empty(len(keys), object)
        ids[:] = keys
    return SampleBatch(ids=ids, inputs=inputs)


def take(batch: SampleBatch, lo: int, hi: int) -> SampleBatch:
    """Samples ``lo..hi`` of a batch."""
    inputs = {k: v[lo:hi] for k, v in batch.inputs.items()} if isinstance(batch.inputs, dict) else batch.inputs[lo:hi]
    labels = None if batch.labels is None else batch.labels[lo:hi]
    read = batch.read if hi >= len(batch) else None  # with the range's last samples
    return SampleBatch(ids=batch.ids[lo:hi], inputs=inputs, labels=labels, shard=batch.shard, read=read)
