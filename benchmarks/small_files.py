"""Many small files against one: the same samples computed end to end from one file per sample and from
one ``.npy``, side by side in one process.

``python -m benchmarks.small_files --samples 100000 --formats npy,png --repeats 1``
    W2 (``cnn``, 28×28×1) with ``outputs: argmax`` (one VJP per sample: about 1,000 samples/s on two
    cores, so that reading is a real share of a run), ``batch_size`` 256, the other keys at their
    defaults. ``npy``: seeded standard normal float32 samples, one ``(1, 28, 28, 1)`` ``.npy`` per sample
    against all of them in one ``.npy``; ``npz``, ``h5`` likewise; ``png``: seeded 8-bit grey images, one
    PNG each, against one ``.npy`` of the float32 values they decode to. Each run is ``runner.run`` into
    a fresh folder, planning included; the two sides of a ratio alternate, the folder first in one
    repeat, the file in the next. Prints, per format, samples/s of each side (the median over the
    repeats) end to end (wall time from the config to the manifest) and as the manifest reports the run
    (``run.samples_per_second``: planning left out), their ratios, and the time ``plan.make_job`` takes
    on the files; the end-to-end ratio is also a target (``python -m benchmarks --only small_files``).

``python -m benchmarks.small_files --read-only --samples 4096 --formats npy,npz,h5,png --repeats 5``
    reading alone: ``read.shard_batches`` over every range of either side, nothing computed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPE = (28, 28, 1)
FORMATS = ("npy", "npz", "h5", "png")


def samples_of(fmt: str, count: int) -> np.ndarray:
    """The samples as the pipeline reads them: float32 standard normal from seed 1; for ``png``, the
    values its 8-bit images decode to (``x / 255``)."""
    rng = np.random.default_rng(1)
    if fmt == "png":
        return rng.integers(0, 256, (count, *SHAPE), dtype=np.uint8)
    return rng.standard_normal((count, *SHAPE), dtype=np.float32)


def write_files(fmt: str, x: np.ndarray, folder: Path) -> str:
    """One file per sample into ``folder`` (names sort in sample order); returns their glob."""
    folder.mkdir(parents=True)
    if fmt == "png":
        import tensorflow as tf

        for i, image in enumerate(x):
            (folder / f"{i:07d}.png").write_bytes(tf.io.encode_png(image).numpy())
    elif fmt == "h5":
        import h5py

        for i in range(len(x)):
            with h5py.File(folder / f"{i:07d}.h5", "w") as h5:
                h5["x"] = x[i : i + 1]
    else:
        save = np.save if fmt == "npy" else lambda path, rows: np.savez(path, x=rows)
        for i in range(len(x)):
            save(folder / f"{i:07d}.{fmt}", x[i : i + 1])
    return str(folder / f"*.{fmt}")


def write_one(fmt: str, x: np.ndarray, folder: Path) -> str:
    """The same samples as one ``.npy`` (for ``png``, the float32 values the images decode to)."""
    folder.mkdir(parents=True)
    values = x.astype(np.float32) * np.float32(1 / 255) if fmt == "png" else x
    np.save(folder / "all.npy", values)
    return str(folder / "all.npy")


def run_config(glob: str, out: Path):
    from jacobeam.pipeline import config

    return config.validate(
        {
            "model": {"factory": "benchmarks.workloads:w2_cnn"},
            "input": {"paths": [glob]},
            "jacobian": {"batch_size": 256, "outputs": "argmax"},
            "output": {"path": str(out)},
        }
    )


def measure(fmt: str, samples: int, repeats: int) -> dict[str, float]:
    """Median samples/s of the files and of the one file: end to end (``files``, ``one``: the samples over
    ``runner.run``'s wall time) and as the run reports them (``files_run``, ``one_run``: the manifest's
    ``run.samples_per_second``, planning left out); and the files' planning time (``plan.make_job``
    alone, the model not loaded)."""
    import json

    from jacobeam.pipeline import plan, runner

    x = samples_of(fmt, samples)
    with tempfile.TemporaryDirectory(prefix="jacobeam-small-files-") as temp:
        globs = {"files": write_files(fmt, x, Path(temp) / "files"), "one": write_one(fmt, x, Path(temp) / "one")}
        out = Path(temp) / "out"

        def rates(side: str) -> tuple[float, float]:
            shutil.rmtree(out, ignore_errors=True)
            began = time.perf_counter()
            runner.run(run_config(globs[side], out), [], show_progress=False)
            wall = time.perf_counter() - began
            return samples / wall, json.loads((out / "manifest.json").read_text())["run"]["samples_per_second"]

        rates("one")  # warm-up: imports, the engine's first trace
        began = time.perf_counter()
        plan.make_job(run_config(globs["files"], Path(temp) / "planned"), check_model=False)
        planning = time.perf_counter() - began
        found: dict[str, list[tuple[float, float]]] = {"files": [], "one": []}
        for repeat in range(repeats):
            for side in ("files", "one") if repeat % 2 == 0 else ("one", "files"):
                found[side].append(rates(side))
    medians = {side: [statistics.median(rate) for rate in zip(*values)] for side, values in found.items()}
    return {
        "files": medians["files"][0],
        "one": medians["one"][0],
        "files_run": medians["files"][1],
        "one_run": medians["one"][1],
        "planning": planning,
    }


def read_rates(fmt: str, samples: int, repeats: int) -> dict[str, float]:
    """Reading alone: median samples/s of ``read.shard_batches`` over every range of the files and of the
    one file (as ``ComputeShards`` reads them; nothing computed), alternating after a warm-up."""
    from jacobeam.pipeline import plan
    from jacobeam.transforms.read import shard_batches

    x = samples_of(fmt, samples)
    with tempfile.TemporaryDirectory(prefix="jacobeam-small-files-") as temp:
        specs = {
            side: plan.make_job(run_config(write(fmt, x, Path(temp) / side), Path(temp) / f"out-{side}"), check_model=False).spec
            for side, write in (("files", write_files), ("one", write_one))
        }

        def rate(side: str) -> float:
            spec, began = specs[side], time.perf_counter()
            read = sum(len(batch) for shard in spec.ranges() for batch in shard_batches(spec, shard))
            if read != samples:
                raise RuntimeError(f"read {read} samples of {samples}")
            return samples / (time.perf_counter() - began)

        rate("files"), rate("one")  # warm-up
        found: dict[str, list[float]] = {"files": [], "one": []}
        for repeat in range(repeats):
            for side in ("files", "one") if repeat % 2 == 0 else ("one", "files"):
                found[side].append(rate(side))
    return {side: statistics.median(values) for side, values in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.small_files", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--formats", default="npy,png", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--read-only", action="store_true", help="time reading alone (read.shard_batches)")
    args = parser.parse_args(argv)
    for fmt in args.formats.split(","):
        if args.read_only:
            found = read_rates(fmt, args.samples, args.repeats)
            print(
                f"{args.samples:,} one-sample .{fmt} files read alone: {found['files']:,.0f} samples/s, one .npy "
                f"{found['one']:,.0f}: {found['files'] / found['one']:.2f}x",
                flush=True,
            )
            continue
        found = measure(fmt, args.samples, args.repeats)
        print(
            f"{args.samples:,} one-sample .{fmt} files: end to end {found['files']:,.0f} samples/s against one .npy "
            f"{found['one']:,.0f}: {found['files'] / found['one']:.2f}x; the runs alone (manifest) {found['files_run']:,.0f} "
            f"against {found['one_run']:,.0f}: {found['files_run'] / found['one_run']:.2f}x; planning the files alone "
            f"{found['planning']:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
