"""A deleted input file: the run that writes its shard again without it (rows copied, the kept samples
read and hashed, ``transforms/trim.py``) against computing that shard's remaining samples, side by side.

A folder of PNG images (one sample each, 28x28 gray) through the built-in CNN (W2) in one shard; one
image is deleted and the same command run again (the copy); the computation it replaces is a run over
the same remaining images into a fresh folder. Both in this process, after one warm-up run (imports,
the model's first trace), alternated ``--repeats`` times; the median of each is printed, with a rerun that has nothing to do
(the fixed costs of a run: planning, the view, the manifest), and their ratios.

    .venv/bin/python -m benchmarks.deleted_files --images 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _images(folder: Path, count: int) -> list[Path]:
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = folder / f"img{i:06d}.png"
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8), "L").save(path)
        paths.append(path)
    return paths


def _config(images: Path, out: Path, count: int):
    from jacobeam.pipeline import config

    return config.validate({
        "model": {"builtin": "cnn"},
        "input": {"paths": [str(images)]},
        "jacobian": {"batch_size": 256},
        "output": {"path": str(out), "samples_per_shard": count},
    })


def _timed(cfg) -> tuple[float, dict]:
    from jacobeam.pipeline import runner

    began = time.perf_counter()
    manifest = runner.run(cfg, [], show_progress=False).manifest
    return time.perf_counter() - began, manifest


def _listed(runs: list[float]) -> str:
    return ", ".join(f"{s:.2f}" for s in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jacobeam-deleted-"))
    try:
        full, kept = root / "full", root / "kept"
        paths = _images(full, args.images)
        shutil.copytree(full, kept)
        (kept / paths[args.images // 2].name).unlink()  # the remaining images, for the fresh computation
        _timed(_config(kept, root / "warm-up", args.images))
        copies, computes, noops = [], [], []
        for repeat in range(args.repeats):
            out = root / f"out{repeat}"
            images = root / f"images{repeat}"
            shutil.copytree(full, images)
            _timed(_config(images, out, args.images))
            (images / paths[args.images // 2].name).unlink()
            seconds, manifest = _timed(_config(images, out, args.images))
            assert manifest["removed"]["count"] == 1 and manifest["run"]["samples_computed"] == 0, manifest["run"]
            copies.append(seconds)
            noops.append(_timed(_config(images, out, args.images))[0])
            seconds, manifest = _timed(_config(kept, root / f"fresh{repeat}", args.images))
            assert manifest["run"]["samples_computed"] == args.images - 1
            computes.append(seconds)
        copy, compute, noop = (statistics.median(runs) for runs in (copies, computes, noops))
        print(f"{args.images} images in one shard, one deleted (median of {args.repeats}, seconds):")
        print(f"  the rerun that writes the shard without it   {copy:6.2f}  ({_listed(copies)})")
        print(f"  computing the {args.images - 1} remaining instead      {compute:6.2f}  ({_listed(computes)})")
        print(f"  a rerun with nothing to do (fixed costs)      {noop:6.2f}  ({_listed(noops)})")
        print(f"ratio computing / copying: {compute / copy:.1f}x; beyond the fixed costs: "
              f"{(compute - noop) / max(copy - noop, 1e-9):.1f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
