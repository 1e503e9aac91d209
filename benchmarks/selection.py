"""What-to-store benchmark: asking for less must cost less.

``python -m benchmarks.selection [--quick]`` times jacobeam's engine, side by side in one process, on
workload W3 (``wide``: x[16] -> 256 tanh -> 256 tanh -> 512, 512 x 16 Jacobians) and W1 (``mlp``:
784 -> 512 -> 512 -> 10), computing the full Jacobian and computing only what a user asked for:
one row per sample (``argmax``), four fixed rows, a 4-column random projection, a vector-Jacobian
product with one fixed vector. It prints samples/s (median of repeats after warm-up) and each row's
speed relative to the full Jacobian. Nothing here asserts on time: the numbers are for reading.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np


def _wide():
    import keras

    from jacobeam.transforms.engine.models import seeded_weights

    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(512),
        ]
    )
    seeded_weights(model, seed=0)
    return model


def _mlp():
    from jacobeam.transforms.engine.models import build_mlp

    return build_mlp()


def _rows(model, folder: str):
    from jacobeam.transforms.spec import OutputSelection, Reduction

    m = int(np.prod(model.output_shape[1:]))
    vector = os.path.join(folder, "u.npy")
    np.save(vector, np.random.default_rng(0).normal(size=(1, m)))
    return [
        ("full Jacobian", {}),
        ("outputs: argmax (1 row)", {"outputs": OutputSelection("argmax")}),
        ("outputs: [0, 1, 2, 3]", {"outputs": OutputSelection("indices", indices=(0, 1, 2, 3))}),
        ("reduce: project, dim 4", {"reduce": Reduction("project", project_dim=4)}),
        ("reduce: vjp, 1 vector", {"reduce": Reduction("vjp", vectors=vector)}),
    ]


def _time(engine, x: np.ndarray, repeats: int) -> float:
    engine(x)  # warm-up (traced during set-up already; this settles allocations)
    runs = []
    for _ in range(repeats):
        began = time.perf_counter()
        engine(x)
        runs.append(time.perf_counter() - began)
    return len(x) / statistics.median(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.selection", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats")
    args = parser.parse_args(argv)
    from jacobeam.transforms.engine import JacobianEngine
    from jacobeam.transforms.engine.models import wrap_model
    from jacobeam.transforms.spec import EngineOptions

    n, repeats = (512, 3) if args.quick else (2048, 5)
    with tempfile.TemporaryDirectory() as folder:
        for name, build in (("W3 wide [512 x 16]", _wide), ("W1 mlp [10 x 784]", _mlp)):
            model = build()
            x = np.random.default_rng(1).standard_normal((n, *model.input_shape[1:])).astype(np.float32)
            print(f"\n{name}, {n} samples, batch 256")
            print(f"  {'what is stored':<28} {'mode':<9} {'samples/s':>11} {'vs full':>8}")
            full = None
            for label, options in _rows(model, folder):
                engine = JacobianEngine(wrap_model(model, name), model.input_shape[1:], EngineOptions(batch_size=256, **options))
                rate = _time(engine, x, repeats)
                full = full or rate
                print(f"  {label:<28} {engine.describe()['mode']:<9} {rate:>11,.0f} {rate / full:>7.1f}x")


if __name__ == "__main__":
    main()
