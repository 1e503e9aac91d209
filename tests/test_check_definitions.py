"""The checks' own definitions of every stored dataset (``transforms.reference_datasets``) agree with the
engine across the configuration space: for configurations drawn as the differential harness draws them
(every model, selection, reduction, product, mode, dtype and batch size; ``tests.differential``), the
values the engine stores pass the self-check's rule, and the same values made wrong fail it.

That the rule catches the wrong values users would meet is ``tests/test_mutants.py``'s matrix; here it is
that no configuration's right values are called wrong, and none of its wrong ones passes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, note

from jacobeam.transforms import self_check
from jacobeam.transforms.engine import JacobianEngine
from jacobeam.transforms.engine.models import wrap_model
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import EngineOptions, Reduction, SelfCheck
from tests import differential as diff
from tests import differential_models as subjects
from tests.test_differential import ENGINE_SETTINGS, arrays_folder  # noqa: F401 (a fixture)

NOT_RESULTS = ("output", "output_index")


def _wrong(values: np.ndarray) -> np.ndarray:
    """1.5x, shifted by a tenth of the largest entry (and of 1): wrong at every scale, zeros included."""
    wide = np.asarray(values, np.float64)
    return (1.5 * wide + 0.1 * (np.abs(wide[np.isfinite(wide)]).max(initial=0.0) + 1.0)).astype(values.dtype)


@given(case=diff.cases(oom=False))
@ENGINE_SETTINGS
def test_right_values_pass_and_wrong_ones_fail_in_every_configuration(case, arrays_folder):  # noqa: F811
    s = subjects.subject(case.model)
    try:
        engine = JacobianEngine(wrap_model(s.model, s.name), s.engine_shapes, diff.engine_options(case, s, arrays_folder))
    except ModelError:
        return  # a configuration the engine refuses (the differential harness checks which)
    start, n = case.calls[0]
    labels = s.labels[start : start + n] if case.outputs.rule == "label" else None
    stored = engine(s.batch(start, n), labels)
    checker = self_check.SelfChecker(engine, SelfCheck())
    inputs = s.batch(start, n)
    event(f"mode {engine.describe()['mode']}, reduce {case.reduce}, outputs {case.outputs.rule}")
    for i in range(min(n, 2)):
        xs = [inputs[name][i : i + 1] for name in engine.input_names] if isinstance(inputs, dict) else [inputs[i : i + 1]]
        row = {name: values[i : i + 1] for name, values in stored.items()}
        label = int(labels[i]) if labels is not None else None
        right = checker.check(xs, row, start + i, label)
        note(f"sample {i}: {right}")
        assert right["verdict"] != self_check.MISMATCH, right
        if not np.isfinite(np.concatenate([np.ravel(v) for k, v in row.items() if k not in NOT_RESULTS])).all():
            continue  # a sample without a derivative (NaN where the model is not differentiable): nothing to make wrong
        wrong = checker.check(xs, {k: v if k in NOT_RESULTS else _wrong(v) for k, v in row.items()}, start + i, label)
        assert wrong["verdict"] == self_check.MISMATCH, wrong


# Every reduction and product on a square model, in both modes: each definition met at least once.
_KINDS = ("none", "frobenius", "diagonal", "trace", "slogdet", "max_abs_over_outputs", "sum_abs_over_channels",
          "vjp", "jvp", "project", "basis")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("kind", _KINDS)
def test_every_reduction_and_product_passes_right_and_fails_wrong(tmp_path, kind, mode):
    from tests.models import square_softplus

    rng = np.random.default_rng(4)
    files = {}
    for name, shape in (("vectors", (2, 6)), ("basis_input", (6, 3)), ("basis_output", (6, 2))):
        files[name] = str(tmp_path / f"{name}.npy")
        np.save(files[name], rng.normal(size=shape))
    reduction = Reduction(kind, vectors=files["vectors"] if kind in ("vjp", "jvp") else None, project_dim=4,
                          basis_input=files["basis_input"] if kind == "basis" else None,
                          basis_output=files["basis_output"] if kind == "basis" else None)
    model = square_softplus()
    engine = JacobianEngine(wrap_model(model, "square_softplus"), (6,), EngineOptions(batch_size=4, mode=mode, reduce=reduction))
    x = rng.normal(size=(3, 6)).astype(np.float32)
    stored = engine(x)
    checker = self_check.SelfChecker(engine, SelfCheck())
    for i in range(3):
        row = {name: values[i : i + 1] for name, values in stored.items()}
        assert checker.check([x[i : i + 1]], row, i)["verdict"] == self_check.OK
        wrong = {k: v if k in NOT_RESULTS else _wrong(v) for k, v in row.items()}
        assert checker.check([x[i : i + 1]], wrong, i)["verdict"] == self_check.MISMATCH
