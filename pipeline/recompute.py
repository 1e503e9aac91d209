"""Stored samples recomputed by methods independent of the engine's batched computation.

A per-sample ``GradientTape`` (``transforms.engine.reference``) and float64 central differences of a
float64 twin of the model, each compared with what a shard stores (see ``pipeline.verify``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jacobeam.transforms.engine.diagnostics import relative_error
from jacobeam.transforms.engine.reference import RTOL
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import NONFINITE, jacobian_dataset

if TYPE_CHECKING:
    from jacobeam.pipeline.verify import Report

TAPE_RTOL = RTOL["float32"]  # per-sample tape (float32) vs stored (float32)
OUTPUT_RTOL = 1e-5  # recomputed model output vs stored output
FD_RTOL = 1e-3  # float64 central differences vs stored float32 Jacobian
FD_MAX_ELEMENTS = 4096  # finite differences cost 2 model evaluations per input element
FD_STEP = 1e-6
# A second difference above this (relative to the Jacobian's largest entry) that does not shrink with
# the step marks a kink. Smooth models measure below 2e-6 at FD_STEP; kinks are of order 1.
_KINK = 1e-5


def float64_twin(loaded) -> tuple[Any, str | None]:
    """``f([x_1, ..., x_k]) -> y`` (one batch per model input) in float64 with the model's weights
    (``LoadedModel.with_dtype``, the same twin that ``compute_dtype: float64`` runs), or None and why not."""
    import tensorflow as tf

    from jacobeam.transforms.errors import ModelError

    try:
        twin = loaded.with_dtype("float64")
    except ModelError as err:
        if loaded.keras_model is None:
            return None, "the model is not a Keras model (a SavedModel or tf.Module cannot be rebuilt in float64)"
        return None, f"the model cannot be rebuilt in float64 ({str(err.__cause__ or err)[:200]})"
    except Exception as err:  # custom layers without a config, subclassed models, lambdas under safe_mode, ...
        return None, f"the model cannot be rebuilt in float64 ({type(err).__name__}: {str(err)[:200]})"
    return (lambda xs: np.asarray(twin.call([tf.constant(x, tf.float64) for x in xs]), np.float64)), None


def _one_input(f, xs: list[np.ndarray], k: int):
    """``f`` (a batch function of every input) as a batch function of input ``k`` alone, the other
    inputs held at their value in ``xs`` (one sample each)."""
    return lambda batch: f([batch if j == k else np.repeat(x, len(batch), axis=0) for j, x in enumerate(xs)])


def finite_differences(f, x: np.ndarray, step: float = FD_STEP) -> tuple[np.ndarray, bool]:
    """Central differences of ``f`` (a float64 batch function) at ``x`` (float64, one sample), in the
    layout ``(*out, *in)``, and whether ``f`` is differentiable at ``x`` as far as can be seen."""
    size = x.size

    def evaluate(h: float) -> tuple[np.ndarray, np.ndarray]:
        plus, minus = [], []
        for lo in range(0, size, 256):  # bounded memory for the perturbed batch
            basis = np.zeros((min(256, size - lo), size))
            basis[np.arange(len(basis)), lo + np.arange(len(basis))] = h
            basis = basis.reshape(len(basis), *x.shape)
            plus.append(np.asarray(f(x + basis), np.float64))
            minus.append(np.asarray(f(x - basis), np.float64))
        return np.concatenate(plus), np.concatenate(minus)  # (size, *out)

    y0 = np.asarray(f(x[None]), np.float64)[0]
    yp, ym = evaluate(step)
    yp_small, ym_small = evaluate(step / 10)
    central = (yp - ym) / (2 * step)
    scale = max(float(np.abs(central).max()), 1e-12)
    # |f'(x+) - f'(x-)|: about step * f'' where f is smooth (shrinks with the step), the jump at a kink.
    second = np.abs(yp - 2 * y0 + ym) / step
    second_small = np.abs(yp_small - 2 * y0 + ym_small) / (step / 10)
    kinked = bool(np.any((second > _KINK * scale) & (second_small > 0.5 * second)))
    return np.moveaxis(central, 0, -1).reshape(*central.shape[1:], *x.shape), not kinked


def _as_stored(reference: np.ndarray, store: np.dtype) -> np.ndarray:
    """The reference rounded as the stored values were (a float16 overflow is inf in both)."""
    with np.errstate(over="ignore"):
        return np.asarray(reference).astype(store).astype(np.float64)


def recompute(
    root: str, manifest: dict[str, Any], shards: list[tuple[str, np.ndarray]], samples: int, seed: int, report: Report
) -> None:
    import tensorflow as tf

    from jacobeam.transforms.engine import reference, store_dtype
    from jacobeam.transforms.engine.models import load
    from jacobeam.transforms.inputs.readers import manifest_sources, open_samples

    stored_kind = manifest.get("stored", {}).get("reduce", "none")
    if stored_kind != "none":
        report.notes.append(
            f"jacobian.reduce {stored_kind}: the stored products are not recomputed (only full Jacobians and "
            "selected rows of them are); checksums and ids were checked"
        )
        return
    ends = np.cumsum([len(ids) for _, ids in shards])
    if not len(ends) or not ends[-1]:
        return
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(int(ends[-1]), size=min(samples, int(ends[-1])), replace=False))
    where = {}  # sample id -> (shard file, row)
    for position in positions:
        index = int(np.searchsorted(ends, position, side="right"))
        file, ids = shards[index]
        row = int(position - (ends[index - 1] if index else 0))
        where[int(ids[row])] = (file, row)
    report.samples = sorted(where)
    loaded = load(**manifest["config"]["model"])
    if loaded.fingerprint() != manifest["model_fingerprint"]:
        report.problems.append(
            f"the model ({loaded.source}) now has weights with fingerprint {loaded.fingerprint()[:16]}…, the "
            f"output was computed with {manifest['model_fingerprint'][:16]}…: cannot recompute"
        )
        return
    several = isinstance(manifest["input_shape"], dict)
    names = list(loaded.input_names)
    shapes = [tuple(manifest["input_shape"][n]) for n in names] if several else [tuple(manifest["input_shape"])]
    # One stored Jacobian per differentiated input: "jacobian", or "jacobian/<input>" for several inputs.
    datasets = [jacobian_dataset(n, several) for n in names]
    stored_dtype = manifest.get("dtype", "float32")
    store = store_dtype(stored_dtype)
    # Values stored in float16/bfloat16 carry its rounding: the tolerances grow to cover it.
    eps = reference.store_roundoff(stored_dtype)
    tolerances = {name: reference.tolerance(rtol, stored_dtype) for name, rtol in
                  (("output", OUTPUT_RTOL), ("tape", TAPE_RTOL), ("finite_differences", FD_RTOL))}
    forward = (manifest.get("engine") or {}).get("mode") == "forward"
    # Reverse mode differentiates only the stored rows of a selection (a label of 1,000 classes: one
    # backward pass, not a thousand); built at the first sample, when the shards say whether there is one.
    references: dict[bool, object] = {}
    size = sum(int(np.prod(shape)) for shape in shapes)
    twin, why_not = (
        (None, f"inputs have {size} elements, more than {FD_MAX_ELEMENTS}")
        if size > FD_MAX_ELEMENTS
        else float64_twin(loaded)
    )
    errors: dict[str, list[float]] = {"output": [], "tape": [], "finite_differences": []}
    kinked, differenced = [], []  # samples at which the model is not differentiable; samples checked
    sources = manifest_sources(manifest)
    for sample_id in report.samples:
        source = next(s for s in sources if s.first_id <= sample_id < s.stop_id)
        with open_samples(source) as rows:
            read = rows.read(sample_id - source.first_id, sample_id - source.first_id + 1)
        xs = [np.asarray(read[n] if several else read, np.float32) for n in names]
        file, row = where[sample_id]
        with storage.open_h5(storage.join(root, file)) as h5:
            stored = {k: h5[name][row] for k, name in enumerate(datasets) if name in h5}  # jacobian.wrt's inputs
            stored_out = h5["output"][row]
            flagged = bool(h5[NONFINITE][row]) if NONFINITE in h5 else False
            # outputs: indices/argmax/top_k/label store the selected rows of the Jacobian, and which they are.
            selected = np.asarray(h5["output_index"][row]).reshape(-1) if "output_index" in h5 else None

        rows = selected is not None and not forward

        def stored_rows(full: np.ndarray, k: int, selected=selected, stored=stored, chosen: bool = False) -> np.ndarray:
            """The stored rows of ``full`` (all outputs, or already the ``chosen`` rows) as stored."""
            full = full.reshape(-1, *shapes[k])
            return _as_stored(full if selected is None or chosen else full[selected], store).reshape(stored[k].shape)

        at = f"sample {sample_id} ({file} row {row})"

        def check(name: str, k: int | None, value: np.ndarray, reference: np.ndarray, at: str = at) -> None:
            error = relative_error(value, reference, floor=1e-12)
            errors[name].append(error)
            if not error <= tolerances[name]:
                label = name.replace("_", " ") + ("" if k is None or not several else f" ({datasets[k]})")
                report.problems.append(f"{at}: {label} max relative error {error:.3g} > {tolerances[name]:g}")

        if rows not in references:
            references[rows] = reference.tape_function(loaded.call, shapes, forward=forward, rows=rows)
        arguments = [tf.constant(x) for x in xs] + ([tf.constant(selected.astype(np.int32)[None])] if rows else [])
        y, jacobians = references[rows](*arguments)
        nonfinite = not (all(np.isfinite(value).all() for value in stored.values()) and np.isfinite(stored_out).all())
        if flagged != nonfinite:
            report.problems.append(
                f"sample {sample_id}: nonfinite flag {flagged}, but its stored values are {'not ' if nonfinite else ''}all finite"
            )
        check("output", None, stored_out, _as_stored(y.numpy(), store).reshape(stored_out.shape))
        for k, value in stored.items():
            check("tape", k, value, stored_rows(jacobians[k].numpy(), k, chosen=rows))
        if twin is not None and not nonfinite:
            x64 = [x.astype(np.float64) for x in xs]
            if relative_error(twin(x64).reshape(stored_out.shape), stored_out, floor=1e-12) > max(1e-3, eps):
                twin, why_not = None, "the float64 rebuild of the model does not reproduce its outputs"
                continue
            differences = {k: finite_differences(_one_input(twin, x64, k), x64[k][0]) for k in stored}
            if not all(differentiable for _, differentiable in differences.values()):
                kinked.append(sample_id)
                continue
            differenced.append(sample_id)
            for k, (central, _) in differences.items():
                check("finite_differences", k, stored[k], stored_rows(central, k))
    report.max_rel_error = {name: (max(values) if values else None) for name, values in errors.items()}
    report.tolerances = tolerances
    left_out = (
        f"; {len(kinked)} sample(s) left out: the model is not differentiable there (ReLU/max-pool kinks), "
        f"e.g. id {kinked[0]}"
        if kinked
        else ""
    )
    if differenced:
        report.finite_differences = (
            f"float64 central differences (step {FD_STEP:g}) on {len(differenced)} sample(s){left_out}"
        )
    elif kinked:
        report.finite_differences = f"inconclusive{left_out}"
    else:
        report.finite_differences = f"skipped: {why_not or 'no finite sample to check'}"
