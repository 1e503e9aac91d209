"""Checks of a model against the samples it will get, before anything is differentiated."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from jacobeam.transforms.engine.diagnostics import AGREEMENT, per_sample_relative_error
from jacobeam.transforms.engine.models import LoadedModel
from jacobeam.transforms.errors import ModelError


def resolve_inputs(
    model: LoadedModel, shapes: Sequence[int] | Mapping[str, Sequence[int]], where: str = ""
) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """The model's input names and the samples' shape for each, checked against what it declares.

    Args:
        model: the loaded model.
        shapes: one sample's shape, or ``{input name: shape}`` for a model with several inputs.
        where: where the samples come from, for messages (e.g. ``" (data/x.npy)"``).

    Returns:
        The input names in the model's order, and the samples' shape for each, in that order.

    Raises:
        ModelError: the samples are not one array per model input, or a shape is not what the model
            declares.
    """
    names = model.input_names
    if not isinstance(shapes, Mapping):
        if len(names) != 1:
            raise ModelError(
                f"{model.source} takes inputs {list(names)}; the inputs hold one array per sample, of shape "
                f"{tuple(shapes)}{where}: set input.key to a mapping {{input name: array}} that names one array per input"
            )
        shapes = {names[0]: tuple(shapes)}
    if set(names) != set(shapes):
        raise ModelError(
            f"{model.source} takes inputs {sorted(names)}; input.key names inputs {sorted(shapes)}: "
            "they must be the same names"
        )
    found = tuple(tuple(int(d) for d in shapes[name]) for name in names)
    for name, want, got in zip(names, model.input_shapes or (), found):
        if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got)):
            label = f"input {name} of shape" if len(names) > 1 else "samples of shape"
            raise ModelError(f"{model.source} expects {label} {tuple(want)}; the inputs hold samples of shape {got}{where}")
    return names, found


def resolve_wrt(names: Sequence[str], wrt: Sequence[str] | None, source: str) -> list[int]:
    """Positions of the inputs to differentiate by (``jacobian.wrt``; None: all)."""
    if wrt is None:
        return list(range(len(names)))
    unknown = [name for name in wrt if name not in names]
    if unknown:
        typo = "; did you mean wrt: parameters (its weights)?" if "parameter" in unknown else ""
        raise ModelError(f"jacobian.wrt: {source} has no input(s) {unknown}; it has {list(names)}{typo}")
    return [list(names).index(name) for name in wrt]


def output_shape(
    forward: Callable[[Sequence[np.ndarray]], np.ndarray],
    probe: Sequence[np.ndarray],
    source: str,
    shapes: Sequence[tuple[int, ...]],
    check_batch_independence: bool,
    dtype: str,
) -> tuple[int, ...]:
    """One sample's output shape; and refuse a model whose samples interact inside a batch (per-sample
    Jacobians by ``batch_jacobian`` would then be wrong): each sample's outputs from the whole batch
    against those from its half, judged per sample. Runs at every set-up, reused decisions included."""
    try:
        y = forward(probe)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
        raise ModelError(f"{source}: cannot call the model on samples of shape(s) {list(shapes)}: {err}") from err
    n = len(y)
    if check_batch_independence and n >= 2:
        half = n // 2
        parts = np.concatenate([forward([x[:half] for x in probe]), forward([x[half:] for x in probe])])
        error = per_sample_relative_error(parts, y)
        if error > AGREEMENT[dtype]:
            raise ModelError(
                f"{source}: a sample's output depends on the other samples in its batch "
                f"(relative difference {error:.2g} between one batch and two halves), e.g. BatchNorm in "
                "training mode or a batch-level op; per-sample Jacobians by batch_jacobian would be wrong"
            )
    return tuple(int(d) for d in y.shape[1:])
