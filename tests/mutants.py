"""Engine faults for the checkers' mutation tests: wrong values made as a systematic bug would make them,
in every sample of a batch, on the inputs users have (docs/verifying.md, "How the checks are tested").

A mutant takes a batch's datasets as the engine returned them (and a ``Batch``: what else a bug could
have used) and returns the datasets a faulty engine would have: the results scaled, negated or zeroed,
one row replaced, the rows of another output (with the stored ``output_index`` still the right one), a
reduction computed wrongly, the small rows negated, each batch's samples shifted by one, a softmax's small
probabilities zeroed, or a ``top_k``'s last rank the smallest output.

The inputs: standard-normal images, images with flat regions (the README's bars) through the README's
model (Conv2D without bias, ReLU, MaxPool, Dense), a tanh MLP whose units saturate, and a softmax
classifier whose probabilities are peaked, and one more confident still (some samples' second largest
probability below 1e-5).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import keras
import numpy as np

from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import seeded_weights, wrap_model
from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction

RESULTS = ("jacobian", "saliency", "projection")
OUTPUTS = {
    "all": EngineOptions(batch_size=8),
    "label": EngineOptions(batch_size=8, outputs=OutputSelection("label")),
    "top_k": EngineOptions(batch_size=8, outputs=OutputSelection("top_k", k=2)),
    "reduction": EngineOptions(batch_size=8, reduce=Reduction("max_abs_over_outputs")),
    "projection": EngineOptions(batch_size=8, reduce=Reduction("project", project_dim=8, project_seed=3)),
}


def bar_images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The README's quickstart images: a bar of ones at a random place on zeros; the label its column band."""
    rng = np.random.default_rng(seed)
    images = np.zeros((n, 28, 28, 1), np.float32)
    rows, cols = rng.integers(2, 20, n), rng.integers(0, 20, n)
    for image, row, col in zip(images, rows, cols):
        image[row : row + 8, col : col + 3] = 1.0
    return images, cols // 2


