"""What the performance targets (``benchmarks/targets.py``) run on: a workload's ``model.factory``, its
seeded samples and their input files, the ``jacobian run`` config, and the hand-written in-memory loop a
run is measured against."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SALIENCY_SHAPE = (224, 224, 3)
BATCH = 256


def rate(call: Callable[[], None], samples: int) -> Callable[[], float]:
    def timed() -> float:
        began = time.perf_counter()
        call()
        return samples / (time.perf_counter() - began)

    return timed


def factory(workload: str) -> str:
    """The workload's ``model.factory``."""
    from benchmarks.workloads import WORKLOADS

    return WORKLOADS[workload].factory if workload in WORKLOADS else f"benchmarks.workloads:{workload}"


QUICKSTART = "quickstart"  # the README quickstart's CNN on its bar images (``workloads.quickstart``)


def samples_of(workload: str, samples: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Standard normal samples from seed 1 (labels too, for the saliency models); the quickstart's bar images."""
    from benchmarks.workloads import WORKLOADS, bars, inputs

    if workload in WORKLOADS:
        return inputs(WORKLOADS[workload], samples), None
    if workload == QUICKSTART:
        return bars(samples, 1), None
    rng = np.random.default_rng(1)
    return rng.standard_normal((samples, *SALIENCY_SHAPE), dtype=np.float32), rng.integers(0, 1000, size=samples)


def run_config(workload: str, glob: str, out: Path) -> Any:
    from benchmarks.workloads import WORKLOADS
    from jacobeam.pipeline import config

    if workload in WORKLOADS:
        raw = {
            "model": {"factory": factory(workload)},
            "input": {"paths": [glob]},
            "jacobian": {"batch_size": BATCH},
            "output": {"path": str(out)},
        }
    elif workload == QUICKSTART:  # every key at its default
        raw = {"model": {"factory": factory(workload)}, "input": {"paths": [glob]}, "output": {"path": str(out)}}
    else:
        raw = {
            "model": {"factory": factory(workload)},
            "input": {"paths": [glob], "key": "x"},
            # Every other key at its default: the self-check on (on_mismatch: fail), batch_size 256.
            "jacobian": {"outputs": "label", "labels": {"key": "labels"}, "reduce": "sum_abs_over_channels"},
            "output": {"path": str(out)},
        }
    return config.validate(raw)


def write_inputs(x: np.ndarray, labels: np.ndarray | None, folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    if labels is None:
        np.save(folder / "x.npy", x)
        return str(folder / "*.npy")
    np.savez(folder / "x.npz", x=x, labels=labels)
    return str(folder / "*.npz")


def hand_written(workload: str) -> Callable[[np.ndarray, np.ndarray | None], None]:
    """The in-memory loop's per-batch call, computing only what the run stores."""
    import tensorflow as tf

    from benchmarks.rows import build, row_specs
    from benchmarks.workloads import APPLICATIONS, WORKLOADS

    if workload in WORKLOADS:
        (spec,) = [s for s in row_specs([], None, {}) if s.id == "tf_batch_jacobian"]
        row = build(spec, WORKLOADS[workload])
        return lambda x, labels: row.jacobians(x)
    if workload == QUICKSTART:  # what the README calls the seed's own answer: batch_jacobian in a tf.function
        from benchmarks.workloads import quickstart

        model = quickstart()

        @tf.function(input_signature=[tf.TensorSpec((None, 28, 28, 1), tf.float32)])
        def jacobian(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = model(x)
            return tape.batch_jacobian(y, x)

        return lambda x, labels: jacobian(x).numpy()
    from benchmarks.saliency import hand_written_saliency

    saliency = hand_written_saliency(APPLICATIONS[workload]())
    return lambda x, labels: saliency(tf.constant(x), tf.constant(labels, tf.int64)).numpy()
