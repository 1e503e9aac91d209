"""The performance targets of rounds four and five (issue 38 raised W1's end to end to 0.9x), each measured side by
side and printed with its ratio.

``python -m benchmarks [targets] [--quick] [--only end_to_end,peers,...,setup:resnet50] [--json F]``

Every measurement runs in a fresh process (``python -m benchmarks.targets --task KIND:WORKLOAD``), one
after the other, and compares rows timed in that one process with their repeats interleaved, so that load
from other work falls on both sides of a ratio alike. Nothing asserts a speed: the table says, per target,
the ratio measured, the goal and whether it is met.

1. **end to end** (W1 ``mlp``, W3 ``wide``, W2 ``cnn``, the README quickstart's CNN on its bar images at
   every default, ResNet50 and MobileNetV2 label saliency): the
   in-process pipeline (``runner.run`` on ``.npy``/``.npz`` files, writing shards) against the hand-written
   in-memory TensorFlow loop that computes what the run stores (``tf.function`` + ``batch_jacobian`` for
   ``reduce: none``; the label-row gradient summed ``|.|`` over channels for saliency), on the same samples
   and batch size. The pipeline's rate is the marginal one: ``N / (wall(2N) - wall(N))``, a run of N and one of
   2N back to back in each repeat, so that the fixed costs of a job (Beam's start, the worker's engine,
   finalize) cancel; they are what the set-up targets measure.
2. **engine vs the best peer** (W1-W4): the engine in memory against JAX and torch.func (``benchmarks.sidebyside``
   rows), at batch 256 on the same weights and samples.
3. **set-up** (W1-W4, ResNet50, MobileNetV2): ``JacobianEngine(...)`` construction plus its first call's excess
   over a steady batch (tracing at the real batch size), in batches; the model load is reported beside it.
   **first shard** (W2, the demo's settings): from starting ``python -m jacobeam run`` to the first complete
   shard file.
4. **two processes** (20,000 W1 samples): ``--direct_num_workers 2 --direct_running_mode multi_processing``
   against one process, alternating: as ``python -m jacobeam run`` commands (each run pays its imports, as
   on a command line) and through ``runner.run`` in one process (where one process reuses the caller's
   TensorFlow and each worker process imports its own).
5. **self-check** (W1, 20,480 samples): the checks' own time inside a run (the manifest's
   ``self_check.seconds``) as a share of the run's wall time.
6. **small files** (100,000 samples, ``.npy`` and PNG): ``runner.run`` from one file per sample against
   the same samples in one ``.npy`` (``benchmarks.small_files``: W2 ``cnn``, ``outputs: argmax``),
   samples/s end to end, planning included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks import target_inputs
from benchmarks.measure import interleaved, seconds
from benchmarks.target_inputs import BATCH, SALIENCY_SHAPE

REPO = Path(__file__).resolve().parent.parent
DENSE = ("mlp", "wide", "cnn", "flow")
SALIENCY = ("resnet50", "mobilenet_v2")
SALIENCY_BATCH = 8


@dataclass
class Result:
    target: str  # "1 end to end", ...
    workload: str
    measured: float
    goal: float | None  # None: reported, not a stated target
    at_least: bool  # True: measured >= goal is met; False: measured <= goal
    unit: str  # "x" for ratios, "batches", "s", "%"
    detail: str

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        return self.measured >= self.goal if self.at_least else self.measured <= self.goal


# -- measurements (each runs inside its own process) ------------------------------------------------


def end_to_end(workload: str, samples: int, repeats: int) -> list[Result]:
    from jacobeam.pipeline import runner

    batch = SALIENCY_BATCH if workload in SALIENCY else BATCH
    x, labels = target_inputs.samples_of(workload, 2 * samples)
    hand_samples = min(samples, 2048)  # the loop's rate is steady; W3's batch_jacobian is slow
    with tempfile.TemporaryDirectory(prefix="jacobeam-targets-") as temp:
        globs = {
            n: target_inputs.write_inputs(x[:n], None if labels is None else labels[:n], Path(temp) / f"in-{n}")
            for n in (samples, 2 * samples)
        }
        loops: list[Callable] = []  # built after the first pipeline run, which sets TensorFlow's threads

        def pipeline(n: int) -> Callable[[], float]:
            def run() -> float:
                out = Path(temp) / "out"
                shutil.rmtree(out, ignore_errors=True)
                began = time.perf_counter()
                runner.run(target_inputs.run_config(workload, globs[n], out), [], show_progress=False)
                return time.perf_counter() - began

            return run

        def in_memory() -> None:
            if not loops:
                loops.append(target_inputs.hand_written(workload))
                loops[0](x[:batch], None if labels is None else labels[:batch])  # tracing
            loop = loops[0]
            for lo in range(0, hand_samples, batch):
                loop(x[lo : lo + batch], None if labels is None else labels[lo : lo + batch])

        calls = {"N": pipeline(samples), "2N": pipeline(2 * samples), "loop": target_inputs.rate(in_memory, hand_samples)}
        interleaved(calls, 1)  # warm-up: imports, tracing, first-touch memory
        found = interleaved(calls, repeats)
    marginal = [samples / (two - one) for one, two in zip(found["N"], found["2N"])]
    pipeline_rate, loop_rate = statistics.median(marginal), statistics.median(found["loop"])
    goal = {"mlp": 0.9, "wide": 0.8, "cnn": 0.95, "quickstart": 0.9, "resnet50": 0.95}.get(workload)
    detail = (
        f"pipeline {pipeline_rate:,.1f}/s marginal ({samples:,} -> {2 * samples:,} samples: "
        f"{statistics.median(found['N']):.1f} s, {statistics.median(found['2N']):.1f} s), "
        f"hand-written loop {loop_rate:,.1f}/s"
    )
    return [Result("1 end to end", workload, pipeline_rate / loop_rate, goal, True, "x", detail)]


PEERS = {  # the peers that can be the best on each workload (the others were 10-100x slower there in earlier
    # rounds: git log -p benchmarks/README.md)
    "mlp": ("jax_jacrev", "torch_jacrev"),
    "cnn": ("jax_jacrev", "torch_jacrev"),
    "wide": ("jax_jacfwd", "torch_jacfwd", "jax_jacrev"),
    "flow": ("jax_jacfwd", "jax_jacrev", "torch_jacrev", "torch_jacfwd"),
}


def peers(workload: str, samples: int, repeats: int) -> list[Result]:
    from benchmarks.sidebyside import in_memory
    from benchmarks.workloads import WORKLOADS

    rows = in_memory(WORKLOADS[workload], ["engine", *PEERS[workload]], samples, repeats)
    engine, others = rows[0], rows[1:]
    best = max(others, key=lambda row: row["samples_per_second"])
    worst_error = max(row["max_rel_error"] for row in others)
    detail = (
        f"engine {engine['samples_per_second']:,.0f}/s, best peer {best['row']} {best['samples_per_second']:,.0f}/s; "
        + ", ".join(f"{row['row']} {row['samples_per_second']:,.0f}/s" for row in others if row is not best)
        + f"; peers agree with the engine to {worst_error:.0e}"
    )
    return [Result("2 engine vs best peer", workload, 1 / best["ratio"], 1.0, True, "x", detail)]


def small_files(fmt: str, samples: int) -> list[Result]:
    from benchmarks import small_files as measured

    found = measured.measure(fmt, samples, repeats=2)  # each side first once
    detail = (
        f"{samples:,} one-sample .{fmt} files {found['files']:,.0f}/s against one .npy {found['one']:,.0f}/s "
        f"(W2 argmax; runs alone {found['files_run'] / found['one_run']:.2f}x; planning the files {found['planning']:.1f} s)"
    )
    return [Result("6 small files", fmt, found["files"] / found["one"], 0.8, True, "x", detail)]


def setup(workload: str, repeats: int) -> list[Result]:
    """Engine construction plus the first call's excess over a steady batch, in steady batches."""
    from benchmarks.workloads import WORKLOADS
    from jacobeam.transforms.engine import JacobianEngine
    from jacobeam.transforms.engine.models import load

    batch = SALIENCY_BATCH if workload in SALIENCY else BATCH
    x, labels = target_inputs.samples_of(workload, batch)
    began = time.perf_counter()
    model = load(factory=target_inputs.factory(workload))
    shape = WORKLOADS[workload].input_shape if workload in WORKLOADS else SALIENCY_SHAPE
    loaded = time.perf_counter()
    options = target_inputs.run_config(workload, "unused", Path("unused")).jacobian.engine_options()
    engine = JacobianEngine(model, shape, options)
    built = time.perf_counter()
    call = (lambda: engine(x)) if labels is None else (lambda: engine(x, labels))
    call()
    first = time.perf_counter() - built
    steady = statistics.median(seconds(call) for _ in range(repeats))
    set_up = built - loaded + max(0.0, first - steady)
    # The floor any first call pays: the hand-written function's tracing (its first call over a steady one).
    loop = target_inputs.hand_written(workload)
    hand_first = seconds(lambda: loop(x, labels))
    hand_steady = statistics.median(seconds(lambda: loop(x, labels)) for _ in range(repeats))
    detail = (
        f"construct {built - loaded:.2f} s + first call {first:.2f} s against a batch of {batch} {steady:.3f} s; "
        f"model load {loaded - began:.2f} s; the hand-written function's first call takes "
        f"{max(0.0, hand_first - hand_steady) / steady:.1f} batches more than a steady one"
    )
    return [Result("3 set-up", workload, set_up / steady, 3.0, False, "batches", detail)]


