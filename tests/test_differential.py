"""Property-based differential tests: drawn configurations of the engine, and of ``jacobeam run``, against
an independent float64 reference (``tests/differential_models.py`` says how the reference is made,
``tests/differential_expected.py`` how it is judged).

Profiles (environment variable ``JACOBEAM_HYPOTHESIS_PROFILE``):

- ``ci`` (the default, ``make test``): derandomized, 60 engine examples and 6 runs, about two minutes on
  two cores;
- ``fast`` (``make test-fast``): the same seed, 10 engine examples and 2 runs;
- ``deep``: thousands of random examples (about an hour), e.g.
  ``JACOBEAM_HYPOTHESIS_PROFILE=deep .venv/bin/python -m pytest -q tests/test_differential.py``;
  ``JACOBEAM_HYPOTHESIS_EXAMPLES=N`` sets the engine test's number of examples in either profile.

A failure prints the shrunk ``Case`` (every option drawn) and the engine's description of what it ran.
Hypothesis registers a built-in profile named "ci" of its own; ours are registered under
``jacobeam-ci``, ``jacobeam-fast`` and ``jacobeam-deep`` so as not to replace it for other tests.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, example, given, note, settings
from hypothesis import strategies as st

from jacobeam.pipeline import cli
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import OutputSelection
from tests import differential as diff
from tests import differential_expected as expect
from tests import differential_models as subjects

REPO = Path(__file__).resolve().parent.parent

# Hypothesis' explain phase traces every line while it shrinks: far too slow through TensorFlow.
PHASES = [phase for phase in Phase if phase != Phase.explain]
settings.register_profile(
    "jacobeam-ci",
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    phases=PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "jacobeam-deep",
    max_examples=2500,
    deadline=None,
    database=None,  # nothing written into the repository; print_blob gives @reproduce_failure instead
    phases=PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)
# The edit loop's profile (``make test-fast``): the same fixed seed, a sixth of the examples.
settings.register_profile("jacobeam-fast", settings.get_profile("jacobeam-ci"), max_examples=10)
PROFILE = os.environ.get("JACOBEAM_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("fast", "ci", "deep"):
    raise ValueError(f"JACOBEAM_HYPOTHESIS_PROFILE: expected fast, ci or deep, got {PROFILE!r}")
_chosen = settings.get_profile(f"jacobeam-{PROFILE}")
_examples = int(os.environ.get("JACOBEAM_HYPOTHESIS_EXAMPLES", 0)) or _chosen.max_examples
ENGINE_SETTINGS = settings(_chosen, max_examples=_examples)
RUN_SETTINGS = settings(ENGINE_SETTINGS, max_examples={"fast": 2, "ci": 6, "deep": 60}[PROFILE])
# The deep profile runs for about an hour: no per-test timeout (pyproject.toml sets 900 s).
pytestmark = [pytest.mark.timeout(0)] if PROFILE == "deep" else []


@pytest.fixture(scope="module")
def arrays_folder(tmp_path_factory) -> Path:
    """Where the cases' vectors and bases are written as .npy files (names depend on their content)."""
    return tmp_path_factory.mktemp("differential")


def _described(engine: JacobianEngine) -> str:
    d = engine.describe()
    keys = ("mode", "double_reverse", "layer_rules", "jit_compile", "batch_size", "block_rows", "oom_retries", "reasons")
    return ", ".join(f"{key}={d.get(key)!r}" for key in keys)


def _refused(err: ModelError, allowed: list[str], injector: diff.OOMInjector) -> None:
    """A ModelError must be one the case allows (``diff.refusals``), or an out-of-memory error the
    engine could not shrink away: the injected error hit a block of one sample (and one row)."""
    allowed = list(allowed)
    if injector.fired and injector.fired_rows == 1:
        allowed.append(r"out of memory even for one sample and one row per block")
    assert diff.matches_any(str(err), allowed), f"refused with {err!r}; allowed: {allowed or 'none'}"
    event(f"refused: {str(err)[:60]}")


def _bucket(ratio: float) -> str:
    return next(f"<= {edge:g}" for edge in (0.001, 0.01, 0.1, 0.5, 1.0, np.inf) if ratio <= edge)


