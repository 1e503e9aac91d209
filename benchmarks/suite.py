"""The benchmark run: every row of every chosen workload, each in its own process, side by side.

Rows are measured one after the other (never in parallel: they would share the two cores), each in
a fresh ``python -m benchmarks.worker`` process whose peak RSS the parent reads with ``wait4``; the
end-to-end rows run jacobeam's pipeline (its Python API, and its command line) on ``.npy`` inputs.
Every row's Jacobians of the first samples are compared with the status quo's.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.measure import Budget
from benchmarks.rows import BASELINE, RowSpec, row_specs
from benchmarks.workloads import WORKLOADS, Workload, flops_per_jacobian, inputs
from jacobeam.transforms.engine.diagnostics import relative_error

REPO = Path(__file__).resolve().parent.parent
SAMPLES_PER_SHARD = 512  # several shards per run, so that two worker processes both get work
WRONG = 1e-4  # a max relative error above this marks a row as wrong
TWO_WORKERS = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
PEERS = ("jax", "torch")


@dataclass(frozen=True)
class Plan:
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    budget: Budget = Budget(repeats=5, seconds=2.0, max_call_seconds=15.0, probe=8)
    e2e_workloads: tuple[str, ...] = tuple(WORKLOADS)  # where the end-to-end rows run
    e2e_repeats: int = 3  # fresh commands each; the median counts
    scale: int = 10  # W1 end to end at N and scale * N samples; 0: no scaling runs
    rows: tuple[str, ...] | None = None  # only these row ids (the status quo always runs: reference)
    samples: int | None = None  # instead of each workload's own sample count
    matmul_size: int = 2048
    timeout_s: float = 1800.0  # per process

    @classmethod
    def quick(cls, names: tuple[str, ...] = tuple(WORKLOADS)) -> Plan:
        """Minutes on two cores: short repeats, slow rows on small batches, one end-to-end run of W1."""
        return cls(
            workloads=names,
            budget=Budget(repeats=3, seconds=0.5, max_call_seconds=3.0, probe=2),
            e2e_workloads=("mlp",),
            e2e_repeats=1,
            timeout_s=600.0,
        )


@dataclass
class Process:
    wall_seconds: float
    peak_rss_mb: float  # the largest of the process and the descendants it waited for
    log: Path
    started_at: float  # time.time() just before the process was started


class RowFailed(RuntimeError):
    pass


def run_process(command: list[str], log: Path, timeout_s: float) -> Process:
    """Run ``command`` from the repository root; its output goes to ``log``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    started_at = time.time()
    start = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    # wait4 instead of Popen.wait: it also returns the child's resource usage (ru_maxrss).
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - start > timeout_s:
            process.kill()
            pid, status, usage = os.wait4(process.pid, 0)
            break
        time.sleep(0.01)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        # The log lives in the run's temporary folder: keep its end in the message.
        tail = log.read_text(errors="replace").strip().splitlines()[-8:]
        reason = f"timed out after {timeout_s:.0f} s" if wall > timeout_s else f"exit {process.returncode}"
        raise RowFailed(f"{reason}: {' '.join(command[-3:])}\n  " + "\n  ".join(tail))
    return Process(wall, usage.ru_maxrss / 1024, log, started_at)


def run_task(task: dict[str, Any], folder: Path, timeout_s: float) -> tuple[dict[str, Any], Process]:
    """One ``benchmarks.worker`` task in a fresh process; returns its result and the process figures."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "task.json"
    path.write_text(json.dumps({**task, "out": str(folder)}))
    process = run_process([sys.executable, "-m", "benchmarks.worker", str(path)], folder / "log.txt", timeout_s)
    return json.loads((folder / "result.json").read_text()), process


def _in_memory(row: RowSpec, workload: Workload, samples: int, plan: Plan, folder: Path) -> tuple[dict, np.ndarray]:
    """One in-memory row in its own process: its timing and its Jacobians of the first samples."""
    task = {"kind": "row", "row": asdict(row), "workload": workload.name, "samples": samples}
    result, process = run_task({**task, "budget": asdict(plan.budget)}, folder, plan.timeout_s)
    result.update(peak_rss_mb=process.peak_rss_mb, process_seconds=process.wall_seconds)
    return result, np.load(folder / "jacobians.npy")


def write_inputs(workload: Workload, samples: int, folder: Path) -> str:
    """The workload's inputs as one ``.npy`` file; returns the glob for ``input.paths``."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "x.npy", inputs(workload, samples))
    return str(folder / "*.npy")