def first_shard(repeats: int) -> list[Result]:
    """``python -m jacobeam run`` on the demo's settings (W2, batch 128, shards of 512, 2,048 samples): from
    starting the process to the first complete shard."""
    import yaml

    from benchmarks.setup import first_shard_seconds
    from benchmarks.workloads import WORKLOADS, inputs

    found = []
    with tempfile.TemporaryDirectory(prefix="jacobeam-targets-") as temp:
        np.save(Path(temp) / "x.npy", inputs(WORKLOADS["cnn"], 2048))
        cfg = {
            "model": {"builtin": "cnn"},
            "input": {"paths": [str(Path(temp) / "x.npy")]},
            "jacobian": {"batch_size": 128},
            "output": {"path": str(Path(temp) / "out"), "samples_per_shard": 512},
        }
        (Path(temp) / "run.yaml").write_text(yaml.safe_dump(cfg))
        for _ in range(repeats):
            shutil.rmtree(Path(temp) / "out", ignore_errors=True)
            found.append(first_shard_seconds(Path(temp) / "run.yaml", Path(temp) / "out"))
    load = os.getloadavg()[0]
    detail = f"median of {repeats}: " + ", ".join(f"{s:.2f}" for s in found) + f" s; load average {load:.1f} (2 cores)"
    return [Result("3 first shard", "cnn", statistics.median(found), 4.0, False, "s", detail)]


