"""``jacobeam inspect OUT --plot FILE.png``: a picture of what an output folder holds.

What is drawn follows the datasets ``jacobian.reduce`` stored in ``jacobians.h5``:

- one row of pictures per chosen sample (``--samples``; the first four by default), where the reduction
  keeps an array per sample:

  - one-input models of image-shaped inputs ``(H, W, C)``: the input, and a map over its pixels:
    ``reduce: none`` (whatever ``outputs`` selects), ``|J|`` summed over the stored output rows and the
    channels; ``max_abs_over_outputs``, the stored saliency's maximum over channels (``max |J|`` over
    outputs and channels); ``sum_abs_over_channels``, the stored saliency summed over the output rows;
    ``vjp``, ``|u_k^T J|`` summed over the channels, one map per vector (the first ``MAX_VECTOR_MAPS``);
    where several output rows were selected (``top_k``, ``indices``), also a map of each row (the first
    ``MAX_ROW_MAPS``), titled by its output index (and rank): a class's own saliency;
  - other inputs: each stored matrix as a heatmap (white is zero): the Jacobian's rows (the selected
    ones, named by ``output_index``) by flattened input entries, one per input for a model with several;
    ``vjp`` vectors by inputs, ``jvp`` vectors by outputs, ``projection`` rows by columns of ``P``,
    ``basis_projection`` ``p x q``, the saliency rows by entries;
  - ``diagonal``: the diagonal of ``J``, entry by entry;

- below them, a histogram over every stored sample of one number per sample: the Frobenius norm of
  ``J`` (``none``, ``frobenius``) or of the stored product (``vjp``, ``jvp``, ``project``, ``basis``), the
  trace (``trace``; ``diagonal``, its sum), ``log |det J|`` (``slogdet``; the title counts the signs), the
  largest ``|J|`` (``max_abs_over_outputs``) or the sum of ``|J|`` (``sum_abs_over_channels``). For the
  reductions to one number per sample (``frobenius``, ``trace``, ``slogdet``) the histogram is the
  picture; dashed lines mark the chosen samples. Non-finite values are left out (the title says how many).

Each sample is titled by its id; the first picture of its row also by its input file's name and its
row in that file (``source_file``, ``source_row`` of ``jacobians.h5``; an image, a file of one sample, by
its name alone). The input images are read from the input files the manifest lists. A folder written by a pipeline of the
user's own (``WriteShards``) lists none, and a moved or changed input file cannot be read: the maps are
then drawn beside a line saying so, and ``draw`` returns a one-line note saying why. Uses matplotlib (the ``plot`` extra),
imported only here.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jacobeam.transforms.engine.reductions import DESCRIPTIONS, PARAMETER_DESCRIPTIONS
from jacobeam.transforms.errors import JacobeamError
from jacobeam.transforms.finalize import view_datasets
from jacobeam.transforms.inputs.readers import from_a_pipeline, iter_slices, manifest_sources
from jacobeam.transforms.inputs.registry import IMAGE_SUFFIXES
from jacobeam.transforms.output.layout import (
    OUTPUT_INDEX,
    PIPELINE_INPUT,
    SAMPLE_ID,
    SOURCE_FILE,
    SOURCE_FILES,
    SOURCE_ROW,
    VIEW,
    jacobian_dataset,
    result_datasets,
)

_CHUNK = 256  # samples read at a time for the histogram
_BEFORE_NUMBER = re.compile(r" (?=\d)")  # a space a title's lines are not broken at
TITLE_CHARS = 34  # characters per title line in a 4-inch column at matplotlib's default title size (44 fill it;
# a title is centred on its axis, which tick labels and a colour bar push off the column's centre)
MAX_VECTOR_MAPS = 4  # vjp: maps of the first vectors only (a figure of dozens of columns cannot be read)
MAX_ROW_MAPS = 4  # selected output rows (top_k, indices): a map of each of the first rows, for the same reason


class SamplesNotStored(ValueError):
    """``--samples`` names ids the folder has no row of: a command line to fix (exit status 2)."""


@dataclasses.dataclass
class _Panel:
    """One column of the sample rows: a picture per chosen sample."""

    titles: list[str]  # per chosen sample, after "sample <id>: "
    pictures: list[np.ndarray]  # per chosen sample: a 2-D array, or 1-D for a curve
    style: str  # "map" (non-negative, over the input's pixels), "matrix" (signed heatmap), "curve", "layers" (bars)
    row_labels: list[list] | None = None  # per chosen sample, a matrix's rows (output indices), or the layers' names


_LAYERS_NAMED = 40  # a per-layer panel names its layers up to this many


@dataclasses.dataclass
class _Histogram:
    values: np.ndarray  # one per stored sample
    label: str
    marked: list[float] | None = None  # the chosen samples' values, marked with dashed lines
    title: str = ""


def _input_samples(manifest: dict[str, Any], ids: Sequence[int]) -> np.ndarray:
    """The input rows of one-input samples ``ids``: ``(len(ids), *input_shape)``."""
    files = manifest_sources(manifest)
    rows = []
    for i in ids:
        (_, sample, _), = iter_slices(files, i, i + 1, 1)
        rows.append(sample[0])
    return np.stack(rows)


def _sources(view, rows: Sequence[int]) -> list[str]:
    """Where each chosen row came from, for its titles (``source_file``, ``source_row``): ``digits.npy
    row 7``, or ``cat_001.png`` for an image (a file of one sample); empty in a view written before rows
    named their source, and for a pipeline of the user's own (no file to name)."""
    if SOURCE_FILE not in view:
        return ["" for _ in rows]
    files = view[SOURCE_FILES].asstr()[:]
    found = []
    for row in rows:
        path, within = str(files[int(view[SOURCE_FILE][row])]), int(view[SOURCE_ROW][row])
        name = path.rsplit("/", 1)[-1] + ("" if path.lower().endswith(IMAGE_SUFFIXES) else f" row {within}")
        found.append("" if path == PIPELINE_INPUT else name)
    return found