def check_engine_case(case: diff.Case, folder: Path) -> None:
    """Build the engine for ``case`` (injecting an out-of-memory error if drawn), make its calls, and
    compare every dataset with the reference."""
    s = subjects.subject(case.model)
    options = diff.engine_options(case, s, folder)
    must, may = diff.refusals(case)
    injector = diff.OOMInjector()
    if case.oom is not None and case.oom[0] == "setup":
        injector.arm(case.oom[1])
    try:
        engine = JacobianEngine(wrap_model(s.model, s.name), s.engine_shapes, options, wrap_block=injector.wrap)
    except ModelError as err:
        _refused(err, must + may, injector)
        return
    assert not must, f"the engine accepted a case it must refuse ({must}): {_described(engine)}"
    note(f"engine: {_described(engine)}")
    assert 1 <= engine.batch_size <= case.batch_size, f"batch_size {engine.batch_size} for {case.batch_size} configured"
    event(f"mode {engine.describe()['mode']}{' + XLA' if engine.describe()['jit_compile'] else ''}")
    if case.oom is not None and case.oom[0] == "compute":
        injector.arm(case.oom[1])
    kink_samples: set[int] = set()
    worst = 0.0
    for start, n in case.calls:
        labels = s.labels[start : start + n] if case.outputs.rule == "label" else None
        try:
            datasets = engine(s.batch(start, n), labels)
        except ModelError as err:
            _refused(err, [], injector)
            return
        index = datasets.get("output_index")
        if case.outputs.rule != "all":
            problems = expect.check_selection(case, s, start, index)
            assert not problems, f"call ({start}, {n}): " + "; ".join(problems)
        verdict = expect.compare(datasets, expect.expected(case, s, start, n, index), case, s, start)
        assert not verdict.problems, f"call ({start}, {n}), engine {_described(engine)}:\n" + "\n".join(verdict.problems)
        worst = max(worst, verdict.worst)
        kink_samples |= verdict.kink_samples
    event(f"largest error / allowed: {_bucket(worst)}")  # how close the strictly held samples came
    described = engine.describe()
    if injector.fired:
        event("injected OOM fired")
        assert described["oom_retries"] >= 1, f"an injected OOM went unrecorded: {_described(engine)}"
    else:
        assert described["retraces_after_setup"] == 0, f"retraced after set-up: {_described(engine)}"
    if kink_samples:
        message = f"{case.model}: samples on a kink differ from the reference within the bound: {sorted(kink_samples)}"
        event(f"{case.model}: kink samples differed")
        warnings.warn(message, stacklevel=2)


# Bugs the harness found, run first in every profile: each failed on an earlier engine.
LABEL_ABOVE_8 = diff.Case("mlp", calls=((0, 11),), batch_size=9, outputs=OutputSelection("label"))
ROWS_AFTER_OOM = diff.Case("grid", calls=((0, 11), (3, 5)), batch_size=4, memory_budget=3000, oom=("compute", 3))
# A product that needs forward mode, on a model without forward-mode rules (Resizing), under mode auto
# or autotune: the engine fell back to reverse mode and stored J itself (wrong shape) as the product.
JVP_WITHOUT_FORWARD_RULES = diff.Case("mobilenet", calls=((0, 5),), reduce="jvp", vectors=(2, False))
PROJECT_WITHOUT_FORWARD_RULES = diff.Case("mobilenet", calls=((0, 5),), reduce="project", mode="autotune")
BASIS_WITHOUT_FORWARD_RULES = diff.Case("mobilenet", calls=((0, 5),), reduce="basis", basis=(2, 3))


@given(case=diff.cases())
@example(case=LABEL_ABOVE_8)
@example(case=ROWS_AFTER_OOM)
@example(case=JVP_WITHOUT_FORWARD_RULES)
@example(case=PROJECT_WITHOUT_FORWARD_RULES)
@example(case=BASIS_WITHOUT_FORWARD_RULES)
@ENGINE_SETTINGS
def test_engine_matches_the_reference(case, arrays_folder):
    check_engine_case(case, arrays_folder)