def processes(samples: int, repeats: int) -> list[Result]:
    from benchmarks.processes import measure

    results = []
    for launch, how in (("command", "as commands"), ("api", "through runner.run")):
        found = measure(samples, repeats, 4096, launch=launch)
        detail = (
            f"{samples:,} W1 samples {how}: one process {found['one']:.1f} s, two {found['two']:.1f} s "
            f"(median of {repeats})"
        )
        results.append(Result("4 two processes", "mlp", found["ratio"], 1.0, True, "x", detail))
    return results


def self_check(samples: int, repeats: int) -> list[Result]:
    from benchmarks.selfcheck import measure
    from benchmarks.workloads import WORKLOADS

    found = measure(WORKLOADS["mlp"], samples, 4096, repeats)
    share = 100 * found["share"]
    detail = (
        f"{found['checking']:.3f} s of checking in a {found['wall_on']:.1f} s run of {samples:,} samples "
        f"(on/off wall times {found['ratio']:.3f}, as noisy as any two runs)"
    )
    return [Result("5 self-check", "mlp", share, 3.0, False, "%", detail)]


# -- the driver ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    repeats: int
    dense_samples: int  # W1/W3 end to end: N
    cnn_samples: int
    saliency_samples: int  # ResNet50 (MobileNetV2, about 3x as fast: twice as many)
    peer_samples: int
    process_samples: int
    self_check_samples: int
    small_files_samples: int
    quickstart_samples: int  # the README quickstart's CNN end to end: N

    @classmethod
    def full(cls) -> Sizes:
        return cls(3, 20_480, 1_024, 48, 2_048, 20_000, 20_480, 100_000, 10_000)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(2, 8_192, 512, 24, 1_024, 20_000, 8_192, 10_000, 4_096)


