"""The ``jacobeam`` command (also ``python -m jacobeam``): run, demo, inspect, verify.

Arguments after the config that jacobeam does not know are Beam ``PipelineOptions``
(``--runner``, ``--direct_num_workers``, ``--temp_location``, ...), as in every Beam program. ``inspect``
and ``verify`` take the file systems' Beam options (``--s3_endpoint_url``, ``--hdfs_host``, ...) after
the folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from jacobeam.transforms.errors import JacobeamError
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.layout import JACOBIAN, SAMPLE_ID, VIEW, result_datasets

log = logging.getLogger("jacobeam")
_IMPORTED_AT = time.time()  # the command's first moments, where the process's start time is not known


def process_started_at() -> float:
    """When this process started (``time.time()``'s scale): from ``/proc`` on Linux, else when this module
    was imported (the ``jacobeam`` command's first import)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks after boot
            since_boot = float(uptime.read().split()[0])
        started = time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    return min(started, _IMPORTED_AT)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jacobeam",
        description="Per-sample Jacobians of a TensorFlow model for many input samples, stored as HDF5.",
        epilog="Unknown options after the config are passed to Beam (e.g. --direct_num_workers 2 "
        "--direct_running_mode multi_processing, --runner DataflowRunner ...); inspect and verify take the "
        "file systems' Beam options after the folder (e.g. --s3_endpoint_url URL).",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and the final summary")
    parser.add_argument("-v", "--verbose", action="store_true", help="also Beam's own log messages")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the pipeline for a config file")
    run.add_argument("config", help="YAML config file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key (VALUE is YAML), e.g. --set output.path=out/")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the result of a different run in output.path (only files jacobeam wrote are "
                     "removed); a folder holding this run's own partial or earlier result is resumed, not replaced")
    run.add_argument("--verify", type=_count, default=0, metavar="K",
                     help="verify the output at the end, recomputing K random samples; the result goes into the manifest")

    demo = commands.add_parser("demo", help="generate seeded inputs and run the built-in CNN end to end")
    demo.add_argument("--root", default=None, help="folder for the demo's inputs and output (default: jacobeam-demo)")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    inspect = commands.add_parser("inspect", help="describe an output folder and check it is complete")
    inspect.add_argument("folder")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw inputs, saliency or Jacobians, and norms")
    inspect.add_argument("--samples", metavar="IDS", type=_ids, help="sample ids to draw, e.g. 0,5,17 (default: 0-3)")

    verify = commands.add_parser(
        "verify", help="check an output folder: checksums, ids, and K samples recomputed independently",
        description="Exit status 0 when everything matches, 1 on any mismatch, 2 when the folder cannot be read.",
    )
    verify.add_argument("folder")
    verify.add_argument("--samples", type=_count, default=8, metavar="K",
                        help="random samples to recompute (default 8; 0: checksums and ids only)")
    verify.add_argument("--seed", type=int, default=0, help="seed for choosing the samples (default 0)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _reads(manifest) -> list[tuple[str, str]]:
    """The "read it" lines, as (code, comment): each dataset the run stored of the Jacobian (``jacobian``,
    ``jacobian/<input>`` per input, or what ``reduce`` kept instead) with its shape, then the ids."""
    rows = min(8, manifest.get("num_rows", manifest["num_samples"]))
    reads = []
    for name in result_datasets(manifest["datasets"]):
        variable = name.replace("/", "_")
        shape = tuple(rows if dim == "n" else dim for dim in manifest["datasets"][name]["shape"])
        reads.append((f"{variable if variable.isidentifier() else 'data'} = f[{name!r}][:8]", str(shape)))
    if not reads:  # a manifest without the list of datasets
        reads.append((f"jac = f[{JACOBIAN!r}][:8]", "(8, *output_shape, *input_shape)"))
    return [*reads, (f"ids = f[{SAMPLE_ID!r}][:8]", "their sample ids")]


def _summary(result) -> str:
    manifest, run = result.manifest, result.manifest["run"]
    out = storage.normalize(manifest["config"]["output"]["path"])
    view = storage.join(out, VIEW)
    shapes = ", ".join(
        f"{name} ({', '.join(str(d) for d in info['shape'])})" for name, info in manifest["datasets"].items()
    )
    metrics = ", ".join(f"{k}={v}" for k, v in sorted(result.metrics.items()) if not isinstance(v, dict))
    rejected, nonfinite = manifest["rejected"], manifest["nonfinite"]["count"]
    warnings = []
    if rejected["count"] or rejected["unreadable_files"]:
        warnings.append(
            f"rejected: {rejected['count']:,} bad sample(s), {len(rejected['unreadable_files'])} unreadable file(s); "
            f"listed in {storage.join(out, rejected['file'])}"
        )
    if nonfinite:
        warnings.append(f"nonfinite: {nonfinite:,} sample(s) with NaN/Inf results (the 'nonfinite' dataset flags them)")
    reads = _reads(manifest)
    width = max(len(code) for code, _ in reads)
    total = time.time() - process_started_at()
    return "\n".join(
        [
            f"done: {manifest['num_samples']:,} samples ({run['samples_computed']:,} computed, "
            f"{run['samples_kept']:,} already complete) in {len(manifest['shards'])} shard(s), "
            f"{total:.1f} s from start (pipeline {run['wall_seconds']:.1f} s, {run['samples_per_second'] or 0:,.0f} samples/s)",
            *warnings,
            f"metrics: {metrics}",
            f"output: {out}",
            f"  {storage.name_of(view)}: {shapes}",
            "read it:",
            "  import h5py",
            f"  with h5py.File({str(view)!r}) as f:",
            *(f"      {code:<{width}}  # {comment}" for code, comment in reads),
        ]
    )


def _run(config, beam_args: list[str], quiet: bool, overwrite: bool = False, verify_samples: int = 0) -> int:
    from jacobeam.pipeline import runner

    result = runner.run(config, beam_args, show_progress=not quiet, overwrite=overwrite, verify_samples=verify_samples)
    print(_summary(result))
    if result.verification is not None:
        from jacobeam.pipeline.verify import format_report

        print(format_report(result.verification))
        return 0 if result.verification.ok else 1
    return 0


def _demo(args, beam_args: list[str]) -> int:
    from jacobeam.pipeline import config as config_module
    from jacobeam.pipeline import demo

    root = args.root or demo.DEMO_ROOT
    config = config_module.load(None, args.overrides, base=demo.demo_config(root))
    paths = demo.write_inputs(Path(root) / "inputs")
    log.info("demo inputs: %d files in %s", len(paths), Path(root, "inputs").resolve())
    return _run(config, beam_args, args.quiet)


def _verify(args) -> int:
    from jacobeam.pipeline.verify import format_report, verify

    report = verify(args.folder, samples=args.samples, seed=args.seed)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sample ids separated by commas, got {text!r}") from None


def _inspect(args) -> int:
    from jacobeam.pipeline.inspect_output import format_report, inspect

    report = inspect(args.folder)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    if args.plot and report.ok:
        from jacobeam.pipeline.plot import plot

        if not storage.is_local(args.folder):
            raise JacobeamError(
                f"{args.folder}: --plot reads jacobians.h5, whose virtual datasets HDF5 resolves only on a "
                "local file system; copy the folder to a local disk and plot that"
            )
        notes: list[str] = []
        try:
            print(f"plot: {plot(args.folder, report.manifest, args.plot, args.samples, notes)}")
        except ValueError as err:
            raise JacobeamError(str(err)) from err
        for note in notes:
            print(f"plot: note: {note}")
    return 0 if report.ok else 1


def _filesystem_options(folder: str, beam_args: list[str]) -> None:
    """``inspect`` and ``verify``: the arguments after the folder are Beam options for the file systems
    (``--s3_endpoint_url``, ``--s3_region_name``, ``--hdfs_host``, ...), handed to Beam's ``FileSystems``
    before the folder is read, as ``runner.run`` does for a run; one that Beam does not know is an error.
    Beam's S3 file system needs options set even when none is given (it then takes boto3's defaults:
    the environment's credentials and ``AWS_ENDPOINT_URL_S3``); a local folder imports no Beam."""
    if not beam_args and storage.is_local(folder):
        return
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    options = PipelineOptions(beam_args)
    unknown = sorted(set(options.get_all_options(retain_unknown_options=True)) - set(options.get_all_options()))
    # a word that is neither an option nor the value after an option given without "="
    strays = [a for i, a in enumerate(beam_args)
              if not a.startswith("-") and not (i and beam_args[i - 1].startswith("--") and "=" not in beam_args[i - 1])]
    if unknown or strays:
        _parser().error(f"unrecognized arguments: {' '.join([f'--{name}' for name in unknown] + strays)}")
    FileSystems.set_options(options)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported, here or in workers
    args, beam_args = _parser().parse_known_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,  # Beam logs while it is imported, which would otherwise fix the root config first
    )
    if args.command in ("inspect", "verify"):
        _filesystem_options(args.folder, beam_args)
    if not args.verbose:
        logging.getLogger("apache_beam").setLevel(logging.WARNING)
        # Quiet workers by default; a later flag on the command line overrides these.
        quiet_workers = ["--default_sdk_harness_log_level=WARNING", '--sdk_harness_log_level_overrides={"__main__": "ERROR"}']
        beam_args = quiet_workers + beam_args
    try:
        if args.command == "run":
            from jacobeam.pipeline import config as config_module

            config = config_module.load(args.config, args.overrides)
            return _run(config, beam_args, args.quiet, args.overwrite, args.verify)
        if args.command == "demo":
            return _demo(args, beam_args)
        if args.command == "verify":
            return _verify(args)
        return _inspect(args)
    except (JacobeamError, FileNotFoundError) as err:
        print(f"jacobeam: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
