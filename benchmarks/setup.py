"""The engine's set-up against one batch, in fresh processes, and the time to the first shard.

``python -m benchmarks.setup [--workloads mlp,cnn,wide,flow] [--repeats 3] [--first-shard N]``

For each workload (batch 256), ``--repeats`` rounds of two fresh processes each, one after the other:
``probed`` builds the engine with no cached decisions (what a fresh run's worker does), ``reused``
with the decisions the probing process wrote (what a resumed or incremental run's worker does, from
``engine-plan.json``). Each process loads the model (``load s``), builds the engine (``set-up s``: the
checks, probes and timings, or the reused decisions and the trace of the plan's block), then times its
first batch and the median of 3 more (``batch s``). It prints medians over the rounds and set-up / batch.

``--first-shard N`` also runs ``python -m jacobeam run`` on W2 ``cnn`` with N samples (512 per shard):
a fresh output folder, then the same folder with its shards and manifest removed but its
``engine-plan.json`` kept; each time from process start until the first ``shards/*.h5`` appears
(``--repeats`` rounds, medians). It prints the machine's load average, as the targets are for an idle one.

Nothing asserts on time: on a shared machine read the ratios, and the rows of one run against each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 256


def _child(workload_name: str, cache: str) -> None:
    """One fresh process: load, set up (with the decisions in ``cache`` if the file exists), time batches."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    began = time.perf_counter()
    from benchmarks import workloads
    from jacobeam.transforms.engine import JacobianEngine
    from jacobeam.transforms.engine.models import load
    from jacobeam.transforms.spec import EngineOptions

    imported = time.perf_counter()
    workload = workloads.WORKLOADS[workload_name]
    model = load(factory=workload.factory)
    loaded = time.perf_counter()
    decisions = json.loads(Path(cache).read_text()) if Path(cache).exists() else None
    engine = JacobianEngine(model, workload.input_shape, EngineOptions(batch_size=BATCH), decisions=decisions)
    ready = time.perf_counter()
    if decisions is None and engine.decisions is not None:
        Path(cache).write_text(json.dumps(engine.decisions, default=str))
    x = workloads.inputs(workload, BATCH)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        engine(x)
        times.append(time.perf_counter() - started)
    print(json.dumps({
        "import": imported - began, "load": loaded - imported, "setup": ready - loaded,
        "first_batch": times[0], "batch": statistics.median(times[1:]), "plan_cache": engine.describe()["plan_cache"],
    }))


def _run_child(workload: str, cache: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.setup", "--child", workload, "--cache", str(cache)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_shard_seconds(config: Path, out: Path) -> float:
    """``python -m jacobeam run config`` (writing to ``out``): seconds from starting the process until the
    first complete shard is in ``out/shards`` (at the latest, until the process ended); waits for it to end.
    RuntimeError if it fails or writes no shard."""
    shards = out / "shards"
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "jacobeam", "run", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    first = None
    while process.poll() is None:
        if first is None and shards.is_dir() and any(shards.glob("shard-*.h5")):
            first = time.perf_counter() - began
        time.sleep(0.01)
    if process.returncode:
        raise RuntimeError(f"jacobeam run exited {process.returncode}")
    if first is None and not any(shards.glob("shard-*.h5")):
        raise RuntimeError("jacobeam run wrote no shard")
    return first if first is not None else time.perf_counter() - began


def _first_shard(samples: int, repeats: int) -> None:
    from benchmarks import workloads

    workload = workloads.WORKLOADS["cnn"]
    with tempfile.TemporaryDirectory(prefix="jacobeam-setup-") as tmp:
        root = Path(tmp)
        np.save(root / "x.npy", workloads.inputs(workload, samples))
        found: dict[str, list[float]] = {"fresh folder": [], "decisions kept": []}
        for round_ in range(repeats):
            out = root / f"out{round_}"
            (root / "config.yaml").write_text(json.dumps({
                "model": {"factory": workload.factory},
                "input": {"paths": [str(root / "x.npy")]},
                "jacobian": {"batch_size": BATCH},
                "output": {"path": str(out), "samples_per_shard": 512},
            }))
            for label in found:
                if label == "decisions kept":
                    for path in [*(out / "shards").iterdir(), out / "manifest.json", out / "jacobians.h5"]:
                        path.unlink()
                try:
                    found[label].append(first_shard_seconds(root / "config.yaml", out))
                except RuntimeError as err:
                    raise SystemExit(f"{err} ({label})") from err
        print(f"\nW2 cnn, python -m jacobeam run on {samples:,} samples: time from process start to the first shard, "
              f"median of {repeats}; load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
        for label, times in found.items():
            print(f"  {label:<16} {statistics.median(times):6.2f} s  ({', '.join(f'{t:.2f}' for t in times)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.setup", description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="mlp,cnn,wide,flow")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-shard", type=int, default=0, metavar="N")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.cache)
        return
    names = [name for name in args.workloads.split(",") if name]
    print(f"engine set-up against one batch of {BATCH}, fresh processes, median of {args.repeats} rounds; "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"{'workload':<10} {'set-up':<8} {'load s':>7} {'set-up s':>9} {'first batch s':>14} {'batch s':>8} "
          f"{'set-up / batch':>15} {'(set-up + first) / batch':>25}")
    with tempfile.TemporaryDirectory(prefix="jacobeam-setup-") as tmp:
        for name in names:
            runs: dict[str, list[dict]] = {"probed": [], "reused": []}
            for round_ in range(args.repeats):
                cache = Path(tmp) / f"{name}-{round_}.json"
                for label in runs:  # the first writes the decisions, the second reuses them
                    found = _run_child(name, cache)
                    assert found["plan_cache"] == label, (label, found)
                    runs[label].append(found)
            for label, found in runs.items():
                med = {key: statistics.median(run[key] for run in found) for key in ("load", "setup", "first_batch", "batch")}
                ratios = [run["setup"] / run["batch"] for run in found]
                firsts = [(run["setup"] + run["first_batch"]) / run["batch"] for run in found]
                print(f"{name:<10} {label:<8} {med['load']:>7.2f} {med['setup']:>9.2f} {med['first_batch']:>14.2f} "
                      f"{med['batch']:>8.3f} {statistics.median(ratios):>14.1f}x {statistics.median(firsts):>24.1f}x")
    if args.first_shard:
        _first_shard(args.first_shard, args.repeats)


if __name__ == "__main__":
    main()
