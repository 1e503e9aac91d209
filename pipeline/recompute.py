"""Stored samples recomputed independently and judged by the run's self-check rule; ``aggregates.h5``
checked against the shards' partial sums (see ``pipeline.verify``).

One recompute-and-compare implementation: the self-check's (``transforms.self_check.SelfChecker``). Its
reference differentiates one sample at a time (per-sample tape, or forward-mode JVPs where the run ran
forward), in a float64 copy of the model where one can be built, chooses the rows again itself (a
label read again from the input file), and rebuilds every stored dataset from its definition
(``transforms.reference_datasets``), none of which is the engine's code. Verify gives it an engine
rebuilt from what the manifest records (``_RecordedEngine``: no probing, the run's mode).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import AGGREGATES, NONFINITE, SAMPLE_ID

if TYPE_CHECKING:
    from jacobeam.pipeline.verify import Report


class _RecordedEngine:
    """What ``SelfChecker`` reads of an engine, from the manifest: the options, the model in the compute
    dtype, its inputs and outputs, the size of its forward pass, the run's mode."""

    def __init__(self, loaded, manifest: dict[str, Any], output_shape: tuple[int, ...]):
        import tensorflow as tf

        from jacobeam.pipeline.config import validate
        from jacobeam.transforms.engine import model_checks
        from jacobeam.transforms.engine.diagnostics import activation_size

        jacobian = validate(manifest["config"]).jacobian
        self.options = jacobian.engine_options()
        # Where outputs: label finds each sample's label in the input files (read again, not the stored row).
        self.label_key = jacobian.labels.key if self.options.needs_labels and jacobian.labels else None
        self.model = loaded.with_dtype(self.options.compute_dtype)
        self.input_names, self.input_shapes = model_checks.resolve_inputs(self.model, manifest["input_shape"])
        self.wrt = model_checks.resolve_wrt(self.input_names, self.options.wrt, self.model.source)
        self.output_shape = tuple(output_shape)
        specs = [tf.TensorSpec((None, *shape), self.options.compute_dtype) for shape in self.input_shapes]
        forward = tf.function(lambda xs: self.model.call(list(xs)), input_signature=[specs], autograph=False)
        self.activations = activation_size(forward.get_concrete_function(specs).graph)
        self._mode = (manifest.get("engine") or {}).get("mode", "reverse")
        if self.options.parameters is not None:  # what ParameterSelfChecker reads besides
            from jacobeam.transforms.engine import parameter_space

            self.side = self.options.parameters
            self.layout, _ = parameter_space.layout(self.model.keras_model, self.side.layers, self.model.source)
            self.model, self.softmax = parameter_space.objective_model(self.model, self.side.objective)
            self.outputs = int(np.prod(self.output_shape))
            self.rows_shape = parameter_space.rows_shape(self.side, self.options.outputs, self.output_shape)

    def describe(self) -> dict[str, Any]:
        return {"mode": self._mode}


def load_model(manifest: dict[str, Any]):
    """The manifest's model; a relative local path (manifests before paths were recorded absolute) is
    resolved against the run's recorded working directory, else the current one, and a missing file
    names the path tried."""
    from jacobeam.transforms.engine.models import load
    from jacobeam.transforms.errors import ModelError

    model = dict(manifest["config"]["model"])
    path = model.get("path")
    if path and storage.is_local(path) and not os.path.isabs(path):
        base = manifest.get("working_directory") or os.getcwd()
        model["path"] = os.path.join(base, path)
        if not os.path.exists(model["path"]):
            where = "the run's working directory" if manifest.get("working_directory") else "the current directory"
            raise ModelError(f"model.path {path} (relative, resolved against {where}): {model['path']}: no such file")
    return load(**model)


def choose_samples(shards: list[tuple[str, np.ndarray]], samples: int, seed: int) -> dict[int, tuple[str, int]]:
    """``samples`` stored samples drawn at random (seeded), uniformly over the stored rows: ``{sample id:
    (shard file, row)}``. Verify re-hashes the inputs of these samples' shards (``--inputs sampled``)."""
    ends = np.cumsum([len(ids) for _, ids in shards])
    if not samples or not len(ends) or not ends[-1]:
        return {}
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(int(ends[-1]), size=min(samples, int(ends[-1])), replace=False))
    where = {}
    for position in positions:
        index = int(np.searchsorted(ends, position, side="right"))
        file, ids = shards[index]
        row = int(position - (ends[index - 1] if index else 0))
        where[int(ids[row])] = (file, row)
    return where


