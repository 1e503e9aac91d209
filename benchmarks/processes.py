"""One worker process against two: the same job with and without ``--direct_num_workers 2
--direct_running_mode multi_processing``, alternating, after one warm-up run of each.

``python -m benchmarks.processes --samples 20000``
    each run a fresh ``python -m jacobeam run config.yaml`` (as a user runs it: every run pays its
    imports), timed from outside; prints the median wall times and their ratio (one / two: above 1.0 two
    processes are faster), and the manifest's ``run.wall_seconds`` (planning to manifest) of each.
``python -m benchmarks.processes --samples 20000 --launch api``
    each run a fresh ``runner.run`` in this process (as a program calling the API runs several jobs: from
    the second run on, TensorFlow is already imported here), timed around the call.

W1 (``benchmarks.workloads:w1_mlp``), inputs one ``.npy`` of standard normal float32 samples,
``batch_size: 256``, ``samples_per_shard`` as given (default the config's 4,096). The outputs of the
two are compared shard by shard: the same shards, every dataset within 1e-6 of its largest entry (each of
the two processes runs TensorFlow on half the cores, and on some CPUs the thread count changes the last
bits of float32 results: benchmarks/README.md, "bits and TensorFlow's threads").
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite import write_inputs
from benchmarks.workloads import WORKLOADS

TWO = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
REPO = Path(__file__).resolve().parent.parent


def _config(glob: str, out: Path, samples_per_shard: int) -> dict:
    return {
        "model": {"factory": WORKLOADS["mlp"].factory},
        "input": {"paths": [glob]},
        "jacobian": {"batch_size": 256},
        "output": {"path": str(out), "samples_per_shard": samples_per_shard},
    }


def _run_command(raw: dict, beam_args: list[str], folder: Path) -> float:
    import yaml

    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "jacobeam", "run", str(path), *beam_args], cwd=REPO, capture_output=True, text=True
    )
    seconds = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"jacobeam run {' '.join(beam_args)} failed:\n{done.stderr[-3000:]}")
    return seconds


def _run_api(raw: dict, beam_args: list[str], folder: Path) -> float:
    from jacobeam.pipeline import config, runner

    began = time.perf_counter()
    runner.run(config.validate(raw), beam_args, show_progress=False)
    return time.perf_counter() - began


def _same_values(one: Path, two: Path, files: list[str], rtol: float = 1e-6) -> bool:
    """Whether every dataset of each shard ``files`` of ``one`` equals the same shard's of ``two`` within
    ``rtol`` of its largest entry."""
    import h5py
    import numpy as np

    from jacobeam.transforms.finalize import view_datasets

    for file in files:
        with h5py.File(one / file) as a, h5py.File(two / file) as b:
            for name, dataset in view_datasets(a).items():
                x, y = np.asarray(dataset, np.float64), np.asarray(b[name], np.float64)
                if x.shape != y.shape or np.abs(x - y).max(initial=0.0) > rtol * max(np.abs(x).max(initial=0.0), 1e-30):
                    return False
    return True


def measure(samples: int, repeats: int, samples_per_shard: int, launch: str) -> dict:
    """Median wall times of one and two processes (``repeats`` alternating runs after a warm-up of each),
    their ratio, each run's manifest ``wall_seconds``, and whether the shards were identical."""
    run = _run_command if launch == "command" else _run_api
    with tempfile.TemporaryDirectory(prefix="jacobeam-processes-") as temp:
        folder = Path(temp)
        glob = write_inputs(WORKLOADS["mlp"], samples, folder / "data")
        found: dict[str, dict[str, list]] = {name: {"wall": [], "manifest": []} for name in ("one", "two")}
        shards: dict[str, list[str]] = {}
        for repeat in range(repeats + 1):  # the first round warms up (page cache, imports in this process)
            for name, beam_args in (("one", []), ("two", TWO)):
                out = folder / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                seconds = run(_config(glob, out, samples_per_shard), beam_args, folder)
                manifest = json.loads((out / "manifest.json").read_text())
                shards[name] = [shard["file"] for shard in manifest["shards"]]
                if repeat:
                    found[name]["wall"].append(seconds)
                    found[name]["manifest"].append(manifest["run"]["wall_seconds"])
            if shards["one"] != shards["two"] or not _same_values(folder / "out-one", folder / "out-two", shards["one"]):
                raise SystemExit("the shards of one and two processes differ")
    one, two = statistics.median(found["one"]["wall"]), statistics.median(found["two"]["wall"])
    return {"one": one, "two": two, "ratio": one / two, "runs": found, "shards": len(shards["one"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.processes", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples-per-shard", type=int, default=4096)
    parser.add_argument("--launch", choices=("command", "api"), default="command")
    args = parser.parse_args(argv)
    found = measure(args.samples, args.repeats, args.samples_per_shard, args.launch)
    what = "python -m jacobeam run (fresh processes)" if args.launch == "command" else "runner.run in this process"
    print(f"W1 mlp: {args.samples:,} samples, {found['shards']} shards, {what}, median of {args.repeats}")
    for name in ("one", "two"):
        runs = found["runs"][name]
        walls = ", ".join(f"{s:.1f}" for s in runs["wall"])
        manifests = ", ".join(f"{s:.1f}" for s in runs["manifest"])
        print(f"  {name} process{'es' if name == 'two' else ''}  {found[name]:6.2f} s  ({walls}; manifest {manifests})")
    print(f"  ratio one/two  {found['ratio']:.2f}x  (above 1: two processes take less time); shards equal within 1e-6")
    return 0


if __name__ == "__main__":
    sys.exit(main())
