"""The ``jacobeam`` command (also ``python -m jacobeam``): run, demo, inspect, verify.

Options of ``run`` and ``demo`` that jacobeam does not know are Beam ``PipelineOptions`` (``--runner``,
``--direct_num_workers``, ``--temp_location``, ...), as in every Beam program; one that Beam does not know
either is an error naming the closest known option, unless it follows ``--`` or the command has
``--allow_unknown_beam_options`` (options for a runner whose options are not registered here). ``inspect``
and ``verify`` take the file systems' Beam options (``--s3_endpoint_url``, ``--hdfs_host``, ...) after
the folder.

Run as a program (``main()`` without arguments), the command owns the process: by default it prints
jacobeam's own lines only (``quiet.py``: native and worker noise filtered; ``-v`` shows everything), and
Ctrl-C stops it with one line and exit status 130, its worker processes with it (``interrupt.py``). What
``run`` prints when done is ``summary.py``'s.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path

from jacobeam.pipeline import process_exit, quiet
from jacobeam.pipeline.interrupt import CtrlC
from jacobeam.pipeline.summary import run_summary
from jacobeam.transforms.errors import JacobeamError, MissingExtra
from jacobeam.transforms.output import storage
from jacobeam.transforms.spec import version

log = logging.getLogger("jacobeam")

# Exit statuses (the epilog of ``jacobeam --help`` lists them). USAGE is kept for what the command line
# or config must change, so that a script can tell it from a run that failed (FAILED).
OK, FAILED, USAGE, MISSING_EXTRA, BUSY, LOST, INTERRUPTED, TERMINATED = 0, 1, 2, 3, 75, 76, 130, 143
EXIT_STATUSES = """exit status (retry: whether the same command, run again unchanged, can succeed):
  0    done
  1    failed: an error during the run (inputs, model, output folder, self-check), or inspect: the folder
       is incomplete, or verify (or run --verify): a mismatch, or a folder that cannot be read.
       Retry: no; fix what the message names first (complete shards are kept for that rerun)
  2    usage: a command line or config to fix (an unknown option or config key, a malformed --set,
       a config file that cannot be read). Retry: no
  3    an optional package is missing (inspect --plot needs matplotlib, a gs:// output folder
       google-cloud-storage). Retry: no; install it
  75   busy: another run holds the output folder. Retry: yes, later (or --wait)
  76   lost: this run was paused past the lease's stale time and another run took the output folder
       over; this run committed nothing after that. Retry: yes, a rerun resumes the folder
  130  interrupted (Ctrl-C): complete shards are kept. Retry: yes, the same command finishes the run
  143  terminated (SIGTERM: a scheduler stopping or preempting the job): as Ctrl-C, the folder's lease
       released. Retry: yes, the same command finishes the run (here or on another machine)
