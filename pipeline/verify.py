"""``jacobeam verify OUT [--samples K]``: is what an output folder holds what its manifest says, and right?

1. Every shard listed in the manifest exists and has the manifest's sha256 (as does ``rejected.jsonl``).
2. The ids cover the input exactly once: the shards' ``sample_id`` rows and the rejected ids together
   are ``0 .. num_samples``, each once; each shard's ids lie in its range, in order; ``jacobians.h5``
   reads every shard and shows the same ``sample_id`` column; the input files still hold the number
   of samples the manifest lists.
3. ``K`` randomly chosen stored samples (seeded: ``--seed``) are recomputed from their input rows with
   methods independent of the engine's batched ``batch_jacobian``:

   - a per-sample ``tf.GradientTape().jacobian`` of the float32 model (where the engine ran in forward
     mode: one forward-mode JVP per input entry, in a plain loop, so that non-finite entries fall where
     the run's do; ``transforms.engine.reference``, which the run's self-check uses too). Both are
     float32 computations of the same derivative, differing only in the order of operations:
     tolerance ``TAPE_RTOL``;
   - central finite differences of a float64 twin of the model (a Keras model cloned with float64
     layers and its weights cast: ``LoadedModel.with_dtype``), for inputs of at most
     ``FD_MAX_ELEMENTS`` elements. The float32 Jacobian carries float32 rounding of a deep computation,
     hence the looser ``FD_RTOL``. At a point where the model is not differentiable (a ReLU at exactly
     zero, a max-pool tie: common on images with a constant background) automatic differentiation
     returns one of many possible derivatives, and even partial derivatives that exist need not agree
     with it (kinks of several units can cancel along one axis). Such a sample is detected (for some
     input entry the second difference ``f(x+h) - 2 f(x) + f(x-h)`` does not shrink with the step, as
     it does where ``f`` is smooth) and left out of the finite-difference check, counted in the report.
     Models that are not Keras models (SavedModels, plain ``tf.Module``) cannot be rebuilt in float64:
     the finite-difference check is then skipped and the report says so; float32 finite differences
     are too noisy to decide anything.

   Errors are relative to the reference's largest entry, per sample: ``max |stored - reference| /
   max |reference|`` (a Jacobian has many entries near zero; an entrywise relative error would be noise).
   References are rounded to the stored dtype first; with ``store_dtype`` float16 or bfloat16 every
   tolerance is at least twice that dtype's unit roundoff. With ``outputs`` other than ``all`` the
   stored rows (``output_index``) of the reference are compared; stored products of ``reduce`` other
   than ``none`` are not recomputed (the report says so).

Any mismatch is a problem; ``jacobeam verify`` then exits with status 1. Loading the model runs the
factory named in the manifest's config, as the run did.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import numpy as np

from jacobeam.transforms.output import storage
from jacobeam.transforms.engine.diagnostics import relative_error
from jacobeam.transforms.engine.reference import RTOL
from jacobeam.transforms.finalize import missing_sources, write_manifest
from jacobeam.transforms.output.layout import MANIFEST, NONFINITE, REJECTED_FILE, SAMPLE_ID, SHARDS_DIR, VIEW, is_shard_file, jacobian_dataset

TAPE_RTOL = RTOL["float32"]  # per-sample tape (float32) vs stored (float32)
OUTPUT_RTOL = 1e-5  # recomputed model output vs stored output
FD_RTOL = 1e-3  # float64 central differences vs stored float32 Jacobian
FD_MAX_ELEMENTS = 4096  # finite differences cost 2 model evaluations per input element
FD_STEP = 1e-6
# A second difference above this (relative to the Jacobian's largest entry) that does not shrink with
# the step marks a kink. Smooth models measure below 2e-6 at FD_STEP; kinks are of order 1.
_KINK = 1e-5


@dataclasses.dataclass
class Report:
    folder: str
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    shards_checked: int = 0
    ids_checked: int = 0
    samples: list[int] = dataclasses.field(default_factory=list)  # ids recomputed
    max_rel_error: dict[str, float | None] = dataclasses.field(default_factory=dict)
    tolerances: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"output": OUTPUT_RTOL, "tape": TAPE_RTOL, "finite_differences": FD_RTOL}
    )
    finite_differences: str = "not run"

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "shards_checked": self.shards_checked,
            "ids_checked": self.ids_checked,
            "samples_recomputed": len(self.samples),
            "sample_ids": self.samples,
            "max_rel_error": self.max_rel_error,
            "tolerances": self.tolerances,
            "finite_differences": self.finite_differences,
            "problems": self.problems,
            "notes": self.notes,
        }


# --- structure: checksums and coverage ------------------------------------------------------------------


def _check_structure(root: str, manifest: dict[str, Any], report: Report) -> list[tuple[str, np.ndarray]]:
    """Checksums and id coverage; returns each readable shard's file and ``sample_id`` column."""
    num_samples = int(manifest["num_samples"])
    inputs_stop = max((entry["stop_id"] for entry in manifest["inputs"]), default=0)
    if inputs_stop != num_samples:
        report.problems.append(f"{MANIFEST}: inputs cover ids 0..{inputs_stop}, num_samples is {num_samples}")
    seen = np.zeros(num_samples, np.int64)
    where: list[tuple[str, np.ndarray]] = []
    column = []
    for shard in manifest["shards"]:
        path = storage.join(root, shard["file"])
        if not storage.exists(path):
            report.problems.append(f"{shard['file']}: listed in the manifest but missing")
            continue
        if storage.sha256(path) != shard["sha256"]:
            report.problems.append(f"{shard['file']}: sha256 differs from the manifest's (the file was changed)")
        report.shards_checked += 1
        with storage.open_h5(path) as h5:
            ids = h5[SAMPLE_ID][:]
            mask = h5[NONFINITE][:] if NONFINITE in h5 else np.zeros(len(ids), bool)
        column.append(ids)
        if len(ids) != shard["num_samples"]:
            report.problems.append(f"{shard['file']}: {len(ids)} rows, the manifest says {shard['num_samples']}")
        if len(ids) and (ids.min() < shard["start"] or ids.max() >= shard["stop"] or np.any(np.diff(ids) <= 0)):
            report.problems.append(f"{shard['file']}: sample ids not increasing within {shard['start']}..{shard['stop']}")
            continue
        if int(mask.sum()) != shard.get("nonfinite", 0):
            report.problems.append(f"{shard['file']}: {int(mask.sum())} rows flagged nonfinite, the manifest says {shard.get('nonfinite', 0)}")
        valid = ids[(ids >= 0) & (ids < num_samples)]
        np.add.at(seen, valid, 1)
        where.append((shard["file"], ids))
    rejected_ids = _rejected_ids(root, manifest, report)
    np.add.at(seen, rejected_ids[(rejected_ids >= 0) & (rejected_ids < num_samples)], 1)
    report.ids_checked = num_samples
    for count, what in ((0, "missing (neither stored nor rejected)"), (2, "present more than once")):
        bad = np.flatnonzero(seen == 0) if count == 0 else np.flatnonzero(seen >= 2)
        if len(bad):
            report.problems.append(f"ids {what}: {len(bad)}, first {bad[:5].tolist()}")
    _check_view(root, np.concatenate(column) if column else np.zeros(0, np.int64), report)
    return where


