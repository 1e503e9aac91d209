"""Jacobians through Beam's ``RunInference``: a ``ModelHandler`` whose "inference" is the Jacobian.

``RunInference(JacobianModelHandler(...))`` brings RunInference's own batching, per-process model
sharing and metrics. Unlike Beam's TensorFlow handler it needs no ``tensorflow_hub``, and TensorFlow is
imported only when a worker loads the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from jacobeam.transforms.spec import EngineOptions, ModelSource


class JacobianModelHandler(ModelHandler[np.ndarray, dict, Any]):
    """A Beam ``ModelHandler`` for ``RunInference`` whose inference is each sample's Jacobian.

    Args:
        model: where the model comes from (``ModelSource(path=...)``, ``factory=`` or ``builtin=``).
        input_shape: one sample's shape, or ``{input name: shape}`` for a model with several inputs.
        options: the engine's options (mode, XLA, memory budget, what to store).
        **batching: Beam's batching keywords (``min_batch_size``, ``max_batch_size``, ...), passed to
            ``BatchElements``; ``max_batch_size`` defaults to ``options.batch_size``.

    Examples are single samples, numpy arrays of shape ``input_shape`` (dicts ``{input name: array}``
    for several inputs). Each ``PredictionResult.inference`` is a dict of that sample's datasets:
    ``"jacobian"`` ``(*output_shape, *input_shape)`` (or ``"jacobian/<input name>"`` per differentiated
    input), ``"output"`` ``(*output_shape)``, and what ``options`` selects or reduces (see
    ``transforms.engine.JacobianEngine``). ``inference_args={"labels": ...}`` passes a batch's labels
    for ``outputs: label``.

    Raises:
        ModelError: (in ``load_model``, on a worker) the model does not take such samples, or cannot be
            differentiated as ``options`` ask.
    """

    def __init__(
        self,
        model: ModelSource,
        input_shape: Sequence[int] | Mapping[str, Sequence[int]],
        options: EngineOptions = EngineOptions(),
        **batching: Any,
    ):
        batching.setdefault("max_batch_size", options.batch_size)
        super().__init__(**batching)
        self._model = model
        self._input_shape = (
            {name: tuple(shape) for name, shape in input_shape.items()}
            if isinstance(input_shape, Mapping)
            else tuple(input_shape)
        )
        self._options = options

    def load_model(self):
        """The engine: built, checked and warmed up once per worker process (RunInference shares it)."""
        from jacobeam.transforms.engine import JacobianEngine

        return JacobianEngine(self._model.load(), self._input_shape, self._options)

    def run_inference(
        self, batch: Sequence[np.ndarray], model, inference_args: dict[str, Any] | None = None
    ) -> Iterable[PredictionResult]:
        labels = (inference_args or {}).get("labels")
        if isinstance(batch[0], Mapping):
            stacked = {name: np.stack([example[name] for example in batch]) for name in batch[0]}
        else:
            stacked = np.stack(batch)
        datasets = model(stacked, labels)
        model_id = model.fingerprint[:16]
        for i, example in enumerate(batch):
            yield PredictionResult(example, {name: value[i] for name, value in datasets.items()}, model_id)

    def get_num_bytes(self, batch: Sequence[np.ndarray]) -> int:
        parts = [part for example in batch for part in (example.values() if isinstance(example, Mapping) else [example])]
        return sum(np.asarray(part).nbytes for part in parts)

    def get_metrics_namespace(self) -> str:
        from jacobeam.transforms.metrics import NAMESPACE

        return NAMESPACE