# -- end to end: jacobeam run ---------------------------------------------------------------------------

# Every jacobian key a run can leave out, and the value the reference then assumes (README's defaults).
DEFAULTS = {
    "batch_size": 256, "mode": "auto", "jit_compile": False, "memory_budget": 2 * 2**30,
    "compute_dtype": "float32", "store_dtype": "float32", "outputs": OutputSelection(), "reduce": "none",
    "wrt": None,
}


@dataclasses.dataclass(frozen=True)
class RunCase:
    """A ``Case`` for ``jacobeam run``: which jacobian keys the config leaves at their defaults, how the
    samples are split into input files, and the output settings."""

    case: diff.Case
    omitted: frozenset[str]
    files: tuple[int, ...]  # samples per input file, in path order
    suffix: str
    samples_per_shard: int | None
    compression: str | None


@st.composite
def run_cases(draw) -> RunCase:
    case = draw(diff.cases(oom=False).filter(lambda c: not any(diff.refusals(c))))
    n = case.calls[0][1]
    # Leaving a key at its default never makes a valid case invalid: defaults select all rows, reduce
    # nothing, run in float32 without XLA, in mode auto.
    omitted = frozenset(draw(st.sets(st.sampled_from(sorted(DEFAULTS)))))
    case = dataclasses.replace(case, calls=((0, n),), **{key: DEFAULTS[key] for key in omitted})
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    files = tuple(np.diff([0, *cuts, n]).tolist())
    several = len(subjects.MODELS[case.model].inputs) > 1
    choices = [".npz", ".h5"] if several or case.outputs.rule == "label" else [".npy", ".npz", ".h5"]
    return RunCase(
        case=case,
        omitted=omitted,
        files=files,
        suffix=draw(st.sampled_from(choices)),
        samples_per_shard=draw(st.none() | st.integers(1, n + 1)),
        compression=draw(st.sampled_from([None, "none", "lzf", "gzip"])),
    )


def write_inputs(run: RunCase, folder: Path) -> dict:
    """Input files holding the pool's first samples in id order (and labels), and the ``input`` section:
    arrays are named after the model's inputs (``x`` for a one-input model), labels ``labels``."""
    s = subjects.subject(run.case.model)
    folder.mkdir(parents=True)
    start = 0
    for number, count in enumerate(run.files):
        arrays = {name: x[start : start + count] for name, x in zip(s.input_names, s.samples)}
        if run.case.outputs.rule == "label":
            arrays["labels"] = s.labels[start : start + count]
        path = folder / f"part-{number}{run.suffix}"
        if run.suffix == ".npy":
            np.save(path, arrays["x"])
        elif run.suffix == ".npz":
            np.savez(path, **arrays)
        else:
            with h5py.File(path, "w") as f:
                for key, value in arrays.items():
                    f[key] = value
        start += count
    section = {"paths": [str(folder / f"*{run.suffix}")]}
    if run.suffix != ".npy":
        section["key"] = {name: name for name in s.input_names} if len(s.input_names) > 1 else "x"
    return section


def _byte_size(size: int) -> int | str:
    """A size as the config may give it: ``"3KiB"`` where it is a whole number of KiB, else bytes."""
    return f"{size // 1024}KiB" if size % 1024 == 0 else size


