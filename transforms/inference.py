"""Jacobians through Beam's ``RunInference``: a ``ModelHandler`` whose "inference" is the Jacobian.

``RunInference(JacobianModelHandler(...))`` brings RunInference's own batching, per-process model
sharing and metrics. Unlike Beam's TensorFlow handler it needs no ``tensorflow_hub``, and TensorFlow is
imported only when a worker loads the model. With ``outputs: label`` each example is a ``(sample,
label)`` pair, so that a label stays with its sample however RunInference batches them (its
``inference_args`` are one value for every batch, and the handler refuses them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from jacobeam.transforms.spec import EngineOptions, ModelSource


class JacobianModelHandler(ModelHandler[Any, dict, Any]):
    """A Beam ``ModelHandler`` for ``RunInference`` whose inference is each sample's Jacobian.

    Args:
        model: where the model comes from (``ModelSource(path=...)``, ``factory=`` or ``builtin=``).
        input_shape: one sample's shape, or ``{input name: shape}`` for a model with several inputs.
        options: the engine's options (mode, XLA, memory budget, what to store).
        **batching: Beam's batching keywords (``min_batch_size``, ``max_batch_size``, ...), passed to
            ``BatchElements``; ``max_batch_size`` defaults to ``options.batch_size``.

    Examples are single samples, numpy arrays of shape ``input_shape`` (dicts ``{input name: array}``
    for several inputs); with ``options.outputs`` ``label``, ``(sample, label)`` pairs, the label being
    the index of the output row to differentiate. Each ``PredictionResult`` holds the example as it came
    and, as ``inference``, a dict of that sample's datasets: ``"jacobian"`` ``(*output_shape,
    *input_shape)`` (or ``"jacobian/<input name>"`` per differentiated input), ``"output"``
    ``(*output_shape)``, and what ``options`` selects or reduces (see ``transforms.engine.JacobianEngine``).
    The handler takes no ``inference_args``: RunInference passes the same ones to every batch, so labels
    travel with their samples instead.

    Raises:
        ValueError: (in ``RunInference``) ``inference_args`` are given; (in ``run_inference``) an example
            is not a ``(sample, label)`` pair where ``outputs`` is ``label``.
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

    def validate_inference_args(self, inference_args: dict[str, Any] | None) -> None:
        if inference_args:
            raise ValueError(
                f"JacobianModelHandler takes no inference_args (got {sorted(inference_args)}): they are the same for "
                "every batch; with outputs: label, give (sample, label) examples"
            )

    def _split(self, batch: Sequence[Any]) -> tuple[Sequence[Any], np.ndarray | None]:
        """The batch's samples, and its labels where ``outputs`` is ``label`` (else None)."""
        if self._options.outputs.rule != "label":
            return batch, None
        for example in batch:
            if not (isinstance(example, tuple) and len(example) == 2):
                raise ValueError(f"outputs: label needs (sample, label) examples; got a {type(example).__name__}")
        return [sample for sample, _ in batch], np.array([label for _, label in batch])

    def run_inference(
        self, batch: Sequence[Any], model, inference_args: dict[str, Any] | None = None
    ) -> Iterable[PredictionResult]:
        samples, labels = self._split(batch)
        if isinstance(samples[0], Mapping):
            stacked = {name: np.stack([sample[name] for sample in samples]) for name in samples[0]}
        else:
            stacked = np.stack(samples)
        datasets = model(stacked, labels)
        model_id = model.fingerprint[:16]
        for i, example in enumerate(batch):
            yield PredictionResult(example, {name: value[i] for name, value in datasets.items()}, model_id)

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        samples, _ = self._split(batch)
        parts = [part for sample in samples for part in (sample.values() if isinstance(sample, Mapping) else [sample])]
        return sum(np.asarray(part).nbytes for part in parts)

    def get_metrics_namespace(self) -> str:
        from jacobeam.transforms.metrics import NAMESPACE

        return NAMESPACE