def _rejected_ids(root: str, manifest: dict[str, Any], report: Report) -> np.ndarray:
    info = manifest.get("rejected")
    path = storage.join(root, REJECTED_FILE)
    if info is None:
        return np.zeros(0, np.int64)
    if not storage.exists(path):
        report.problems.append(f"{REJECTED_FILE}: missing")
        return np.zeros(0, np.int64)
    if info.get("sha256") and storage.sha256(path) != info["sha256"]:
        report.problems.append(f"{REJECTED_FILE}: sha256 differs from the manifest's (the file was changed)")
    ids = [record["id"] for record in map(json.loads, storage.read_text(path).splitlines()) if record["id"] is not None]
    if len(ids) != info.get("count", len(ids)):
        report.problems.append(f"{REJECTED_FILE}: {len(ids)} rejected ids, the manifest says {info['count']}")
    return np.asarray(ids, np.int64)


def _check_view(root: str, column: np.ndarray, report: Report) -> None:
    path = storage.join(root, VIEW)
    if not storage.exists(path):
        report.problems.append(f"{VIEW}: missing")
        return
    with storage.open_h5(path) as view:
        report.problems.extend(missing_sources(root, view))
        if not storage.is_local(root):
            # HDF5 resolves a virtual dataset's sources only on a local file system: read remotely, the
            # view would show fill values. Its sources were checked above; the shards themselves were read.
            report.notes.append(f"{VIEW}: remote folder, so its values were not read (its sources exist)")
            return
        if SAMPLE_ID in view and not report.problems and not np.array_equal(view[SAMPLE_ID][:], column):
            report.problems.append(f"{VIEW}: its sample_id column differs from the shards'")