def run_config(run: RunCase, root: Path) -> dict:
    """The YAML config of a run case: only the keys not left at their defaults."""
    case, s = run.case, subjects.subject(run.case.model)
    jacobian: dict = {}
    values = {
        "batch_size": case.batch_size, "mode": case.mode, "jit_compile": case.jit_compile,
        "memory_budget": _byte_size(case.memory_budget), "compute_dtype": case.compute_dtype, "store_dtype": case.store_dtype,
        "wrt": list(case.wrt) if case.wrt else "all", "reduce": case.reduce,
    }
    jacobian.update({key: value for key, value in values.items() if key not in run.omitted})
    if "outputs" not in run.omitted:
        rule = case.outputs.rule
        jacobian["outputs"] = {"indices": list(case.outputs.indices), "top_k": {"top_k": case.outputs.k}}.get(rule, rule)
    if case.outputs.rule == "label":
        jacobian["labels"] = {"key": "labels"}
    options = diff.engine_options(case, s, root)
    reduction = options.reduce
    if reduction.vectors:
        jacobian["vectors"] = reduction.vectors
    if case.reduce == "project":
        jacobian["project"] = {"dim": reduction.project_dim, "kind": reduction.project_kind, "seed": reduction.project_seed}
    if case.reduce == "basis":
        jacobian["basis"] = {"input": reduction.basis_input, "output": reduction.basis_output}
    output = {"path": str(root / "out")}
    if run.samples_per_shard is not None:
        output["samples_per_shard"] = run.samples_per_shard
    if run.compression is not None:
        output["compression"] = run.compression
    config = {
        "model": {"factory": f"tests.models:{subjects.MODELS[case.model].build.__name__}"},
        "input": write_inputs(run, root / "inputs"),
        "output": output,
    }
    if jacobian:
        config["jacobian"] = jacobian
    return config


def check_run_output(run: RunCase, out: Path) -> None:
    """Every dataset of ``jacobians.h5`` against the reference; ids in order, nothing non-finite."""
    case, s = run.case, subjects.subject(run.case.model)
    n = case.calls[0][1]
    with h5py.File(out / "jacobians.h5") as view:
        datasets = {}
        view.visititems(lambda name, item: datasets.update({name: item[()]}) if isinstance(item, h5py.Dataset) else None)
    np.testing.assert_array_equal(datasets.pop("sample_id"), np.arange(n))
    assert not datasets.pop("nonfinite").any()
    files = datasets.pop("source_files")  # each row names its own input file and row
    assert len(set(zip(files[datasets.pop("source_file")].tolist(), datasets.pop("source_row").tolist()))) == n
    index = datasets.get("output_index")
    if case.outputs.rule != "all":
        problems = expect.check_selection(case, s, 0, index)
        assert not problems, "; ".join(problems)
    verdict = expect.compare(datasets, expect.expected(case, s, 0, n, index), case, s, 0, from_hdf5=True)
    assert not verdict.problems, "\n".join(verdict.problems)


@given(run=run_cases())
@RUN_SETTINGS
def test_jacobeam_run_matches_the_reference(run, tmp_path_factory):
    """``jacobeam run CONFIG`` (in this process: ``pipeline.cli.main``), keys drawn or left at their
    defaults, input files of every format, shards of every size."""
    root = tmp_path_factory.mktemp("run")
    config = run_config(run, root)
    note(f"config: {config}")
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["-q", "run", str(root / "config.yaml")]) == 0
    check_run_output(run, root / "out")


def test_jacobeam_run_with_only_the_required_keys(tmp_path):
    """A config of ``model``, ``input.paths`` and ``output.path`` only: every other key at its default."""
    run = RunCase(diff.Case("grid", calls=((0, 13),)), frozenset(DEFAULTS), (13,), ".npy", None, None)
    config = run_config(run, tmp_path)
    assert set(config) == {"model", "input", "output"} and set(config["output"]) == {"path"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["-q", "run", str(tmp_path / "config.yaml")]) == 0
    check_run_output(run, tmp_path / "out")


@pytest.mark.slow
def test_jacobeam_run_with_two_worker_processes(tmp_path):
    """``python -m pipeline run`` as a subprocess with two worker processes: top-k rows of the CNN
    projected, stored as float16, in shards of five samples over three files."""
    case = diff.Case(
        "cnn", calls=((0, 21),), batch_size=4, outputs=OutputSelection("top_k", k=2), reduce="project",
        project=(5, "gaussian", 3), store_dtype="float16",
    )
    run = RunCase(case, frozenset(), (8, 6, 7), ".npy", 5, "lzf")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run_config(run, tmp_path)))
    command = [sys.executable, "-m", "jacobeam", "-q", "run", str(tmp_path / "config.yaml"),
               "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # worker processes import tests.models as the factory
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the run and the worker processes it started
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    check_run_output(run, tmp_path / "out")
