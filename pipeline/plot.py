"""``jacobeam inspect OUT --plot FILE.png``: a picture of what an output folder holds.

Image-shaped inputs ``(H, W, C)`` get one row per sample: the input and its saliency (``|J|`` reduced
over outputs and channels); other inputs get a heatmap of each sample's Jacobian matrix (flattened
outputs by flattened inputs), one per input for a model with several inputs. Below them, a histogram
of per-sample Jacobian norms. Uses matplotlib (the ``plot`` extra), imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jacobeam.transforms.inputs.readers import iter_slices, manifest_sources
from jacobeam.transforms.output.layout import VIEW, jacobian_dataset

_NORM_CHUNK = 256  # samples read at a time for the norms histogram


def _input_samples(manifest: dict[str, Any], ids: Sequence[int]) -> np.ndarray:
    """The input rows of one-input samples ``ids``: ``(len(ids), *input_shape)``."""
    files = manifest_sources(manifest)
    rows = []
    for i in ids:
        (_, sample, _), = iter_slices(files, i, i + 1, 1)
        rows.append(sample[0])
    return np.stack(rows)


def _norms(view, jacobians: Sequence[str]) -> tuple[np.ndarray, str]:
    """Per-sample Frobenius norms of the stored Jacobian (of every input's Jacobian together)."""
    if "frobenius" in view:
        return view["frobenius"][:], "Frobenius norm"
    norms = []
    for lo in range(0, len(view[jacobians[0]]), _NORM_CHUNK):
        blocks = [view[name][lo : lo + _NORM_CHUNK].astype(np.float64) for name in jacobians]
        norms.append(np.sqrt(sum((block.reshape(len(block), -1) ** 2).sum(axis=1) for block in blocks)))
    return np.concatenate(norms), "Frobenius norm of J"


def plot(folder: str, manifest: dict[str, Any], path: str, ids: Sequence[int] | None = None) -> Path:
    """Draw the figure for ``folder`` into ``path`` (PNG); ``ids`` defaults to the first four samples."""
    import h5py
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = manifest["input_shape"]
    # One Jacobian per differentiated input: {dataset: that input's shape}.
    named = shapes if isinstance(shapes, dict) else {None: shapes}
    inputs = {jacobian_dataset(name, isinstance(shapes, dict)): tuple(shape) for name, shape in named.items()}
    input_shape = next(iter(inputs.values()))
    image_like = len(inputs) == 1 and len(input_shape) == 3
    with h5py.File(Path(folder) / VIEW, "r") as view:
        # Row r holds sample id sample_id[r]: the same unless samples were rejected (on_bad_sample: skip).
        stored_ids = view["sample_id"][:]
        row_of = {int(sample_id): row for row, sample_id in enumerate(stored_ids)}
        ids = list(ids if ids is not None else (int(i) for i in stored_ids[:4]))
        bad = [i for i in ids if i not in row_of]
        if bad:
            gaps = " (rejected samples have no row)" if len(stored_ids) < stored_ids[-1] + 1 else ""
            raise ValueError(f"--samples {bad}: ids run from {stored_ids[0]} to {stored_ids[-1]}{gaps}")
        rows = [row_of[i] for i in ids]
        jacobians = [name for name in inputs if isinstance(view.get(name), h5py.Dataset)]  # jacobian.wrt's
        maps = {  # (samples, rows, d) per input
            name: np.stack([view[name][r] for r in rows]).astype(np.float64).reshape(len(ids), -1, int(np.prod(inputs[name])))
            for name in jacobians
        }
        if not maps and "saliency" not in view:
            raise ValueError(f"{folder}: holds neither jacobian nor saliency to plot")
        saliency = None
        if image_like:
            if maps:
                full = maps["jacobian"]
                saliency = np.abs(full).reshape(len(ids), full.shape[1], *input_shape).sum(axis=(1, 4))
            else:
                stored = np.stack([view["saliency"][r] for r in rows]).astype(np.float64)
                saliency = stored.reshape(len(ids), -1, *input_shape[:2]).sum(axis=1) if stored.ndim > 3 else stored
        norms, norm_label = _norms(view, jacobians) if (jacobians or "frobenius" in view) else (None, "")
    columns = max(2, len(maps)) if not image_like else 2
    figure = plt.figure(figsize=(4 * columns, 3 * len(ids) + 3), constrained_layout=True)
    grid = figure.add_gridspec(len(ids) + 1, columns)
    for row, sample_id in enumerate(ids):
        if image_like:
            image = _input_samples(manifest, [sample_id])[0]
            left = figure.add_subplot(grid[row, 0])
            left.imshow(image[..., 0] if image.shape[-1] == 1 else _unit(image), cmap="gray")
            left.set_title(f"sample {sample_id}: input")
            right = figure.add_subplot(grid[row, 1])
            shown = right.imshow(saliency[row], cmap="inferno")
            right.set_title(f"sample {sample_id}: saliency")
            figure.colorbar(shown, ax=right)
            continue
        for column, (name, matrices) in enumerate(maps.items()):
            axis = figure.add_subplot(grid[row, :] if len(maps) == 1 else grid[row, column])
            limit = float(np.abs(matrices[row]).max()) or 1.0  # centred: white is zero
            shown = axis.imshow(matrices[row], aspect="auto", cmap="coolwarm", vmin=-limit, vmax=limit)
            what = "Jacobian" if name == "jacobian" else f"d output / d {name.split('/', 1)[1]}"
            axis.set_title(f"sample {sample_id}: {what} ({matrices.shape[1]} output rows x {matrices.shape[2]} inputs)")
            figure.colorbar(shown, ax=axis)
    if image_like:
        figure.suptitle("saliency: |J| summed over outputs and channels")
    histogram = figure.add_subplot(grid[len(ids), :])
    if norms is not None:
        histogram.hist(norms, bins=min(50, max(5, len(norms) // 4)))
        histogram.set_xlabel(norm_label)
        histogram.set_ylabel("samples")
        histogram.set_title(f"per-sample norms over all {len(norms):,} samples")
    else:
        histogram.axis("off")
    target = Path(path)
    figure.savefig(target, dpi=80)
    plt.close(figure)
    return target


def _unit(image: np.ndarray) -> np.ndarray:
    low, high = float(image.min()), float(image.max())
    return (image - low) / (high - low) if high > low else np.zeros_like(image)