def _config(workload: Workload, inputs_glob: str, out: Path) -> dict[str, Any]:
    return {
        "model": {"factory": workload.factory},
        "input": {"paths": [inputs_glob]},
        "jacobian": {"batch_size": 256},
        "output": {"path": str(out), "samples_per_shard": SAMPLES_PER_SHARD},
    }


def _end_to_end_once(row: RowSpec, workload: Workload, inputs_glob: str, folder: Path, plan: Plan) -> dict:
    """One fresh run of the pipeline (API or command); the output folder is left for the caller."""
    import yaml

    out = folder / "out"
    config = _config(workload, inputs_glob, out)
    beam_args = TWO_WORKERS if row.params["workers"] == 2 else []
    found: dict[str, Any] = {}
    if row.kind == "pipeline":
        task = {"kind": "pipeline", "config": config, "beam_args": beam_args}
        result, process = run_task(task, folder, plan.timeout_s)
        found.update(result)
        if result.get("first_jacobian_at") is not None:  # the engine ran in that process: time to first Jacobian
            found["first_call_seconds"] = result["first_jacobian_at"] - process.started_at
    else:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "jacobeam", "-q", "run", str(folder / "config.yaml"), *beam_args]
        process = run_process(command, folder / "log.txt", plan.timeout_s)
        found["command_seconds"] = process.wall_seconds
    run = json.loads((out / "manifest.json").read_text())["run"]
    written = sum(path.stat().st_size for path in (out / "shards").glob("*.h5"))
    return {
        **found,
        "samples_per_second": run["samples_per_second"],
        "pipeline_wall_seconds": run["wall_seconds"],
        "samples": run["samples_computed"],
        "bytes_written": written,
        "bytes_per_second": written / run["wall_seconds"],
        "peak_rss_mb": process.peak_rss_mb,
        "process_seconds": process.wall_seconds,
    }


