"""What ``jacobeam run`` prints when it is done: counts, time, warnings, the output's datasets, and a
snippet that reads them."""

from __future__ import annotations

import os
import time

from jacobeam.pipeline.self_check_report import checks_line, precision_line
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import (
    JACOBIAN,
    SAMPLE_ID,
    SOURCE_FILE,
    SOURCE_FILES,
    SOURCE_ROW,
    VIEW,
    result_datasets,
)

# The command's first moments (cli.py imports this module at its top), where the process's start time is
# not known.
_IMPORTED_AT = time.time()


def process_started_at() -> float:
    """When this process started (``time.time()``'s scale): from ``/proc`` on Linux, else when this module
    was imported (among the ``jacobeam`` command's first imports)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks after boot
            since_boot = float(uptime.read().split()[0])
        started = time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    return min(started, _IMPORTED_AT)


def _reads(manifest) -> list[tuple[str, str]]:
    """The "read it" lines, as (code, comment): each dataset the run stored of the Jacobian (``jacobian``,
    ``jacobian/<input>`` per input, or what ``reduce`` kept instead) with its shape, then the ids and
    the rows' sources (input file and row)."""
    rows = min(8, manifest.get("num_rows", manifest["num_samples"]))
    reads = []
    for name in result_datasets(manifest["datasets"]):
        variable = name.replace("/", "_")
        shape = tuple(rows if dim == "n" else dim for dim in manifest["datasets"][name]["shape"])
        reads.append((f"{variable if variable.isidentifier() else 'data'} = f[{name!r}][:8]", str(shape)))
    if not reads:  # a manifest without the list of datasets
        reads.append((f"jac = f[{JACOBIAN!r}][:8]", "(8, *output_shape, *input_shape)"))
    reads.append((f"ids = f[{SAMPLE_ID!r}][:8]", "their sample ids"))
    if SOURCE_FILE in manifest["datasets"]:  # older folders' views do not name their rows' sources
        reads += [(f"files = f[{SOURCE_FILES!r}].asstr()[:][f[{SOURCE_FILE!r}][:8]]", "their input files, relative paths"),
                  (f"rows = f[{SOURCE_ROW!r}][:8]", "and their rows within those files")]
    return reads


def run_summary(result) -> str:
    """The lines ``jacobeam run`` prints for ``result`` (a ``runner.RunResult``)."""
    manifest, run = result.manifest, result.manifest["run"]
    out = storage.normalize(manifest["config"]["output"]["path"])
    view = storage.join(out, VIEW)
    shapes = ", ".join(
        f"{name} ({', '.join(str(d) for d in info['shape'])})" for name, info in manifest["datasets"].items()
    )
    metrics = ", ".join(f"{k}={v}" if not isinstance(v, dict) else f"{k}=mean {v['mean']:g} max {v['max']:g}"
                        for k, v in sorted(result.metrics.items()))
    rejected, nonfinite = manifest["rejected"], manifest["nonfinite"]["count"]
    warnings = []
    if rejected["count"] or rejected["unreadable_files"]:
        warnings.append(
            f"rejected: {rejected['count']:,} bad sample(s), {len(rejected['unreadable_files'])} unreadable file(s); "
            f"listed in {storage.join(out, rejected['file'])}"
        )
    removed = manifest.get("removed") or {}
    if removed.get("count"):
        warnings.append(f"removed: {removed['count']:,} sample(s) of {removed['files']:,} input file(s) gone since they "
                        "were computed: no rows (their ids stay taken; the manifest's 'removed' lists them)")
    if nonfinite:
        warnings.append(f"nonfinite: {nonfinite:,} sample(s) with NaN/Inf results (the 'nonfinite' dataset flags them)")
    jacobian = manifest["config"]["jacobian"]
    precision = precision_line(manifest.get("self_check") or {}, jacobian.get("compute_dtype", "float32"),
                               jacobian.get("store_dtype", "float32"))
    reads = _reads(manifest)
    width = max(len(code) for code, _ in reads)
    total = time.time() - process_started_at()
    rejected_part = f", {rejected['count']:,} rejected" if rejected["count"] else ""
    rejected_part += f", {removed['count']:,} removed" if removed.get("count") else ""
    rate = f", {run['samples_per_second']:,.0f} samples/s" if run["samples_computed"] and run["samples_per_second"] else ""
    return "\n".join(
        [
            f"done: {manifest['num_samples']:,} samples ({run['samples_computed']:,} computed, "
            f"{run['samples_kept']:,} already complete{rejected_part}) in {len(manifest['shards'])} shard(s), "
            f"{total:.1f} s from start (pipeline {run['wall_seconds']:.1f} s{rate})",
            *warnings,
            *([f"self-check: {checks_line(manifest['self_check'])}"] if manifest.get("self_check") else []),
            *([f"precision: {precision}"] if precision else []),
            f"metrics: {metrics}",
            f"output: {out}",
            f"  {storage.name_of(view)}: {shapes}",
            "read it:",
            "  import h5py",
            f"  with h5py.File({str(view)!r}) as f:",
            *(f"      {code:<{width}}  # {comment}" for code, comment in reads),
        ]
    )