def tasks(sizes: Sizes, only: set[str]) -> list[str]:
    kinds = {
        "end_to_end": [f"end_to_end:{w}" for w in ("mlp", "wide", "cnn", "quickstart", *SALIENCY)],
        "peers": [f"peers:{w}" for w in DENSE],
        "setup": [f"setup:{w}" for w in (*DENSE, *SALIENCY)],
        "first_shard": ["first_shard:cnn"],
        "processes": ["processes:mlp"],
        "self_check": ["self_check:mlp"],
        "small_files": ["small_files:npy", "small_files:png"],
    }
    return [task for kind, found in kinds.items() for task in found if kind in only or task in only]


def run_task(task: str, sizes: Sizes) -> list[Result]:
    kind, workload = task.split(":")
    if kind == "end_to_end":
        samples = {
            "mlp": sizes.dense_samples,
            "wide": sizes.dense_samples,
            "cnn": sizes.cnn_samples,
            "quickstart": sizes.quickstart_samples,
            "resnet50": sizes.saliency_samples,
            "mobilenet_v2": 2 * sizes.saliency_samples,
        }
        return end_to_end(workload, samples[workload], sizes.repeats)
    if kind == "peers":
        return peers(workload, sizes.peer_samples, sizes.repeats + 2)
    if kind == "setup":
        return setup(workload, 3)
    if kind == "first_shard":
        return first_shard(sizes.repeats)
    if kind == "processes":
        return processes(sizes.process_samples, sizes.repeats)
    if kind == "self_check":
        return self_check(sizes.self_check_samples, sizes.repeats)
    if kind == "small_files":
        return small_files(workload, sizes.small_files_samples)
    raise ValueError(f"unknown task {task!r}")


def table(results: list[Result], commit: str) -> str:
    lines = [
        f"Targets at {commit}, on {os.cpu_count()} cores (ratios measured side by side in one process each)",
        f"{'target':<22} {'workload':<13} {'measured':>10} {'goal':>9}  {'met':<4}  detail",
        "-" * 130,
    ]
    for r in results:
        goal = "-" if r.goal is None else f"{'>=' if r.at_least else '<='} {r.goal:g}"
        measured = f"{r.measured:.2f}{r.unit if r.unit in ('x', '%') else ' ' + r.unit[0]}"
        met = {True: "yes", False: "NO", None: ""}[r.met]
        lines.append(f"{r.target:<22} {r.workload:<13} {measured:>10} {goal:>9}  {met:<4}  {r.detail}")
    return "\n".join(lines)


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True)
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (about half the time)")
    parser.add_argument(
        "--only",
        default="end_to_end,peers,setup,first_shard,processes,self_check,small_files",
        help="kinds to run, or single tasks (KIND:WORKLOAD)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--task", default=None, help=argparse.SUPPRESS)  # one measurement, in this process
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes.full()
    if args.task:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        results = run_task(args.task, sizes)
        args.out.write_text(json.dumps([asdict(r) for r in results]))
        return 0

    results: list[Result] = []
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with tempfile.TemporaryDirectory(prefix="jacobeam-targets-") as temp:
        for task in tasks(sizes, set(args.only.split(","))):
            out, log = Path(temp) / "result.json", Path(temp) / "task.log"
            command = [sys.executable, "-m", "benchmarks.targets", "--task", task, "--out", str(out)]
            command += ["--quick"] if args.quick else []
            began = time.perf_counter()
            print(f"{task} ...", file=sys.stderr, flush=True)
            with log.open("wb") as sink:
                done = subprocess.run(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-6:]
                print(f"{task} failed (exit {done.returncode}):\n  " + "\n  ".join(tail), file=sys.stderr, flush=True)
                continue
            found = [Result(**r) for r in json.loads(out.read_text())]
            results += found
            for r in found:
                print(
                    f"  {r.target} {r.workload}: {r.measured:.2f} {r.unit} ({time.perf_counter() - began:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    print(table(results, _commit()))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"met": r.met} for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