def _per_sample(view, names: Sequence[str], value: Callable[[list[np.ndarray]], np.ndarray]) -> np.ndarray:
    """``value`` of each stored sample, from the datasets ``names`` read ``_CHUNK`` rows at a time, in float64:
    ``value`` takes one block per dataset, each ``(rows, -1)``, and returns one number per row."""
    found = []
    for lo in range(0, len(view[names[0]]), _CHUNK):
        blocks = [view[name][lo : lo + _CHUNK].astype(np.float64) for name in names]
        found.append(value([block.reshape(len(block), -1) for block in blocks]))
    return np.concatenate(found) if found else np.zeros(0)


def _frobenius(blocks: list[np.ndarray]) -> np.ndarray:
    return np.sqrt(sum((block**2).sum(axis=1) for block in blocks))


def _count(number: int, what: str) -> str:
    return f"the {what}" if number == 1 else f"the {number} {what}s"


class _Contents:
    """What the folder's datasets give to draw for the chosen rows of ``jacobians.h5``."""

    def __init__(self, view, manifest: dict[str, Any], rows: list[int]):
        self.view, self.manifest, self.rows = view, manifest, rows
        shapes = manifest["input_shape"]
        named = shapes if isinstance(shapes, dict) else {None: shapes}
        # One Jacobian per differentiated input: {dataset: that input's shape}.
        self.inputs = {jacobian_dataset(name, isinstance(shapes, dict)): tuple(shape) for name, shape in named.items()}
        self.input_shape = next(iter(self.inputs.values()))
        self.image = len(self.inputs) == 1 and len(self.input_shape) == 3
        self.outputs = math.prod(manifest["output_shape"])
        self.index = self.chosen(OUTPUT_INDEX).astype(np.int64) if OUTPUT_INDEX in view else None
        stored = manifest.get("stored") or {}
        self.kind = stored.get("reduce") or self._inferred_kind()
        self.panels: list[_Panel] = []
        self.histograms: list[_Histogram] = []

    def _inferred_kind(self) -> str:  # manifests that do not record what was stored
        if "saliency" in self.view:
            same = tuple(self.view["saliency"].shape[1:]) == self.input_shape
            return "max_abs_over_outputs" if same else "sum_abs_over_channels"
        found = {"frobenius": "frobenius", "trace": "trace", "logabsdet": "slogdet", "diagonal": "diagonal",
                 "vjp": "vjp", "jvp": "jvp", "projection": "project", "basis_projection": "basis"}
        return next((kind for name, kind in found.items() if name in self.view), "none")

    def chosen(self, name: str) -> np.ndarray:
        """Dataset ``name``'s rows of the chosen samples."""
        return np.stack([self.view[name][row] for row in self.rows])

    def rows_text(self, k: int) -> str:
        """The output rows chosen sample ``k``'s Jacobian holds, in words."""
        if self.index is not None:
            return f"output rows {self.index[k].tolist()}"
        return _count(self.outputs, "output")

    def histogram(self, names: Sequence[str], value, label: str) -> None:
        self.histograms.append(_Histogram(_per_sample(self.view, names, value), label))

    def scalar(self, name: str, label: str, title: str = "") -> None:
        values = self.view[name][:].astype(np.float64)
        self.histograms.append(_Histogram(values, label, [float(values[row]) for row in self.rows], title))

    def matrices(self, name: str, title: Callable[[int, np.ndarray], str], rows: int | None = None,
                 output_rows: bool = False) -> None:
        """Each chosen sample's dataset ``name`` as a ``rows x -1`` heatmap (``rows``: its first axis);
        ``output_rows``: its rows are output rows, labelled with ``output_index`` where outputs were selected."""
        values = self.chosen(name).astype(np.float64)
        values = values.reshape(len(values), rows or (values.shape[1] if values.ndim > 2 else 1), -1)
        labels = [index.tolist() for index in self.index] if output_rows and self.index is not None else None
        self.panels.append(_Panel([title(k, m) for k, m in enumerate(values)], list(values), "matrix", labels))

    def _parameters(self, side: dict[str, Any]) -> None:
        """``wrt: parameters``: the distribution of per-sample gradient norms (GraNd scores for a loss), the
        mean norm per layer, the objective's distribution, a projection's or gradient's norms."""
        view, what = self.view, "gradient" if side.get("objective") != "outputs" else "Jacobian"
        if "frobenius" in view:
            self.scalar("frobenius", f"norm of the per-sample {what}")
            by_layer = self.chosen("frobenius_by_layer").astype(np.float64)
            titles = [f"norm per layer ({by_layer.shape[1]} layers, model order)"] * len(by_layer)
            layers = side.get("layers")
            names = [list(layers)] * len(by_layer) if layers and len(layers) == by_layer.shape[1] else None
            self.panels.append(_Panel(titles, list(by_layer), "layers", names))
        for name, label in (("projection", "norm of g P (estimates |g|)"), ("gradient", f"norm of the per-sample {what}")):
            if name in view:
                self.histogram([name], _frobenius, label)
        if "objective" in view:
            objective = side["objective"] if side["objective"] != "loss" else side.get("loss")
            self.scalar("objective", f"objective ({objective})")

    def collect(self) -> None:
        view, kind = self.view, self.kind
        side = (self.manifest.get("stored") or {}).get("parameters")
        if side is not None:
            self._parameters(side)
            return
        names = [name for name in self.inputs if name in view_datasets(view)]  # those of jacobian.wrt
        if names:
            self._jacobians(names)
        elif "saliency" in view:
            self._saliency()
        elif "diagonal" in view:
            diagonal = self.chosen("diagonal").astype(np.float64)
            titles = [f"diagonal of J ({d.size} entries)" for d in diagonal]
            self.panels.append(_Panel(titles, list(diagonal), "curve"))
            self.histogram(["diagonal"], lambda blocks: blocks[0].sum(axis=1), "trace of J (the diagonal's sum)")
        elif "vjp" in view:
            self._vjp()
        elif "jvp" in view:
            self.matrices("jvp", lambda k, m: f"J v for {len(m)} vectors (rows) x {m.shape[1]} outputs")
            self.histogram(["jvp"], _frobenius, "Frobenius norm of J v over all vectors")
        elif "projection" in view:
            rows = self.outputs if self.index is None else self.index.shape[1]
            self.matrices("projection", lambda k, m: f"J P ({self._rows_of_matrix(k, len(m))} x {m.shape[1]} columns of P)",
                          rows, output_rows=True)
            self.histogram(["projection"], _frobenius, "Frobenius norm of J P (estimates that of J)")
        elif "basis_projection" in view:
            self.matrices("basis_projection", lambda k, m: f"U^T J V ({m.shape[0]} x {m.shape[1]})")
            self.histogram(["basis_projection"], _frobenius, "Frobenius norm of U^T J V")
        for name, label in (("frobenius", "Frobenius norm of J"), ("trace", "trace of J")):
            if name in view:
                self.scalar(name, label)
        if "logabsdet" in view:
            signs = np.sign(view["sign"][:]) if "sign" in view else None
            counted = "" if signs is None else (
                f"sign of det J: {int((signs > 0).sum()):,} positive, {int((signs < 0).sum()):,} negative, "
                f"{int((signs == 0).sum()):,} zero"
            )
            self.scalar("logabsdet", "log |det J|", counted)
        if not self.panels and not self.histograms:
            self._other(kind)

    def _jacobians(self, names: list[str]) -> None:
        selected = " (the stored rows)" if self.index is not None else ""
        self.histogram(names, _frobenius, f"Frobenius norm of J{selected}")
        if self.image:
            height, width, channels = self.input_shape
            full = np.abs(self.chosen(names[0]).astype(np.float64)).reshape(len(self.rows), -1, height, width, channels)
            also = f" and the {channels} channels" if channels > 1 else ""
            titles = [f"|J| summed over {self.rows_text(k)}{also}" for k in range(len(self.rows))]
            self.panels.append(_Panel(titles, list(full.sum(axis=(1, 4))), "map"))
            self._row_maps(full.sum(axis=4), f"summed over the {channels} channels" if channels > 1 else "")
            return
        rows = self.outputs if self.index is None else self.index.shape[1]
        for name in names:
            what = "Jacobian" if name == "jacobian" else f"d output / d {name.split('/', 1)[1]}"
            self.matrices(name, lambda k, m, what=what: f"{what} ({self._rows_of_matrix(k, len(m))} x {m.shape[1]} inputs)",
                          rows, output_rows=True)

    def _row_maps(self, maps: np.ndarray, how: str) -> None:
        """Where outputs were selected (``top_k``, ``indices``) and a sample has several rows, a map of each
        (the first ``MAX_ROW_MAPS``): a class's own saliency, which the sum over the rows hides. ``maps``:
        ``(samples, rows, H, W)``, already ``|J|`` over the pixels."""
        if self.index is None or maps.shape[1] < 2:
            return
        top_k = (self.manifest.get("stored") or {}).get("outputs") == "top_k"
        for r in range(min(maps.shape[1], MAX_ROW_MAPS)):
            rank = f" (rank {r + 1} of {maps.shape[1]})" if top_k else ""
            titles = [f"|J| of output {int(self.index[k][r])}{rank}" + (f", {how}" if how else "")
                      for k in range(len(self.rows))]
            self.panels.append(_Panel(titles, list(maps[:, r]), "map"))

    def _rows_of_matrix(self, k: int, rows: int) -> str:
        return self.rows_text(k) if self.index is not None else f"{rows} output rows"

    def _saliency(self) -> None:
        stored = self.chosen("saliency").astype(np.float64)
        if self.kind == "max_abs_over_outputs":
            self.histogram(["saliency"], lambda blocks: blocks[0].max(axis=1), "largest |J| entry of a sample")
            if self.image and stored.shape[1:] == self.input_shape:
                channels = self.input_shape[-1]
                title = "max |J| over outputs and channels" if channels > 1 else "max |J| over outputs"
                self.panels.append(_Panel([title] * len(stored), list(stored.max(axis=-1)), "map"))
                return
            pictures = [s if s.ndim == 2 else s.reshape(1, -1) for s in stored]
            self.panels.append(_Panel(["max |J| over outputs, per input entry"] * len(stored), pictures, "matrix"))
            return
        self.histogram(["saliency"], lambda blocks: blocks[0].sum(axis=1), "sum of |J| over a sample's entries")
        if self.image:  # (n, *rows, H, W): |J| summed over channels, for each output row
            height, width = self.input_shape[:2]
            maps = stored.reshape(len(stored), -1, height, width).sum(axis=1)
            titles = [f"|J| summed over channels and {self.rows_text(k)}" for k in range(len(stored))]
            self.panels.append(_Panel(titles, list(maps), "map"))
            self._row_maps(stored.reshape(len(stored), -1, height, width), "summed over channels")
            return
        entries = math.prod(self.input_shape[:-1])
        if entries * self.outputs and stored[0].size > 1:
            pictures = list(stored.reshape(len(stored), -1, entries))
            titles = [f"|J| summed over the last input axis ({len(p)} output rows x {entries} entries)" for p in pictures]
            self.panels.append(_Panel(titles, pictures, "matrix"))

    def _vjp(self) -> None:
        self.histogram(["vjp"], _frobenius, "Frobenius norm of u^T J over all vectors")
        if self.image:
            height, width, channels = self.input_shape
            stored = np.abs(self.chosen("vjp").astype(np.float64)).reshape(len(self.rows), -1, height, width, channels)
            vectors = stored.shape[1]
            for k in range(min(vectors, MAX_VECTOR_MAPS)):  # one map per vector, as a saliency map of u_k^T y
                titles = [f"|u{k}^T J| (vector {k + 1} of {vectors}), summed over the channels"] * len(stored)
                self.panels.append(_Panel(titles, list(stored[:, k].sum(axis=-1)), "map"))
            return
        self.matrices("vjp", lambda k, m: f"u^T J for {len(m)} vectors (rows) x {m.shape[1]} inputs")

    def _other(self, kind: str) -> None:
        """Datasets this module does not know: per-sample numbers as a histogram, arrays as heatmaps."""
        for name in result_datasets(view_datasets(self.view)):
            if self.view[name].ndim == 1:
                self.scalar(name, name)
            else:
                self.matrices(name, lambda k, m, name=name: f"{name} ({m.shape[0]} x {m.shape[1]})")