"""

_ctrl_c = CtrlC(INTERRUPTED, TERMINATED)


class UsageError(JacobeamError):
    """A command line that cannot be run (exit status 2, as argparse's errors and ``ConfigError``)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jacobeam",
        description="Per-sample Jacobians of a TensorFlow model for many input samples, stored as HDF5.",
        epilog="Other options of run and demo are Beam pipeline options (e.g. --direct_num_workers 2\n"
        "--direct_running_mode multi_processing, --runner DataflowRunner ...); one that Beam does not know\n"
        "is an error unless it follows -- or --allow_unknown_beam_options is given; inspect and verify take the\n"
        "file systems' Beam options after the folder (e.g. --s3_endpoint_url URL).\n\n" + EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"jacobeam {version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and the final summary")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also the log messages of Beam, TensorFlow and their native code, and tracebacks")
    # -q and -v after the command too (jacobeam run cfg.yaml -q); SUPPRESS keeps the top-level value otherwise
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    beam = argparse.ArgumentParser(add_help=False, parents=[common])
    beam.add_argument("--allow_unknown_beam_options", action="store_true",
                      help="pass options Beam does not know to it as they are (for a custom runner's options); "
                      "so are the options after --")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the pipeline for a config file", parents=[beam], epilog=EXIT_STATUSES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("config", help="YAML config file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key (VALUE is YAML), e.g. --set output.path=out/")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the result of a different run in output.path (only files jacobeam wrote are "
                     "removed), once the new one is complete; a folder holding this run's own partial or earlier "
                     "result is resumed, not replaced")
    run.add_argument("--accept-library-versions", action="store_true",
                     help="resume or extend a folder computed with other versions of TensorFlow, Keras, numpy or "
                     "jacobeam (refused by default, naming them); the new shards record their own versions")
    run.add_argument("--wait", action="store_true",
                     help="when another run is writing output.path, wait for it to end instead of exiting with status 75")
    run.add_argument("--verify", type=_count, default=0, metavar="K",
                     help="verify the output at the end, recomputing K random samples and re-hashing their shards' input "
                     "samples (verify --inputs sampled); the result goes into the manifest")

    demo = commands.add_parser("demo", help="generate seeded inputs and run the built-in CNN end to end",
                               parents=[beam])
    demo.add_argument("--root", default=None, help="folder for the demo's inputs and output (default: jacobeam-demo)")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    inspect = commands.add_parser(
        "inspect", help="describe an output folder and check it is complete", parents=[common],
        description="Exit status 0 when the folder is complete, 1 when it is not or cannot be read, "
        "3 when --plot needs matplotlib (pip install 'jacobeam[plot]').",
    )
    inspect.add_argument("folder")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw inputs, saliency or Jacobians, and norms")
    inspect.add_argument("--samples", metavar="IDS", type=_ids, help="sample ids to draw, e.g. 0,5,17 (default: 0-3)")

    verify = commands.add_parser(
        "verify", help="check an output folder: checksums, ids, and K samples recomputed independently", parents=[common],
        description="Exit status 0 when everything matches, 1 on any mismatch or when the folder cannot be read.",
    )
    verify.add_argument("folder")
    verify.add_argument("--samples", type=_count, default=8, metavar="K",
                        help="random samples to recompute (default 8; 0: checksums and ids only)")
    verify.add_argument("--seed", type=int, default=0, help="seed for choosing the samples (default 0)")
    verify.add_argument("--inputs", choices=("sampled", "all", "none"), default="sampled",
                        help="whose samples to read again from the input files and compare with the digest their worker "
                        "recorded: the shards holding the recomputed samples (default; none with --samples 0), every "
                        "shard (a full pass over the inputs), or none")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _run(
    config, beam_args: list[str], quiet: bool, overwrite: bool = False, verify_samples: int = 0,
    accept_library_versions: bool = False, wait: bool = False,
) -> int:
    from jacobeam.pipeline import runner

    result = runner.run(config, beam_args, show_progress=not quiet, overwrite=overwrite, verify_samples=verify_samples,
                        accept_library_versions=accept_library_versions, planned=_ctrl_c.planned, wait=wait)
    print(run_summary(result))
    if result.verification is not None:
        from jacobeam.pipeline.verify import format_report

        print(format_report(result.verification))
        return OK if result.verification.ok else FAILED
    return OK


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

    report = verify(args.folder, samples=args.samples, seed=args.seed, inputs=args.inputs)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return OK if report.ok else FAILED


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sample ids separated by commas, got {text!r}") from None


def _inspect(args) -> int:
    from jacobeam.pipeline.inspect_output import format_report, inspect

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise MissingExtra("--plot needs matplotlib: pip install 'jacobeam[plot]'") from None
    report = inspect(args.folder)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    if args.plot and report.ok:
        from jacobeam.pipeline.plot import SamplesNotStored, plot

        if not storage.is_local(args.folder):
            raise JacobeamError(
                f"{args.folder}: --plot reads jacobians.h5, whose virtual datasets HDF5 resolves only on a "
                "local file system; copy the folder to a local disk and plot that"
            )
        notes: list[str] = []
        try:
            print(f"plot: {plot(args.folder, report.manifest, args.plot, args.samples, notes)}")
        except SamplesNotStored as err:
            raise UsageError(str(err)) from err
        except ValueError as err:
            raise JacobeamError(str(err)) from err
        for note in notes:
            print(f"plot: note: {note}")
    return OK if report.ok else FAILED


