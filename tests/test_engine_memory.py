"""The engine's memory budget and out-of-memory handling: smaller blocks and batches, every incomplete
sample recomputed, a clear error when nothing fits; 1,000 outputs of a 224x224x3 input within 2 GiB."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import OutputSelection
from tests import models as test_models
from tests.engines import engine as _engine
from tests.engines import samples as _samples
from tests.reference import assert_close, tape_loop

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_small_budget_forces_blocks_and_smaller_batches(mode):
    model = test_models.small_cnn()  # 64 inputs, 3 outputs
    x = _samples(model, 10)
    engine = _engine(model, mode=mode, memory_budget=6_000)
    described = engine.describe()
    extent = 64 if mode == "forward" else 3
    assert described["batch_size"] < 8 and described["block_rows"]["x"] < extent
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    assert engine.describe()["retraces_after_setup"] == 0


class _OutOfMemory:
    """A ``wrap_block`` that raises TensorFlow's out-of-memory error on chosen block calls (counted from
    1 over every block of the engine, once ``armed``), and records each call's sample count and rows."""

    def __init__(self, fail_calls=(), always=False):
        self.fail_calls, self.always, self.armed = set(fail_calls), always, False
        self.calls = []

    def __call__(self, fn):
        def run(xs, start, given):
            if self.armed:
                self.calls.append(int(xs[0].shape[0]))
                if self.always or len(self.calls) in self.fail_calls:
                    raise tf.errors.ResourceExhaustedError(None, None, "injected OOM")
            return fn(xs, start, given)

        return run


def _plan_sizes(engine, batch, rows):
    """Set an engine's plan to ``batch`` samples per sub-batch and ``rows`` rows per block, without the
    first batch's check against the reference path (its block calls would count among the plan's)."""
    from jacobeam.transforms.engine.budget import Sizes

    plan = engine._plan
    engine._plan = dataclasses.replace(plan, sizes=Sizes(batch, tuple((k, rows) for k, _ in plan.sizes.rows)))
    engine._reference = None


def test_out_of_memory_is_retried_with_smaller_blocks():
    model = test_models.small_cnn()
    x = _samples(model, 7)
    oom = _OutOfMemory(fail_calls=[1])
    engine = _engine(model, mode="reverse", wrap_block=oom)
    oom.armed = True
    result = engine(x)
    described = engine.describe()
    assert described["oom_retries"] == 1 and described["block_rows"]["x"] == 1
    assert_close(result["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_out_of_memory_part_way_recomputes_every_incomplete_sample():
    """The issue's reproduction: 16 samples, 8 per sub-batch, 1 row per block, an OOM on the first block
    call. The retry halved the batch while the loop's step stayed 8, and samples 12-15 came back as
    uninitialised memory with no error."""
    model = test_models.small_mlp()
    x = _samples(model, 16)
    expected = tape_loop(model, x)
    for fail_at in (1, 2, 5, 7):  # the first call; a later row of the first sub-batch; the second sub-batch
        oom = _OutOfMemory(fail_calls=[fail_at])
        engine = _engine(model, mode="reverse", batch_size=8, wrap_block=oom)
        _plan_sizes(engine, batch=8, rows=1)
        oom.armed = True
        result = engine(x)
        assert engine.describe()["oom_retries"] == 1
        assert np.isfinite(result["jacobian"]).all()
        assert_close(result["jacobian"], expected, rtol=1e-5)
        assert_close(result["output"], model(x).numpy(), rtol=1e-6)


def test_out_of_memory_retries_use_the_smaller_batch_for_every_remaining_sample():
    model = test_models.small_mlp()
    x = _samples(model, 16)
    oom = _OutOfMemory(fail_calls=[1, 2])
    engine = _engine(model, mode="reverse", batch_size=8, wrap_block=oom)
    _plan_sizes(engine, batch=8, rows=1)
    oom.armed = True
    result = engine(x)
    # Two failures at one row per block: the batch halves twice; every later call has 2 samples.
    assert oom.calls[:2] == [8, 4] and set(oom.calls[2:]) == {2}
    assert engine.batch_size == 2 and engine.describe()["oom_retries"] == 2
    assert_close(result["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_persistent_out_of_memory_is_a_clear_error():
    model = test_models.small_mlp()
    oom = _OutOfMemory(always=True)
    engine = _engine(model, mode="reverse", batch_size=4, wrap_block=oom, memory_budget=10**9)
    oom.armed = True
    with pytest.raises(ModelError, match=r"\w+: out of memory even for one sample and one row per block "
                                         r"\(samples x rows per block tried: 4 x \{'x': 5\}, .*1 x \{'x': 1\}; "
                                         r"memory_budget 1,000,000,000 bytes\)"):
        engine(_samples(model, 6))


def test_an_error_of_jacobeams_own_code_surfaces_instead_of_a_fallback(monkeypatch):
    """Falling back to another path is for what TensorFlow cannot run; a TypeError raised by jacobeam's
    own code is a bug. (The function is compiled under the engine's file name: raised by jacobeam.)"""
    from jacobeam.transforms.engine import operands

    namespace = {}
    code = "def select(self, n, y, labels):\n    raise TypeError('a bug in jacobeam')\n"
    exec(compile(code, operands.__file__, "exec"), namespace)
    monkeypatch.setattr(operands.Operands, "select", namespace["select"])
    with pytest.raises(TypeError, match="a bug in jacobeam"):
        _engine(test_models.small_mlp(), outputs=OutputSelection(rule="argmax"))


@pytest.mark.slow
def test_thousand_outputs_on_224x224x3_within_a_2gib_budget():
    """Peak memory is measured in a fresh process: one sample's Jacobian alone is 602 MB."""
    script = REPO / "tests" / "budget_probe.py"
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    assert int(report["batch"]) == 1
    assert float(report["max_rel_error"]) < 1e-5
    assert int(report["growth"]) <= 2 * 2**30, report