def draw(folder: str, manifest: dict[str, Any], ids: Sequence[int] | None = None):
    """The figure for ``folder`` (a matplotlib ``Figure``) and notes on what could not be drawn (one line
    each); ``ids`` defaults to the first four stored samples.

    Raises:
        ValueError: an id has no stored row, or the folder holds nothing to draw (the message says why).
    """
    import h5py

    from jacobeam.transforms.output import storage
    from jacobeam.transforms.output.inputs_table import with_inputs

    manifest = with_inputs(storage.normalize(folder), manifest)  # its input files, from inputs.h5
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    notes: list[str] = []
    with h5py.File(Path(folder) / VIEW, "r") as view:
        # Row r holds sample id sample_id[r]: the same unless samples were rejected (on_bad_sample: skip).
        stored_ids = view[SAMPLE_ID][:]
        if not len(stored_ids):
            raise ValueError(f"{folder}: stores no sample (every one was rejected); nothing to plot")
        row_of = {int(sample_id): row for row, sample_id in enumerate(stored_ids)}
        ids = list(ids if ids is not None else (int(i) for i in stored_ids[:4]))
        bad = [i for i in ids if i not in row_of]
        if bad:
            gaps = " (rejected samples have no row)" if len(stored_ids) < stored_ids[-1] + 1 else ""
            raise SamplesNotStored(f"--samples {bad}: ids run from {stored_ids[0]} to {stored_ids[-1]}{gaps}")
        contents = _Contents(view, manifest, [row_of[i] for i in ids])
        contents.collect()
        sources = _sources(view, contents.rows)
    panels, histograms = contents.panels, contents.histograms
    if not panels and not histograms:
        raise ValueError(f"{folder}: holds no dataset of the Jacobian to plot (reduce: {contents.kind})")
    images, why = None, None
    input_column = any(panel.style == "map" for panel in panels)  # maps over the input's pixels
    if input_column:
        images, why = _inputs(manifest, ids)
        if why:
            notes.append(f"inputs not drawn: {why}")

    columns = input_column + len(panels)
    width = max(2, columns)
    sample_rows = len(ids) if panels else 0
    figure = plt.figure(figsize=(4 * width, 3 * sample_rows + (3 if sample_rows else 3.5)), constrained_layout=True)
    grid = figure.add_gridspec(sample_rows + (1 if histograms else 0), width)
    for k, sample_id in enumerate(ids[:sample_rows]):
        # The row's first column names the sample's input file and row (the input's title, or the first panel's).
        named = f"sample {sample_id}" + (f" ({sources[k]})" if sources[k] else "")
        column = 0
        if input_column and images is None:
            axis = figure.add_subplot(grid[k, 0])
            axis.axis("off")
            axis.text(0.5, 0.5, f"{named}: input not drawn\n({why.split(',')[0]})", ha="center", va="center",
                      wrap=True, transform=axis.transAxes)
            column = 1
        elif images is not None:
            axis = figure.add_subplot(grid[k, 0])
            image = images[k]
            channels = image.shape[-1]
            shown = image[..., 0] if channels == 1 else _unit(image) if channels == 3 else image.mean(axis=-1)
            axis.imshow(shown, cmap="gray")
            channels_text = "" if channels in (1, 3) else f" (mean of {channels} channels)"
            axis.set_title(_wrapped(f"sample {sample_id}: input{channels_text}" + (f", {sources[k]}" if sources[k] else "")))
            column = 1
        for panel in panels:
            span = grid[k, :] if columns == 1 else grid[k, column]
            where = sources[k] if column == 0 else ""
            _draw_panel(figure, figure.add_subplot(span), panel, k, sample_id, where)
            column += 1
    for k, histogram in enumerate(histograms):
        alone = len(histograms) == 1  # across the figure
        span = grid[sample_rows, :] if alone else grid[sample_rows, k % width]
        _draw_histogram(figure.add_subplot(span), histogram, ids, width if alone else 1)
    described = (PARAMETER_DESCRIPTIONS if (manifest.get("stored") or {}).get("parameters") else DESCRIPTIONS)
    figure.suptitle(_wrapped(f"reduce: {contents.kind} ({described.get(contents.kind, contents.kind)})", width))
    return figure, notes