def _check_inputs(manifest: dict[str, Any], report: Report) -> bool:
    from jacobeam.transforms.errors import InputError
    from jacobeam.transforms.inputs.readers import describe, manifest_sources

    fine = True
    for source in manifest_sources(manifest):
        if source.unreadable:
            continue
        try:
            found = describe(source.path, source.key, source.sample_shape, source.image).num_samples
        except (InputError, OSError) as err:
            report.problems.append(f"input {source.path}: cannot be read any more ({err}); cannot recompute")
            fine = False
            continue
        if found != source.num_samples:
            report.problems.append(f"input {source.path}: holds {found} samples, the manifest says {source.num_samples}")
            fine = False
    return fine


# --- recomputation --------------------------------------------------------------------------------------


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


def _finite_differences(f, x: np.ndarray, step: float = FD_STEP) -> tuple[np.ndarray, bool]:
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


def _recompute(
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
    outputs = int(np.prod(manifest["output_shape"], dtype=np.int64))
    stored_dtype = manifest.get("dtype", "float32")
    store = store_dtype(stored_dtype)
    # Values stored in float16/bfloat16 carry its rounding: the tolerances grow to cover it.
    eps = reference.store_roundoff(stored_dtype)
    tolerances = {name: reference.tolerance(rtol, stored_dtype) for name, rtol in
                  (("output", OUTPUT_RTOL), ("tape", TAPE_RTOL), ("finite_differences", FD_RTOL))}
    one = reference.tape_function(loaded.call, shapes, forward=(manifest.get("engine") or {}).get("mode") == "forward")
    size = sum(int(np.prod(shape)) for shape in shapes)
    twin, why_not = (None, f"inputs have {size} elements, more than {FD_MAX_ELEMENTS}") if size > FD_MAX_ELEMENTS else float64_twin(loaded)
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

        def stored_rows(full: np.ndarray, k: int) -> np.ndarray:
            full = full.reshape(outputs, *shapes[k])
            return _as_stored(full if selected is None else full[selected], store).reshape(stored[k].shape)

        def check(name: str, k: int | None, value: np.ndarray, reference: np.ndarray) -> None:
            error = relative_error(value, reference, floor=1e-12)
            errors[name].append(error)
            if not error <= tolerances[name]:
                label = name.replace("_", " ") + ("" if k is None or not several else f" ({datasets[k]})")
                report.problems.append(f"sample {sample_id} ({file} row {row}): {label} max relative error {error:.3g} > {tolerances[name]:g}")

        y, jacobians = one(*[tf.constant(x) for x in xs])
        nonfinite = not (all(np.isfinite(value).all() for value in stored.values()) and np.isfinite(stored_out).all())
        if flagged != nonfinite:
            report.problems.append(f"sample {sample_id}: nonfinite flag {flagged}, but its stored values are {'not ' if nonfinite else ''}all finite")
        check("output", None, stored_out, _as_stored(y.numpy(), store).reshape(stored_out.shape))
        for k, value in stored.items():
            check("tape", k, value, stored_rows(jacobians[k].numpy(), k))
        if twin is not None and not nonfinite:
            x64 = [x.astype(np.float64) for x in xs]
            if relative_error(twin(x64).reshape(stored_out.shape), stored_out, floor=1e-12) > max(1e-3, eps):
                twin, why_not = None, "the float64 rebuild of the model does not reproduce its outputs"
                continue
            differences = {k: _finite_differences(_one_input(twin, x64, k), x64[k][0]) for k in stored}
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
        f"e.g. id {kinked[0]}" if kinked else ""
    )
    if differenced:
        report.finite_differences = (
            f"float64 central differences (step {FD_STEP:g}) on {len(differenced)} sample(s){left_out}"
        )
    elif kinked:
        report.finite_differences = f"inconclusive{left_out}"
    else:
        report.finite_differences = f"skipped: {why_not or 'no finite sample to check'}"