def _split_at_double_dash(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` before the first ``--``, and after it (Beam options passed on unchecked)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def _check_beam_args(beam_args: list[str]) -> None:
    """An option Beam does not know (a typo, as often as not) is an error naming the closest known one."""
    from jacobeam.pipeline import runner

    unknown, known = runner.unknown_options(beam_args)
    if not unknown:
        return
    options = [arg for arg in unknown if arg.startswith("-")]
    if not options:
        raise UsageError(f"unexpected argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}")
    name = options[0].split("=", 1)[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    more = f" (and {len(options) - 1} more)" if len(options) > 1 else ""
    raise UsageError(
        f"unknown option {name}{hint}{more}: neither jacobeam nor Beam knows it; options for a custom runner "
        "go after -- or with --allow_unknown_beam_options"
    )


def _pipeline_error(err: BaseException) -> JacobeamError | None:
    """The ``JacobeamError`` a failed pipeline carries: raised by the runner as it is, chained to the runner's
    exception (Beam re-raises a worker's error with the step's name), or, from a worker process, only
    named in the runner's message."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, JacobeamError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _remote_error(err: BaseException) -> JacobeamError | None:
    """A ``JacobeamError`` of a worker process, from the runner's message: its last
    ``jacobeam.transforms.errors.<Name>: <message>`` line (the worker's traceback is in the message)."""
    from jacobeam.transforms import errors

    found = None
    for match in re.finditer(r"(?:jacobeam\.transforms\.errors\.)?(\w+Error): (.+)", str(err)):
        kind = getattr(errors, match.group(1), None)
        if isinstance(kind, type) and issubclass(kind, JacobeamError):
            found = kind(match.group(2))
    return found


def _clean(message: str) -> str:
    """A jacobeam error's message as raised in the pipeline, without what Beam appended to it (`` [while
    running 'Step']``)."""
    return re.sub(r"( \[while running '[^']*'\])+$", "", message.strip())


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

    from jacobeam.pipeline import runner

    unknown, _ = runner.unknown_options(beam_args)  # options no PipelineOptions class parses, and stray words
    if unknown:
        _parser().error(f"unrecognized arguments: {' '.join(unknown)}")
    FileSystems.set_options(PipelineOptions(beam_args))


def main(argv: list[str] | None = None) -> int:
    """The command. ``argv`` None: the process's own command line (``jacobeam ...``, ``python -m
    jacobeam``), and the command owns the process: native stderr filtered unless ``-v``, Ctrl-C handled
    (``interrupt.CtrlC``), and the process ends without Python's teardown of TensorFlow once the command has
    returned (``process_exit``). A list (a test calling the command in its process): the arguments, and
    none of these."""
    status = _main(argv)
    if argv is None:
        process_exit.end(status)
    return status


def _main(argv: list[str] | None) -> int:
    own_process = argv is None
    argv, passthrough = _split_at_double_dash(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args, beam_args = parser.parse_known_args(argv)
    if own_process:
        quiet.prepare_environment(args.verbose)  # before TensorFlow is imported, here or in workers
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    native = quiet.NativeStderrFilter() if own_process and not args.verbose else None
    if own_process:
        _ctrl_c.install(native)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        handlers=[quiet.jacobeam_handler(None, args.verbose)],
        force=True,  # Beam logs while it is imported, which would otherwise fix the root config first
    )
    if args.command in ("inspect", "verify"):
        _filesystem_options(args.folder, beam_args + passthrough)
    logging.captureWarnings(not args.verbose)  # Python warnings of the libraries: -v shows them as they are
    try:
        status = _command(args, beam_args, passthrough)
        sys.stdout.flush()  # a closed pipe shows here, where it is handled, not in the interpreter's exit
        return status
    except (JacobeamError, FileNotFoundError) as err:
        return _error(err, args.verbose, err if "[while running '" in str(err) else None)
    except BrokenPipeError:  # the reader went away (``jacobeam inspect out | head``): no traceback
        try:  # the interpreter flushes stdout once more at exit: into nothing, not the closed pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return FAILED
    except Exception as err:
        found = _pipeline_error(err) or _remote_error(err)
        if found is None:
            raise
        return _error(found, args.verbose, err)
    finally:
        if native is not None:
            native.close()


def _error(err: BaseException, verbose: bool, raised: BaseException | None = None) -> int:
    """One line for a jacobeam error; ``raised``: the pipeline's exception that carried it, whose
    traceback ``-v`` shows first."""
    if verbose and raised is not None:
        traceback.print_exception(raised, file=sys.stderr)
    if isinstance(err, MissingExtra):
        print(f"jacobeam: {err}", file=sys.stderr)
        return MISSING_EXTRA
    from jacobeam.pipeline.config import ConfigError
    from jacobeam.transforms.errors import LostLeaseError
    from jacobeam.transforms.output.lease import LeaseBusy

    print(f"jacobeam: error: {_clean(str(err))}", file=sys.stderr)
    if isinstance(err, LeaseBusy):
        return BUSY
    if isinstance(err, LostLeaseError):
        return LOST
    return USAGE if isinstance(err, (ConfigError, UsageError)) else FAILED


def _command(args, beam_args: list[str], passthrough: list[str]) -> int:
    if args.command in ("run", "demo"):
        if not args.allow_unknown_beam_options:
            _check_beam_args(beam_args)
        beam_args = beam_args + passthrough
        if not args.verbose:
            logging.getLogger("apache_beam").setLevel(logging.WARNING)
            # Quiet workers by default; a later flag on the command line overrides these.
            quiet_workers = ["--default_sdk_harness_log_level=WARNING", '--sdk_harness_log_level_overrides={"__main__": "ERROR"}']
            beam_args = quiet_workers + beam_args
    if args.command == "run":
        from jacobeam.pipeline import config as config_module

        config = config_module.load(args.config, args.overrides)
        return _run(config, beam_args, args.quiet, args.overwrite, args.verify, args.accept_library_versions, args.wait)
    if args.command == "demo":
        return _demo(args, beam_args)
    if args.command == "verify":
        return _verify(args)
    return _inspect(args)


if __name__ == "__main__":
    sys.exit(main())
