"""A folder of many one-sample files: planning, a no-op rerun, ``manifest.json``'s size, the launcher's peak RSS.

Makes ``--files`` one-row ``.npy`` files (float32, shape (4,)) in ``--folders`` subfolders (written as bytes:
one header, then each file's row), runs ``jacobeam run`` on them (``tiny_model`` below, self-check off),
then runs it again (nothing left to do), each under ``/usr/bin/time -v`` for its wall time and peak RSS,
beside the imports alone (``jacobeam.pipeline.cli``, ``runner`` and TensorFlow in a fresh process), so
that the no-op rerun reads as imports plus the rest; then times ``plan.make_job`` in this process on the
complete folder (``--profile``: with cProfile) and for a folder never written (a first run's plan)::

    .venv/bin/python -m benchmarks.many_files --root /tmp/w/million --files 1000000
    .venv/bin/python -m benchmarks.many_files --root /tmp/w/many --files 100000 --profile plan.prof
    .venv/bin/python -m benchmarks.many_files --root /tmp/w/strings --strings 1000000   # inputs.h5's string column

``--keep`` leaves the files and the output folder (a second invocation reuses the files). Nothing asserts
a time.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = (4,)
MODEL = "benchmarks.many_files:tiny_model"


def tiny_model():
    """4 -> Dense 3: seeded, so every process builds the same weights."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(SHAPE), keras.layers.Dense(3)])


def make_files(root: Path, count: int, folders: int) -> float:
    """``count`` one-row ``.npy`` files under ``root/dNN/``; returns the seconds taken. Row ``i`` holds
    ``i, i + 0.25, i + 0.5, i + 0.75`` (distinct samples, checkable by eye)."""
    started = time.perf_counter()
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": "<f4", "fortran_order": False, "shape": (1, *SHAPE)})
    header = stream.getvalue()
    for folder in range(folders):
        (root / f"d{folder:02d}").mkdir(parents=True, exist_ok=True)
    rows = (np.arange(count, dtype=np.float32)[:, None] + np.arange(SHAPE[0], dtype=np.float32) / 4).astype("<f4")
    for i in range(count):
        fd = os.open(root / f"d{i % folders:02d}" / f"s{i:07d}.npy", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, header + rows[i].tobytes())
        os.close(fd)
    return time.perf_counter() - started


def config(root: Path, output: Path) -> dict:
    return {
        "model": {"factory": MODEL},
        "input": {"paths": [str(root / "d*" / "*.npy")]},
        "output": {"path": str(output)},
        "jacobian": {"self_check": {"samples": 0}},
    }


def timed(command: list[str], log: Path) -> dict:
    """Run ``command`` under ``/usr/bin/time -v``: its wall seconds, peak RSS (MB) and exit status."""
    started = time.perf_counter()
    with open(log, "w") as out:
        status = subprocess.call(["/usr/bin/time", "-v", *command], stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"seconds": round(wall, 2), "peak_rss_mb": round(int(rss.group(1)) / 1024) if rss else None, "status": status}


def plan_seconds(cfg_path: Path, profile: Path | None) -> float:
    """``plan.make_job`` on the config as ``run`` plans it (the model loaded and checked), in this process."""
    import cProfile

    from jacobeam.pipeline import config as configs
    from jacobeam.pipeline import plan

    cfg = configs.load(cfg_path)
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    plan.make_job(cfg)
    seconds = time.perf_counter() - started
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile)
    return seconds


def string_columns(count: int, folder: Path) -> dict:
    """Write and read ``count`` paths as one HDF5 column, fixed-width UTF-8 and variable-length, each with
    and without gzip: the choice ``inputs.h5`` makes (seconds, MB on disk), measured side by side."""
    import h5py
    from h5py import h5s

    paths = [f"{folder}/data/d{i % 10:02d}/s{i:07d}.npy" for i in range(count)]
    found = {}
    for kind in ("fixed", "vlen"):
        for compression in (None, "gzip"):
            path = folder / f"strings-{kind}-{compression}.h5"
            started = time.perf_counter()
            with h5py.File(path, "w") as h5:
                if kind == "fixed":
                    encoded = np.array([p.encode() for p in paths])
                    column = h5.create_dataset("p", shape=encoded.shape, dtype=h5py.string_dtype("utf-8", encoded.itemsize),
                                               compression=compression, shuffle=bool(compression), chunks=True)
                    column.id.write(h5s.ALL, h5s.ALL, encoded, mtype=column.id.get_type())
                else:
                    h5.create_dataset("p", data=paths, dtype=h5py.string_dtype(), compression=compression, chunks=True)
            wrote = time.perf_counter() - started
            started = time.perf_counter()
            with h5py.File(path) as h5:
                back = [b.decode() for b in h5["p"][()]] if kind == "fixed" else h5["p"].asstr()[()].tolist()
            read = time.perf_counter() - started
            assert back == paths
            found[f"{kind}, {compression or 'no compression'}"] = {
                "write_s": round(wrote, 2), "read_s": round(read, 2), "mb": round(path.stat().st_size / 1e6, 1)}
            path.unlink()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.many_files", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="where the files and the output folder go")
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--folders", type=int, default=10)
    parser.add_argument("--profile", type=Path, default=None, help="cProfile the in-process plan of the rerun")
    parser.add_argument("--keep", action="store_true", help="leave the files and the output folder")
    parser.add_argument("--strings", type=int, default=0, help="only time N paths as an HDF5 string column, four ways")
    args = parser.parse_args(argv)
    if args.strings:
        args.root.mkdir(parents=True, exist_ok=True)
        print(json.dumps(string_columns(args.strings, args.root), indent=2))
        return 0
    data, out = args.root / "data", args.root / "out"
    found = {}
    if not (data / f"d{(args.files - 1) % args.folders:02d}" / f"s{args.files - 1:07d}.npy").exists():
        found["make_files_s"] = round(make_files(data, args.files, args.folders), 1)
        print(f"made {args.files:,} files in {found['make_files_s']} s", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    cfg_path = args.root / "job.yaml"
    cfg_path.write_text(json.dumps(config(data, out)))  # YAML is a superset of JSON
    command = [sys.executable, "-m", "jacobeam", "-q", "run", str(cfg_path)]
    found["imports"] = timed([sys.executable, "-c", "import jacobeam.pipeline.cli, jacobeam.pipeline.runner, tensorflow"],
                             args.root / "imports.log")
    found["first_run"] = timed(command, args.root / "first.log")
    found["noop_rerun"] = timed(command, args.root / "rerun.log")
    manifest = out / "manifest.json"
    found["manifest_bytes"] = manifest.stat().st_size if manifest.exists() else None
    table = out / "inputs.h5"
    found["inputs_h5_bytes"] = table.stat().st_size if table.exists() else None
    found["plan_rerun_s"] = round(plan_seconds(cfg_path, args.profile), 2)
    fresh = args.root / "fresh.yaml"  # an output folder never written: the plan of a first run
    fresh.write_text(json.dumps(config(data, args.root / "fresh-out")))
    found["plan_fresh_s"] = round(plan_seconds(fresh, None), 2)
    print(json.dumps(found, indent=2))
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