def _inputs(manifest: dict[str, Any], ids: Sequence[int]) -> tuple[np.ndarray | None, str | None]:
    """The chosen samples' inputs, or None and why they cannot be read."""
    if from_a_pipeline(manifest):
        return None, "a pipeline of your own wrote this folder (WriteShards), and it keeps no input files"
    try:
        return _input_samples(manifest, ids), None
    except (JacobeamError, OSError, ValueError) as err:
        return None, f"the input files cannot be read ({str(err).splitlines()[0][:200]})"


def _wrapped(title: str, columns: int = 1) -> str:
    """A title in lines that fit ``columns`` 4-inch columns (a longer line runs past the figure's edge); its
    own line breaks kept, and a number kept with the word before it (``row 7``, ``the 10 outputs``)."""
    lines = (textwrap.fill(_BEFORE_NUMBER.sub("\u00a0", line), TITLE_CHARS * columns, break_long_words=False,
                           break_on_hyphens=False) for line in title.split("\n"))
    return "\n".join(lines).replace("\u00a0", " ")


def _draw_panel(figure, axis, panel: _Panel, k: int, sample_id: int, where: str = "") -> None:
    picture = panel.pictures[k]
    axis.set_title(_wrapped(f"sample {sample_id}: {panel.titles[k]}" + (f", {where}" if where else "")))
    if panel.style == "layers":  # one bar per layer, named where they are few enough to read
        axis.bar(np.arange(len(picture)), picture)
        axis.set_xlabel("layer, in model order")
        names = panel.row_labels[k] if panel.row_labels else None
        if names and len(names) <= _LAYERS_NAMED:
            axis.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
        return
    if panel.style == "curve":
        axis.plot(np.arange(len(picture)), picture, marker=".")
        axis.axhline(0.0, color="gray", linewidth=0.5)
        axis.set_xlabel("entry")
        return
    if panel.style == "map":
        shown = axis.imshow(picture, cmap="inferno")
    else:
        finite = picture[np.isfinite(picture)]
        limit = float(np.abs(finite).max()) if finite.size else 1.0
        limit = limit or 1.0  # centred: white is zero
        shown = axis.imshow(picture, aspect="auto", cmap="coolwarm", vmin=-limit, vmax=limit)
        if len(picture) <= 16:  # a few rows: one tick each, named by its output index where rows were selected
            axis.set_yticks(range(len(picture)), panel.row_labels[k] if panel.row_labels else range(len(picture)))
    figure.colorbar(shown, ax=axis)