def verify(folder: str | Path, samples: int = 0, seed: int = 0) -> Report:
    """Check the output folder (see the module docstring); recompute ``samples`` random samples."""
    root = storage.normalize(folder)
    top = storage.listdir(root)
    if not storage.is_folder(root):
        raise FileNotFoundError(f"{folder}: no such output folder")
    report = Report(folder=root)
    if MANIFEST not in top:
        report.problems.append(f"no {MANIFEST}: the run did not finish; nothing to verify")
        return report
    manifest = json.loads(storage.read_text(storage.join(root, MANIFEST)))
    where = _check_structure(root, manifest, report)
    listed = {storage.name_of(shard["file"]) for shard in manifest["shards"]}
    on_disk = storage.listdir(storage.join(root, SHARDS_DIR))
    extra = [name for name in on_disk if is_shard_file(name) and name not in listed]
    if extra:
        report.notes.append(f"{len(extra)} shard file(s) not in the manifest (an unfinished later run?): {extra[:3]}")
    if samples > 0 and _check_inputs(manifest, report):
        _recompute(root, manifest, where, samples, seed, report)
    return report


def record(folder: str | Path, report: Report) -> dict[str, Any]:
    """Store the report in the manifest (``verify``); returns the manifest."""
    manifest = json.loads(storage.read_text(storage.join(str(folder), MANIFEST)))
    manifest["verify"] = report.as_dict()
    write_manifest(str(folder), manifest)
    return manifest


def format_report(report: Report) -> str:
    lines = [f"{report.folder}: {'verified' if report.ok else 'VERIFICATION FAILED'}"]
    lines.append(f"  shards      {report.shards_checked} checked against the manifest's sha256")
    lines.append(f"  ids         {report.ids_checked:,} checked: each stored or rejected exactly once")
    if report.samples:
        errors = report.max_rel_error
        show = lambda key: "n/a" if errors.get(key) is None else f"{errors[key]:.2e}"  # noqa: E731
        lines.append(f"  recomputed  {len(report.samples)} sample(s), max relative error:")
        tolerance = report.tolerances
        lines.append(f"    output                  {show('output')} (tolerance {tolerance['output']:g})")
        lines.append(f"    per-sample tape         {show('tape')} (tolerance {tolerance['tape']:g})")
        lines.append(f"    finite differences      {show('finite_differences')} (tolerance {tolerance['finite_differences']:g})")
        lines.append(f"    ({report.finite_differences})")
    lines += [f"  note: {note}" for note in report.notes]
    lines += [f"  problem: {problem}" for problem in report.problems]
    return "\n".join(lines)