def recompute(
    root: str, manifest: dict[str, Any], shards: list[tuple[str, np.ndarray]], where: dict[int, tuple[str, int]],
    report: Report,
) -> None:
    """Recompute the stored samples ``where`` names (``choose_samples``) and judge every stored dataset of each."""
    from jacobeam.transforms.inputs.readers import manifest_sources, open_samples
    from jacobeam.transforms.output.shards import read_attrs
    from jacobeam.transforms.self_check import MISMATCH, checker_for, mismatch_text
    from jacobeam.transforms.spec import SelfCheck

    if not where:
        return
    report.samples = sorted(where)
    loaded = load_model(manifest)
    if loaded.fingerprint() != manifest["model_fingerprint"]:
        report.problems.append(
            f"the model ({loaded.source}) now has weights with fingerprint {loaded.fingerprint()[:16]}…, the "
            f"output was computed with {manifest['model_fingerprint'][:16]}…: cannot recompute"
        )
        return
    first = storage.join(root, shards[0][0])
    engine = _RecordedEngine(loaded, manifest, tuple(int(d) for d in read_attrs(first)["output_shape"]))
    checker = checker_for(engine, SelfCheck())
    several = len(engine.input_names) > 1
    labels = manifest.get("labels") or {}
    classes = labels.get("class_names") if labels.get("source") == "folders" else None
    for sample_id, source, read in _read_samples(report.samples, manifest_sources(manifest), open_samples):
        # jacobian.labels folders or table: the file's label, as the manifest's table of input files records it
        # (a class folder's derived again from the file's path).
        label = source.label if source.label is not None else (
            _label(source, sample_id, engine.label_key) if engine.label_key else None)
        file, row = where[sample_id]
        at = f"sample {sample_id} ({file} row {row})"
        if source.label is not None and classes is not None:
            label = _folder_label(source, classes, manifest, report, at)
        xs = [np.asarray(read[n] if several else read) for n in engine.input_names]
        with storage.open_h5(storage.join(root, file)) as h5:
            count = len(h5[SAMPLE_ID])
            stored = {}  # every per-sample dataset of the shard, this sample's row

            def take(name, item, stored=stored, row=row, count=count) -> None:  # None: visititems goes on
                if hasattr(item, "shape") and item.shape[:1] == (count,):
                    stored[name] = item[row : row + 1]

            h5.visititems(take)
        flagged = bool(stored.pop(NONFINITE, [False])[0])
        stored.pop(SAMPLE_ID, None)
        nonfinite = not all(np.isfinite(v).all() for v in stored.values() if v.dtype.kind == "f")
        if flagged != nonfinite:
            finite = "not all" if nonfinite else "all"
            report.problems.append(f"{at}: nonfinite flag {flagged}, but its stored values are {finite} finite")
        record, nearest_bound = checker.judge(xs, stored, sample_id, label)
        tally(report.checked, record, nearest_bound)
        if record["verdict"] == MISMATCH:  # the run's own rule, word for word
            report.problems.append(f"{at}: {mismatch_text(record)}")
    report.method = f"{checker.method}, against the {checker.truth or 'compute dtype reference'}"
    report.tolerance = checker.tolerance


def _read_samples(ids: list[int], sources, open_samples) -> Iterator[tuple[int, Any, Any]]:
    """Each of ``ids`` (increasing) with its source file and its sample as read, each file opened once and
    read forwards: a compressed ``.npz`` member seeks by decompressing from its start, so a file opened
    again per sample was read again up to that sample."""
    opened = None
    with contextlib.ExitStack() as stack:
        for sample_id in ids:
            source = next(s for s in sources if s.first_id <= sample_id < s.stop_id)
            if opened is not source:
                stack.close()
                rows, opened = stack.enter_context(open_samples(source)), source
            yield sample_id, source, rows.read(source.row(sample_id), source.row(sample_id) + 1)


def tally(checked: dict[str, dict[str, Any]], record: dict[str, Any], nearest_bound: dict[str, tuple[float, float]]) -> None:
    """Add one recomputed sample's judgement (``SelfChecker.judge``) to ``Report.checked``: per dataset the
    largest error, and the bound of the row nearest its bound with the error's fraction of it. The largest
    error and the narrowest bound can be different rows' (a noisy row's bound is wider): set side by side
    they would show an error beyond a bound that passed."""
    from jacobeam.transforms.self_check import KINK

    for name, error in record["errors"].items():
        seen = checked.setdefault(name, {"max_error": 0.0, "bound": None, "of_bound": 0.0, "samples": 0, "kinks": 0})
        seen["max_error"] = max(seen["max_error"], float("inf") if error == "inf" else error)
        near, bound = nearest_bound[name]
        if seen["bound"] is None or near / bound > seen["of_bound"]:
            seen["bound"], seen["of_bound"] = bound, near / bound
        seen["samples"] += 1
    if record["verdict"] == KINK:
        checked[record["dataset"]]["kinks"] += 1