def _draw_histogram(axis, histogram: _Histogram, ids: Sequence[int], columns: int = 1) -> None:
    values = histogram.values
    finite = values[np.isfinite(values)]
    left_out = len(values) - len(finite)
    title = f"{histogram.label} over all {len(values):,} samples"
    if left_out:
        title += f" ({left_out:,} non-finite left out)"
    if histogram.title:
        title += f"\n{histogram.title}"
    if finite.size:
        axis.hist(finite, bins=min(50, max(5, len(finite) // 4)))
    marked = list(zip(ids, histogram.marked or ()))
    for _, value in marked:
        if np.isfinite(value):
            axis.axvline(value, color="black", linestyle="--", linewidth=0.8)
    drawn = [str(i) for i, value in marked if np.isfinite(value)]
    not_drawn = [str(i) for i, value in marked if not np.isfinite(value)]
    if drawn:
        title += f"\ndashed: sample(s) {', '.join(drawn)}"
    if not_drawn:
        title += f"\nnot finite, not drawn: sample(s) {', '.join(not_drawn)}"
    axis.set_xlabel(histogram.label)
    axis.set_ylabel("samples")
    axis.set_title(_wrapped(title, columns))


def plot(folder: str, manifest: dict[str, Any], path: str, ids: Sequence[int] | None = None,
         notes: list[str] | None = None) -> Path:
    """Draw the figure for ``folder`` into ``path`` (PNG); ``ids`` defaults to the first four samples.
    What could not be drawn is appended to ``notes`` (one line each)."""
    import matplotlib.pyplot as plt

    figure, found = draw(folder, manifest, ids)
    if notes is not None:
        notes.extend(found)
    target = Path(path)
    try:
        figure.savefig(target, dpi=80)
    finally:
        plt.close(figure)
    return target


def _unit(image: np.ndarray) -> np.ndarray:
    low, high = float(image.min()), float(image.max())
    return (image - low) / (high - low) if high > low else np.zeros_like(image)
