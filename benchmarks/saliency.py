"""Per-label saliency benchmark: the engine against a hand-written ``tf.function``, side by side.

``python -m benchmarks.saliency [--model resnet50|mobilenet_v2|efficientnet_b0] [--batch 8] [--repeats 5]
[--images 256] [--samples-per-shard N] [--end-to-end-only]`` builds a Keras application with seeded
random weights (nothing downloaded).

First, end to end at the defaults: ``jacobeam run``'s pipeline (``runner.run``, in-process) on
``--images`` preprocessed images with labels, every key at its default but ``outputs: label``, ``labels``
and ``reduce: sum_abs_over_channels`` (so the self-check is on, 4 samples per 4,096 ids of a shard,
``on_mismatch: fail``), against the hand-written function over the same images in batches of
``--batch``; the ratio is the hand-written time over the pipeline's wall time (planning to manifest:
engine set-up and the self-check's float64 copy included), and the run's precision line is printed.
With ``--samples-per-shard`` below ``--images`` (16: an incremental run's shards), a one-shard run
follows and the pipeline's marginal rate beyond one shard is set against the hand-written rate. Then
(unless ``--end-to-end-only``) it times on the same batches, interleaved in one process:

- ``hand-written``: a ``tf.function`` taking the gradient of the summed label logits and summing
  ``|.|`` over channels: exactly what ``outputs: label, reduce: sum_abs_over_channels`` stores;
- ``engine``: ``JacobianEngine`` with those options (what ``jacobeam run`` calls per batch);
- ``engine + forward``: the engine after a separate forward pass, as it ran before a label selection
  stopped needing one (so the ratio of the two engine rows is what that change saved);
- ``engine, float64``: the engine with ``compute_dtype: float64`` (the float64 copy of the model), what
  accurate maps cost.

It prints samples/s (median of the repeats after one warm-up each), each row's ratio to the
hand-written one, the engine's set-up time against one batch, and the max relative error of the
engine's saliency against the hand-written one; then the first batch after set-up, and the set-up and
first batch of a second engine given the first one's decisions (``engine-plan.json`` of a resumed
run: no checks or probes; in the same process, so Python's and TensorFlow's caches are warm for it).
Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from benchmarks.workloads import APPLICATIONS


def hand_written_saliency(model):
    """What ``outputs: label, reduce: sum_abs_over_channels`` stores, written by hand: one forward and one
    backward pass per batch. Returns ``f(images, labels) -> (n, H, W)`` tensor."""
    import tensorflow as tf

    shape = tuple(model.input_shape[1:])

    @tf.function(input_signature=[tf.TensorSpec((None, *shape), tf.float32), tf.TensorSpec((None,), tf.int64)])
    def saliency(images, targets):
        with tf.GradientTape() as tape:
            tape.watch(images)
            logits = model(images, training=False)
            chosen = tf.reduce_sum(tf.gather(logits, targets, batch_dims=1))
        return tf.reduce_sum(tf.abs(tape.gradient(chosen, images)), axis=-1)

    return saliency


def end_to_end(name: str, images: int, batch: int, samples_per_shard: int | None = None) -> None:
    """The pipeline at the defaults against the hand-written function on the same images (module docstring).
    With ``samples_per_shard`` below ``images``, a run of one such shard follows, and the pipeline's
    marginal rate (the images beyond one shard over the extra time) is set against the hand-written rate."""
    import keras

    from jacobeam.pipeline import config, runner
    from jacobeam.pipeline.self_check_report import precision_line

    model = APPLICATIONS[name]()
    preprocess = {"resnet50": keras.applications.resnet50, "mobilenet_v2": keras.applications.mobilenet_v2,
                  "efficientnet_b0": keras.applications.efficientnet}[name].preprocess_input
    rng = np.random.default_rng(0)
    x = preprocess(rng.uniform(0, 255, (images, *model.input_shape[1:])).astype(np.float32))
    labels = rng.integers(0, model.output_shape[-1], images)
    hand_written = hand_written_saliency(model)
    hand_written(x[:batch], labels[:batch])  # traced before it is timed
    began = time.perf_counter()
    for lo in range(0, images, batch):
        hand_written(x[lo : lo + batch], labels[lo : lo + batch]).numpy()
    hand = time.perf_counter() - began
    def run(count: int, out: str) -> dict:
        np.savez(os.path.join(temp, f"{out}.npz"), x=x[:count], y=labels[:count])
        cfg = config.validate({
            "model": {"factory": f"benchmarks.workloads:{name}"},
            "input": {"paths": [os.path.join(temp, f"{out}.npz")], "key": "x"},
            "jacobian": {"outputs": "label", "labels": {"key": "y"}, "reduce": "sum_abs_over_channels"},
            "output": {"path": os.path.join(temp, out), **shards},
        })
        return runner.run(cfg, [], show_progress=False).manifest

    shards = {"samples_per_shard": samples_per_shard} if samples_per_shard else {}
    with tempfile.TemporaryDirectory(prefix="jacobeam-saliency-") as temp:
        manifest = run(images, "all")
        # After the full run, so that anything a process keeps (the loaded model) favours the small one:
        # the marginal rate errs low.
        small = run(samples_per_shard, "one") if samples_per_shard and samples_per_shard < images else None
    wall, checks = manifest["run"]["wall_seconds"], manifest["self_check"]
    print(f"{name}: {images} images at the defaults (self-check on: {checks['samples_checked']} checked, "
          f"{checks['seconds']:.1f} s of it)")
    print(f"  jacobeam run (pipeline) {wall:7.1f} s = {images / wall:6.2f} samples/s")
    print(f"  hand-written, batch {batch:<4} {hand:7.1f} s = {images / hand:6.2f} samples/s")
    print(f"  ratio                   {hand / wall:7.2f}x (goal >= 0.95x)")
    if small is not None:
        extra = wall - small["run"]["wall_seconds"]
        print(f"  marginal, shards of {samples_per_shard}: {images - samples_per_shard} images beyond one shard in "
              f"{extra:.1f} s = {(images - samples_per_shard) / extra:.2f} samples/s ({small['self_check']['samples_checked']} "
              f"check(s) in the one-shard run): {(images - samples_per_shard) / extra / (images / hand):.2f}x hand-written")
    print(f"  precision: {precision_line(checks, 'float32')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.saliency", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(APPLICATIONS), default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--images", type=int, default=256, help="images of the end-to-end run at the defaults (0: skip it)")
    parser.add_argument("--samples-per-shard", type=int, default=None,
                        help="output.samples_per_shard of the end-to-end run (default: its default); below "
                        "--images, also the marginal rate beyond one shard")
    parser.add_argument("--end-to-end-only", action="store_true", help="skip the interleaved engine rows")
    args = parser.parse_args(argv)
    if args.images:
        end_to_end(args.model, args.images, args.batch, args.samples_per_shard)
    if args.end_to_end_only:
        return

    from jacobeam.transforms.engine import JacobianEngine
    from jacobeam.transforms.engine.diagnostics import relative_error
    from jacobeam.transforms.engine.models import wrap_model
    from jacobeam.transforms.spec import EngineOptions, OutputSelection, Reduction

    model = APPLICATIONS[args.model]()
    shape = tuple(model.input_shape[1:])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.batch, *shape)).astype(np.float32)
    labels = rng.integers(0, model.output_shape[-1], size=args.batch)

    hand_written = hand_written_saliency(model)
    options = EngineOptions(
        batch_size=args.batch, outputs=OutputSelection("label"), reduce=Reduction("sum_abs_over_channels")
    )
    began = time.perf_counter()
    engine = JacobianEngine(wrap_model(model, args.model), shape, options)
    setup = time.perf_counter() - began
    first = time.perf_counter()
    engine(x, labels)
    first = time.perf_counter() - first
    # A resumed run's engine: the decisions the first one cached (engine-plan.json), no checks or probes.
    began = time.perf_counter()
    reused = JacobianEngine(wrap_model(model, args.model), shape, options, decisions=engine.decisions)
    reused_setup = time.perf_counter() - began
    reused_first = time.perf_counter()
    reused(x, labels)
    reused_first = time.perf_counter() - reused_first

    # compute_dtype: float64, the way to accurate maps on deep nets (docs/verifying.md): its speed beside float32's.
    float64 = JacobianEngine(wrap_model(model, args.model), shape, dataclasses.replace(options, compute_dtype="float64"))
    rows = {
        "hand-written": lambda: hand_written(x, labels).numpy(),
        "engine": lambda: engine(x, labels)["saliency"],
        "engine + forward": lambda: (engine._forward([x]), engine(x, labels)["saliency"])[1],
        "engine, float64": lambda: float64(x, labels)["saliency"],
    }
    results = {name: row() for name, row in rows.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, row in rows.items():
            started = time.perf_counter()
            row()
            times[name].append(time.perf_counter() - started)
    speed = {name: args.batch / statistics.median(runs) for name, runs in times.items()}
    batch_seconds = statistics.median(times["engine"])
    print(f"{args.model}: batch {args.batch}, input {shape}, median of {args.repeats} interleaved repeats")
    print(f"{'row':<18} {'samples/s':>10} {'x hand-written':>15}")
    for name in rows:
        print(f"{name:<18} {speed[name]:>10.2f} {speed[name] / speed['hand-written']:>14.2f}x")
    error = relative_error(np.asarray(results["engine"]).reshape(args.batch, -1), results["hand-written"].reshape(args.batch, -1))
    print(f"engine set-up {setup:.1f} s = {setup / batch_seconds:.1f} batches; max relative error {error:.1e}")
    print(
        f"first batch after set-up {first:.1f} s; with the decisions reused (a resumed run): set-up "
        f"{reused_setup:.1f} s = {reused_setup / batch_seconds:.1f} batches, first batch {reused_first:.1f} s; "
        f"set-up + first batch {(setup + first) / batch_seconds:.1f} -> "
        f"{(reused_setup + reused_first) / batch_seconds:.1f} batches"
    )


if __name__ == "__main__":
    main()
