"""XLA in the engine: a failure falls back under ``jit_compile: auto`` and is an error when required;
auto keeps the faster of XLA and the plain graph, never one that disagrees with it."""

import time

import pytest
import tensorflow as tf

from jacobeam.transforms.engine import blocks as strategies
from jacobeam.transforms.errors import ModelError
from tests import models as test_models
from tests.engines import engine as _engine
from tests.engines import samples as _samples
from tests.reference import assert_close, tape_loop


def test_xla_failure_falls_back_under_auto_and_is_an_error_when_required():
    model = test_models.not_xla_compilable()
    x = _samples(model, 6)
    engine = _engine(model, jit_compile="auto")
    described = engine.describe()
    assert described["jit_compile"] is False
    assert any("XLA failed" in reason for reason in described["reasons"])
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)
    with pytest.raises(ModelError, match=r"XLA compilation failed \(jit_compile: true\)"):
        _engine(model, jit_compile=True)


class _Slowed:
    """A compiled block that takes ``seconds`` longer per call: to decide which path the timing picks."""

    def __init__(self, fn, seconds):
        self._fn, self._seconds = fn, seconds

    def __call__(self, *args):
        time.sleep(self._seconds)
        return self._fn(*args)

    def experimental_get_tracing_count(self):
        return self._fn.experimental_get_tracing_count()


@pytest.mark.parametrize("slow", [False, True], ids=["plain-slower", "xla-slower"])
def test_auto_keeps_the_faster_of_xla_and_the_plain_graph(monkeypatch, slow):
    model = test_models.small_mlp()
    real = strategies.build_block

    def slowed(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs):
        fn = real(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs)
        return _Slowed(fn, 0.05) if jit_compile == slow else fn

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", slowed)
    # The plain graph and XLA of pfor's path only: reverse layer rules (never slowed) would win the timing.
    monkeypatch.setattr("jacobeam.transforms.engine.reverse_layer_rules.reverse_unsupported", lambda model: "switched off")
    engine = _engine(model, jit_compile="auto")
    described = engine.describe()
    assert described["jit_compile"] is not slow
    timed = {c["path"]: c["seconds_per_sample"] for c in described["candidates"]}
    assert set(timed) == {"reverse", "reverse + XLA"}
    assert (timed["reverse + XLA"] > timed["reverse"]) is slow
    assert any(reason.startswith("timed on a full batch: reverse ") for reason in described["reasons"])
    x = _samples(model, 3)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_xla_that_disagrees_is_rejected_under_auto_however_fast(monkeypatch):
    model = test_models.small_mlp()
    real = strategies.build_block

    def wrong_under_xla(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs):
        fn = real(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs)
        if not jit_compile:
            return _Slowed(fn, 0.05)
        return tf.function(lambda *args: (lambda y, block: (y, block * 1.01))(*fn(*args)))

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", wrong_under_xla)
    engine = _engine(model, jit_compile="auto")
    assert engine.describe()["jit_compile"] is False
    assert any("disagrees" in reason for reason in engine.describe()["reasons"])
    x = _samples(model, 3)
    assert_close(engine(x)["jacobian"], tape_loop(model, x), rtol=1e-5)


def test_required_xla_is_checked_against_the_eager_reference_and_refused_when_it_disagrees(monkeypatch):
    """``jit_compile: true`` runs XLA only, but never unchecked: TensorFlow's forward mode through
    max-pooling under XLA gives wrong Jacobians (W2: relative error 0.13). The reference is the mode run
    eagerly (the plain graph, never used, is not traced)."""
    model = test_models.small_mlp()
    engine = _engine(model, jit_compile=True)
    described = engine.describe()
    assert described["jit_compile"] is True
    assert [c["path"] for c in described["candidates"]] == ["reverse, eagerly", "reverse + XLA"]
    assert described["candidates"][0]["reference_only"]
    assert next(c for c in described["candidates"] if c["path"] == "reverse + XLA")["relative_error"] < 1e-5

    real = strategies.build_block

    def wrong_under_xla(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs):
        fn = real(mode, call, shapes, wrt, rows, total, dtype, jit_compile, **kwargs)
        if not jit_compile:
            return fn
        return tf.function(lambda *args: (lambda y, block: (y, block * 1.01))(*fn(*args)))

    monkeypatch.setattr("jacobeam.transforms.engine.blocks.build_block", wrong_under_xla)
    with pytest.raises(ModelError, match=r"reverse \+ XLA disagrees with the reference .*use jit_compile auto or false"):
        _engine(model, mode="reverse", jit_compile=True)