def _end_to_end(
    row: RowSpec, workload: Workload, inputs_glob: str, plan: Plan, folder: Path
) -> tuple[dict, np.ndarray]:
    """``plan.e2e_repeats`` fresh runs; the run with the median samples/s is reported."""
    import h5py

    runs = []
    for repeat in range(plan.e2e_repeats):
        run_folder = folder / f"run-{repeat}"
        runs.append(_end_to_end_once(row, workload, inputs_glob, run_folder, plan))
        if repeat == 0:
            with h5py.File(run_folder / "out" / "jacobians.h5") as view:
                checked = view["jacobian"][: plan.budget.probe]
        shutil.rmtree(run_folder / "out")  # outputs are large (W1 at 10 N: 640 MB)
    ordered = sorted(runs, key=lambda run: run["samples_per_second"])
    return {**ordered[len(ordered) // 2], "runs": runs}, checked


def _note(result: dict[str, Any]) -> str:
    """The end-to-end figures that have no column of their own."""
    parts = []
    if "run_seconds" in result:
        parts.append(f"engine {result['engine_seconds']:.1f} s of run() {result['run_seconds']:.1f} s")
    if "command_seconds" in result:
        whole = result["samples"] / result["command_seconds"]
        parts.append(f"command {result['command_seconds']:.1f} s = {whole:,.0f}/s")
    parts.append(f"{result['bytes_per_second'] / 1e6:,.0f} MB/s written")
    if len(result["runs"]) == 1:
        parts.append("1 run")
    return ", ".join(parts)


def _scaling(plan: Plan, folder: Path, base: dict[str, Any], say: Callable[[str], None]) -> list[dict]:
    """W1 end to end in-process at N (``base``: the ``pipeline_1proc`` row) and ``plan.scale`` * N
    samples: throughput and peak RSS."""
    workload = WORKLOADS["mlp"]
    count = plan.scale * (plan.samples or workload.samples)
    say(f"  scaling: W1 end to end, {count:,} samples")
    inputs_glob = write_inputs(workload, count, folder / "data")
    row = RowSpec("pipeline_1proc", "scaling", "pipeline", {"workers": 1})
    scaled, _ = _end_to_end(row, workload, inputs_glob, plan, folder / "run")
    keys = ("samples", "samples_per_second", "peak_rss_mb", "pipeline_wall_seconds", "bytes_per_second")
    return [{key: result[key] for key in keys} for result in (base, scaled)]


def versions() -> dict[str, str | None]:
    found = {}
    for name in ("tensorflow", "keras", "jax", "jaxlib", "torch", "apache-beam", "numpy", "h5py", "jacobeam"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


@dataclass
class Report:
    plan: Plan
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    scaling: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "plan": asdict(self.plan),
            "cpus": os.cpu_count(),
            "versions": versions(),
            "workloads": self.workloads,
            "scaling": self.scaling,
            "notes": self.notes,
        }


def _finish(rows: list[dict[str, Any]], workload: Workload, peak_gflops: float | None) -> None:
    """Fill in each row's ratio to the engine row and, for Dense chains, its GFLOP/s."""
    baseline = next((r["samples_per_second"] for r in rows if r["id"] == BASELINE and "error" not in r), None)
    flops = flops_per_jacobian(workload)
    for row in rows:
        speed = row.get("samples_per_second")
        if speed is None:
            continue
        row["vs_engine"] = speed / baseline if baseline else None
        if peak_gflops is not None:
            row["gflops"] = flops * speed / 1e9
            row["percent_of_peak"] = 100 * row["gflops"] / peak_gflops


def _run_workload(
    workload: Workload, rows: list[RowSpec], plan: Plan, folder: Path, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Each row in turn; the first row that runs is the reference for the max relative error."""
    samples = plan.samples or workload.samples
    inputs_glob = None
    reference = None
    found = []
    for row in rows:
        say(f"  {workload.key} {workload.name}: {row.label} ...")
        record: dict[str, Any] = {"id": row.id, "label": row.label, "kind": row.kind}
        try:
            if row.in_memory:
                result, jacobians = _in_memory(row, workload, samples, plan, folder / row.id)
            else:
                inputs_glob = inputs_glob or write_inputs(workload, samples, folder / "data")
                result, jacobians = _end_to_end(row, workload, inputs_glob, plan, folder / row.id)
                result["note"] = _note(result)
        except RowFailed as err:
            say(f"    failed: {err}")
            found.append({**record, "error": str(err)})
            continue
        if reference is None:
            reference, record["reference"] = jacobians, True
        record["max_rel_error"] = relative_error(jacobians, reference[: len(jacobians)])
        record["wrong"] = record["max_rel_error"] > WRONG
        found.append({**record, **result})
    return found


def run_suite(
    plan: Plan, say: Callable[[str], None] = print, on_workload: Callable[[str, Report], None] | None = None
) -> Report:
    """Run every row of ``plan``; ``on_workload(name, report)`` is called as each workload finishes."""
    report = Report(plan)
    peers = {name: importlib.util.find_spec(name) is not None for name in PEERS}
    for name, present in peers.items():
        if not present:
            report.notes.append(f"{name} is not installed: its rows are skipped (pip install -e '.[bench]')")
    skipped = [WORKLOADS[name].key for name in plan.workloads if name not in plan.e2e_workloads]
    if skipped:
        report.notes.append(f"no end-to-end rows for {', '.join(skipped)} in this plan (--quick runs them for W1)")
    with tempfile.TemporaryDirectory(prefix="jacobeam-bench-") as temp:
        folder = Path(temp)
        modes, _ = run_task({"kind": "modes"}, folder / "modes", plan.timeout_s)
        if not modes["modes"]:
            report.notes.append("EngineOptions has no 'mode' field: one engine row per jit_compile setting")
        specs = row_specs(modes["modes"], modes["default"], peers)
        for name in plan.workloads:
            workload = WORKLOADS[name]
            matmul = None
            if flops_per_jacobian(workload) is not None:
                # Measured next to the rows it is compared with: on a shared machine the peak drifts.
                say(f"  {workload.key} {name}: float32 matmul peak ...")
                task = {"kind": "matmul", "size": plan.matmul_size}
                matmul, _ = run_task(task, folder / name / "matmul", plan.timeout_s)
            chosen = [
                row for row in specs
                if (row.in_memory or name in plan.e2e_workloads)
                and (plan.rows is None or row.id in plan.rows or row.id == specs[0].id)
            ]
            rows = _run_workload(workload, chosen, plan, folder / name, say)
            _finish(rows, workload, max(matmul.values()) if matmul else None)
            report.workloads[name] = {
                "key": workload.key,
                "input_shape": list(workload.input_shape),
                "output_shape": list(workload.output_shape),
                "samples": plan.samples or workload.samples,
                "flops_per_jacobian": flops_per_jacobian(workload),
                "matmul_gflops": matmul,  # per framework
                "rows": rows,
            }
            if on_workload:
                on_workload(name, report)
        rows = report.workloads.get("mlp", {}).get("rows", [])
        base = next((r for r in rows if r["id"] == "pipeline_1proc" and "error" not in r), None)
        if plan.scale and base is not None:  # scaling goes with W1's in-process pipeline row
            report.scaling = _scaling(plan, folder / "scaling", base, say)
    return report