@functools.cache
def readme_cnn(dtype: str = "float32") -> keras.Model:
    """The README's quickstart model, trained for a few seconds on its bar images (once per process)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1), dtype=dtype),
        keras.layers.Conv2D(16, 3, activation="relu", use_bias=False, dtype=dtype),  # blank pixels pass no gradient
        keras.layers.MaxPooling2D(dtype=dtype),
        keras.layers.Flatten(dtype=dtype),
        keras.layers.Dense(10, dtype=dtype),
    ])
    images, labels = bar_images(400)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(images, labels, epochs=3, verbose=0)
    return model


def tanh_mlp(dtype: str = "float32") -> keras.Model:
    """x[12] -> Dense 32 tanh -> Dense 10, seeded: with inputs of scale 6 most units saturate."""
    model = keras.Sequential([keras.Input((12,), dtype=dtype), keras.layers.Dense(32, activation="tanh", dtype=dtype),
                              keras.layers.Dense(10, dtype=dtype)])
    seeded_weights(model, 1)
    return model


def peaked_softmax(dtype: str = "float32") -> keras.Model:
    """x[12] -> Dense 32 tanh -> Dense 10 softmax, its logits 8x the seeded scale: peaked probabilities."""
    model = keras.Sequential([keras.Input((12,), dtype=dtype), keras.layers.Dense(32, activation="tanh", dtype=dtype),
                              keras.layers.Dense(10, activation="softmax", dtype=dtype)])
    seeded_weights(model, 2)
    kernel, bias = model.layers[1].get_weights()
    model.layers[1].set_weights([8 * kernel, 8 * bias])
    return model


def confident_softmax(dtype: str = "float32", factor: float = 2.0) -> keras.Model:
    """The peaked softmax with its logits ``factor`` times larger still: at 2, the second largest probability of
    some samples below 1e-5, ``1 - p`` of the largest still some hundreds of float32's units; at 3, of one
    sample 1.2e-8, which float32 cannot resolve."""
    model = peaked_softmax(dtype)
    kernel, bias = model.layers[1].get_weights()
    model.layers[1].set_weights([factor * kernel, factor * bias])
    return model


def inputs(case: str, n: int) -> tuple[Callable[[], keras.Model], np.ndarray, np.ndarray]:
    """``(model factory, samples, labels)`` of one kind of input."""
    rng = np.random.default_rng(5)
    if case == "flat_images":
        x, labels = bar_images(n, seed=1)
        return readme_cnn, x, labels
    if case == "gaussian":
        return readme_cnn, rng.normal(size=(n, 28, 28, 1)).astype(np.float32), rng.integers(0, 10, n)
    if case == "saturated_tanh":
        return tanh_mlp, (6 * rng.normal(size=(n, 12))).astype(np.float32), rng.integers(0, 10, n)
    if case == "peaked_softmax":
        return peaked_softmax, rng.normal(size=(n, 12)).astype(np.float32), rng.integers(0, 10, n)
    if case == "confident_softmax":
        return confident_softmax, rng.normal(size=(n, 12)).astype(np.float32), rng.integers(0, 10, n)
    raise ValueError(case)


CASES = ("gaussian", "flat_images", "saturated_tanh", "peaked_softmax", "confident_softmax")


@dataclasses.dataclass
class Batch:
    """What a faulty engine could have computed from: the samples, labels and model (``full``: every
    sample's full Jacobian, ``(n, m, d)``, from an engine of the same model storing all rows)."""

    model: keras.Model
    options: EngineOptions
    x: np.ndarray
    labels: np.ndarray
    full: np.ndarray


def result(datasets: dict) -> str:
    return next(name for name in datasets if name in RESULTS or name.startswith("jacobian/"))


def _rows(datasets: dict) -> np.ndarray:
    """The result as ``(n, rows, entries)``: one row per output row, per selected row, or one in all."""
    name = result(datasets)
    values = datasets[name]
    if name == "saliency":
        rows = 1
    elif "output_index" in datasets:
        rows = datasets["output_index"].shape[1]
    else:
        rows = int(np.prod(datasets["output"].shape[1:]))
    return values.reshape(len(values), rows, -1)


def _on_result(change):
    def mutant(datasets: dict, batch: Batch) -> dict:
        name = result(datasets)
        rows = _rows(datasets).copy()
        return {**datasets, name: change(rows, batch).reshape(datasets[name].shape).astype(datasets[name].dtype)}
    return mutant


def _one_row_replaced(rows: np.ndarray, batch: Batch) -> np.ndarray:
    rng = np.random.default_rng(0)
    scale = np.abs(rows[:, -1]).max(axis=1, keepdims=True)
    rows[:, -1] = rng.normal(size=rows[:, -1].shape) * np.where(scale > 0, scale, 1.0)
    return rows


def _small_rows_negated(rows: np.ndarray, batch: Batch) -> np.ndarray:
    """Rows at most 1/100 of the sample's largest negated; where there are none, the smallest row."""
    size = np.abs(rows).max(axis=2)
    small = size <= size.max(axis=1, keepdims=True) / 100
    small[~small.any(axis=1), :] = size[~small.any(axis=1)] == size[~small.any(axis=1)].min(axis=1, keepdims=True)
    rows[small] *= -1
    return rows


def _wrong_rows(datasets: dict, batch: Batch) -> dict:
    """The rows of the next output (``output_index`` as it should be); all rows: each row holds the next one's."""
    name, m = result(datasets), batch.full.shape[1]
    if batch.options.reduce.kind == "max_abs_over_outputs":
        return None  # one row made of every output: no other row to take
    if "output_index" in datasets:
        index = (datasets["output_index"] + 1) % m
        taken = np.take_along_axis(batch.full, index[:, :, None], axis=1)
    else:
        taken = np.roll(batch.full, -1, axis=1)
    if batch.options.reduce.kind == "project":
        taken = taken @ _projection(batch, batch.options.reduce.project_seed)
    return {**datasets, name: taken.reshape(datasets[name].shape).astype(datasets[name].dtype)}


def _projection(batch: Batch, seed: int) -> np.ndarray:
    d, dim = batch.full.shape[2], batch.options.reduce.project_dim
    return np.random.default_rng(seed).choice([-1.0, 1.0], size=(d, dim)) / np.sqrt(dim)


def _wrong_reduction(datasets: dict, batch: Batch) -> dict | None:
    """max over outputs computed as a min; the projection drawn from another seed."""
    name, kind = result(datasets), batch.options.reduce.kind
    if kind == "max_abs_over_outputs":
        wrong = np.abs(batch.full).min(axis=1)
    elif kind == "project":
        wrong = batch.full @ _projection(batch, batch.options.reduce.project_seed + 1)
    else:
        return None  # nothing reduced
    return {**datasets, name: wrong.reshape(datasets[name].shape).astype(datasets[name].dtype)}


def _rolled(datasets: dict, batch: Batch) -> dict:
    """Each sample stored with the next sample's values (the batch's rows shifted by one)."""
    return {name: np.roll(values, -1, axis=0) for name, values in datasets.items()}


def _small_outputs_zeroed(datasets: dict, batch: Batch) -> dict | None:
    """A softmax's probabilities at most 1e-5 of the sample's largest stored as 0 (where there are none, the
    smallest): each is computed to its own relative precision, a log-probability of -inf is no rounding."""
    output = np.asarray(datasets["output"], np.float64).reshape(len(batch.x), -1)
    if not np.allclose(output.sum(axis=1), 1.0, atol=1e-5) or (output < 0).any():
        return None  # not probabilities: judged at the scale of the largest output
    small = output <= output.max(axis=1, keepdims=True) * 1e-5  # far below the largest's tolerance, 1e-4 of it
    none = ~small.any(axis=1)
    small[none] = output[none] == output[none].min(axis=1, keepdims=True)
    return {**datasets, "output": np.where(small, 0.0, output).reshape(datasets["output"].shape).astype(datasets["output"].dtype)}


def _last_choice_smallest(datasets: dict, batch: Batch) -> dict | None:
    """``top_k``: the last rank's row is the smallest output's (``output_index`` saying so, its rows that
    output's): a choice float32 could not have made, which a band as wide as the largest output hid."""
    if batch.options.outputs.rule != "top_k":
        return None
    output = np.asarray(datasets["output"], np.float64).reshape(len(batch.x), -1)
    index = np.array(datasets["output_index"])
    index[:, -1] = np.argmin(output, axis=1)
    rows = np.take_along_axis(batch.full, index[:, :, None], axis=1)
    name = result(datasets)
    return {**datasets, "output_index": index.astype(datasets["output_index"].dtype),
            name: rows.reshape(datasets[name].shape).astype(datasets[name].dtype)}


MUTANTS: dict[str, Callable[[dict, Batch], dict | None]] = {
    "scaled_1.5": _on_result(lambda rows, batch: 1.5 * rows),
    "negated": _on_result(lambda rows, batch: -rows),
    "zeroed": _on_result(lambda rows, batch: 0 * rows),
    "one_row_replaced": _on_result(_one_row_replaced),
    "wrong_rows": _wrong_rows,
    "wrong_reduction": _wrong_reduction,
    "small_rows_negated": _on_result(_small_rows_negated),
    "batch_rolled": _rolled,
    "small_outputs_zeroed": _small_outputs_zeroed,
    "last_choice_smallest": _last_choice_smallest,
}


def batch(case: str, output: str, n: int = 8) -> tuple[JacobianEngine, Batch, dict]:
    """An engine of ``case``'s model for ``output``, a batch of ``n`` of its inputs, and what it stores."""
    factory, x, labels = inputs(case, n)
    model = factory()
    options = OUTPUTS[output]
    engine = JacobianEngine(wrap_model(model, case), model.input_shape[1:], options)
    everything = JacobianEngine(wrap_model(model, case), model.input_shape[1:], EngineOptions(batch_size=8))
    full = everything(x)["jacobian"].reshape(n, int(np.prod(model.output_shape[1:])), -1).astype(np.float64)
    stored = engine(x, labels if options.outputs.rule == "label" else None)
    return engine, Batch(model, options, x, labels, full), stored