def _folder_label(source, classes: list[str], manifest: dict[str, Any], report: Report, at: str) -> int:
    """A file's label under ``jacobian.labels.folders``, derived again: the index among the recorded
    ``class_names`` of the folder directly below its input folder that holds it (where the file is under
    one of the recorded ``input.paths``). One other than the label the manifest records for the file is a
    problem; the sample is judged with the label derived."""
    from jacobeam.pipeline.discover import glob_root

    path = storage.absolute(source.path)
    roots = [root for root in map(glob_root, manifest["config"]["input"]["paths"]) if path.startswith(root + "/")]
    if not roots:  # a copied project's inputs, elsewhere than the recorded paths: the record is all there is
        return source.label
    name = path[len(max(roots, key=len)) + 1:].split("/", 1)[0]
    if name not in classes:
        report.problems.append(f"{at}: {source.path} is in no class folder of {classes}")
        return source.label
    if classes.index(name) != source.label:
        report.problems.append(f"{at}: label {source.label} recorded for {source.path}, but its class folder {name!r} "
                               f"is class {classes.index(name)} of {classes}")
    return classes.index(name)


def _label(source, sample_id: int, key: str) -> int:
    """The sample's label, read again from its input file (the check does not take the stored row's)."""
    from jacobeam.transforms.inputs.readers import open_rows

    row = source.row(sample_id)
    with open_rows(source.path, key, "jacobian.labels.key") as labels:
        return int(np.asarray(labels.read(row, row + 1)).reshape(-1)[0])


def check_aggregates(root: str, manifest: dict[str, Any], report: Report) -> None:
    """``aggregates.h5`` is the tree-sum of the shards' stored partial sums, bit for bit (the same
    ``AggregateFn`` tree and division as ``Finalize``); where the shards store full Jacobians, each
    recomputed sample's shard's partial sums are those of its stored Jacobians, to float64 round-off.
    That a partial sum holds the right Jacobians of samples not recomputed, no sample can prove: it
    is as good as the stored per-sample values it was summed from, which the checksums cover."""
    from jacobeam.transforms.aggregates import PARTIALS, AggregateFn, partial, read_partial

    summary = manifest.get("aggregates") or {}
    if not summary:
        return
    # Id order (names hold the zero-padded first id); a shard whose samples were all rejected adds nothing.
    files = sorted(entry["file"] for entry in manifest["shards"] if entry["num_samples"])
    fn = AggregateFn(len(files))
    nodes = fn.create_accumulator()
    try:
        for position, file in enumerate(files):
            fn.add_input(nodes, (position, read_partial(storage.join(root, file))))
        sums = fn.extract_output(nodes)
        with storage.open_h5(storage.join(root, AGGREGATES)) as h5:
            stored = {name: h5[name][()] for name in h5}
    except (OSError, KeyError, ValueError) as err:
        report.problems.append(f"{AGGREGATES}: cannot be checked: {err}")
        return
    count = int(sums["count"])
    expected = {"count": count}
    for total, name in (("sum", "mean"), ("sum_abs", "mean_abs")):
        if total in sums:
            expected[name] = sums[total] / count
    if "jtj" in sums:
        expected["jtj"] = sums["jtj"]
    for name, value in expected.items():
        if name not in stored:
            report.problems.append(f"{AGGREGATES}: no {name}")
        elif not np.array_equal(np.asarray(stored[name]).reshape(-1), np.asarray(value).reshape(-1)):
            report.problems.append(f"{AGGREGATES}: {name} differs from the tree-sum of the shards' partial sums")
    report.aggregates = f"{', '.join(sorted(expected))}: bit for bit against the tree-sum of {len(files)} shard(s)' partial sums"
    if (manifest.get("stored") or {}).get("reduce", "none") != "none" or not report.samples:
        return
    # The recomputed samples' shards: their partial sums against their stored (and now checked) Jacobians.
    chosen = {file for file, ids in report.shard_ids if np.isin(ids, report.samples).any()}
    kinds = [k for k, key in (("mean", "sum"), ("mean_abs", "sum_abs"), ("jtj", "jtj")) if key in sums]
    for file in sorted(chosen):
        with storage.open_h5(storage.join(root, file)) as h5:
            names = [n for n in h5 if n.split("/")[0] == "jacobian"]
            if len(names) != 1 or PARTIALS not in h5:
                continue
            jacobians = h5[names[0]][()]
            mine = {k: h5[PARTIALS][k][()] for k in h5[PARTIALS]}
        flat = jacobians.reshape(len(jacobians), -1, int(np.prod(manifest["input_shape"])))
        again = partial(flat, kinds)
        for key, value in again.items():
            # Summed in another grouping (per batch, then added): float64 round-off of n terms.
            bound = len(flat) * np.finfo(np.float64).eps * max(float(np.abs(value).max()), 1e-300) * 4
            if np.abs(np.asarray(mine[key], np.float64) - value).max() > bound:
                report.problems.append(f"{file}: partial {key} differs from the sum over its stored jacobians")
    report.aggregates += f"; partial sums of {len(chosen)} recomputed sample(s)' shard(s) against their stored Jacobians"
