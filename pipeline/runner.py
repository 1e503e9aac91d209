"""Wiring: a planned job, Beam options -> the Beam graph from the named transforms -> a finished run."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from jacobeam.pipeline import overwrite as overwrite_module
from jacobeam.pipeline import plan
from jacobeam.pipeline.config import Config, ConfigError, to_dict
from jacobeam.pipeline.folder import Folder, judged_by_weights, read_folder
from jacobeam.pipeline.output_lease import remove_created, take_lease
from jacobeam.pipeline.progress import ShardProgress
from jacobeam.transforms.compute import EngineFactory
from jacobeam.transforms.finalize import Finalize, rerun_manifest, write_manifest
from jacobeam.transforms.job import ComputeShards
from jacobeam.transforms.output import fence, storage
from jacobeam.transforms.output.layout import MANIFEST, SHARDS_DIR, shard_ids, shard_name
from jacobeam.transforms.output.lease import Lease
from jacobeam.transforms.spec import JobSpec
from jacobeam.transforms.testing import faults

log = logging.getLogger(__name__)

# Imported by each local worker process as it starts (quiet.start_worker).
WORKER_START = "jacobeam.pipeline.worker_start"

# Since Beam 2.68 the plain DirectRunner first tries to download the Prism runner binary; on a machine
# whose firewall drops packets that stalls. These names therefore get the in-process FnApiRunner.
_LOCAL_RUNNERS = {None, "DirectRunner", "SwitchingDirectRunner", "FnApiRunner"}


@dataclass
class RunResult:
    manifest: dict[str, Any]
    metrics: dict[str, Any]
    verification: Any = None  # pipeline.verify.Report when the run was asked to --verify


def is_local(options: PipelineOptions) -> bool:
    return options.view_as(StandardOptions).runner in _LOCAL_RUNNERS


def is_dask(options: PipelineOptions) -> bool:
    """``--runner DaskRunner`` (Beam's runner on a Dask ``distributed`` cluster), by its short or full name."""
    runner = options.view_as(StandardOptions).runner
    return isinstance(runner, str) and runner.rsplit(".", 1)[-1] == "DaskRunner"


def _dask_runner_module():
    try:
        from apache_beam.runners.dask import dask_runner
    except ImportError as err:
        raise ConfigError(
            f"--runner DaskRunner needs dask and distributed ({err}): pip install 'jacobeam[dask]'"
        ) from err
    return dask_runner


def with_dask_partitions(options: PipelineOptions) -> PipelineOptions:
    """On Dask, one shard range per partition of the ranges (unless ``--dask_npartitions`` or
    ``--dask_partition_size`` says otherwise). Beam's DaskRunner runs each partition of a bag as one
    task through every step that follows, and its default of 128 elements per partition would make a
    job of fewer ranges one task on one worker (``Reshuffle`` is a no-op there): one range per task
    lets the scheduler spread the shards over the workers, re-run only a lost worker's ranges, and stop
    a cancelled run after the ranges under way."""
    dask = options.view_as(_dask_runner_module().DaskOptions)
    if dask.npartitions is None and dask.partition_size is None:
        dask.partition_size = 1
    return options


def local_worker_processes(options: PipelineOptions) -> int:
    """How many worker processes share this machine's cores (1 unless ``multi_processing``)."""
    direct = options.view_as(DirectOptions)
    if not is_local(options) or direct.direct_running_mode != "multi_processing":
        return 1
    return direct.direct_num_workers or os.cpu_count() or 1


def engine_in_workers(options: PipelineOptions) -> bool:
    """Whether every engine of the run is built in worker processes of this machine (a local runner's
    ``multi_processing``), none in the launcher (see ``launcher_loads_model``)."""
    return is_local(options) and options.view_as(DirectOptions).direct_running_mode == "multi_processing"


def launcher_loads_model(config: Config, options: PipelineOptions, folder: Folder | None = None) -> bool:
    """Whether the launcher loads the model to check it while planning (``plan.make_job``).

    The run's model identity is read from the model's files without loading it
    (``transforms.model_identity``): a rerun with nothing to compute loads no model (but a factory, whose
    identity is that of the model it builds: ``plan.make_job`` builds it where it is not checked). The
    launcher loads it on a fresh folder whose engines it builds in its own process (to check the model against the
    inputs before anything runs), and on a folder written before shards stored the model's identity,
    which only the loaded weights can be compared with; with ``outputs: label`` on a fresh folder too, for
    the model's output size, which bounds the labels that the plan checks (a folder's shards record it).
    Local worker processes check the model when they build the engine (against the samples, and the
    identity it was planned with), and ``Finalize`` that every shard has the same weights. ``folder``: the
    output folder as ``read_folder`` found it, where the caller has it."""
    folder = read_folder(config.output.path) if folder is None else folder
    if folder.empty:
        return config.jacobian.needs_labels or not engine_in_workers(options)
    return judged_by_weights(folder)


def tf_threads(config: Config, options: PipelineOptions) -> int | None:
    """TensorFlow threads per worker: the config's number, or the local cores split between workers."""
    if config.jacobian.threads != "auto":
        return config.jacobian.threads
    if not is_local(options):
        return None
    return max(1, (os.cpu_count() or 1) // local_worker_processes(options))


def work_items(spec: JobSpec, worker_processes: int | None = None) -> list:
    """The job's elements. With ``worker_processes`` (a local runner, whose worker processes are known):
    one run of consecutive shard ranges per process (as many runs as processes, at most one per range),
    in which each shard's commit overlaps the next shard's computing; the runs are cut where their
    samples come closest to equal shares (5 shards of 4,096, 4,096, 4,096, 4,096 and 3,616 samples: 2 and
    3, not 3 and 2). Without (a runner that spreads elements over workers it knows: Dask, Dataflow,
    Flink, ...): one range per element, so that the ranges spread, a lost worker's ranges are run again
    alone, and a cancelled run stops after the ranges under way."""
    ranges = spec.ranges()
    if not worker_processes or not ranges:
        return ranges
    runs = min(worker_processes, len(ranges))
    total, done = sum(r.rows for r in ranges), list(itertools.accumulate(r.rows for r in ranges))
    cuts = [0]
    for k in range(1, runs):  # the k-th cut: after ranges[:cut], each run keeping at least one range
        cut = min(range(cuts[-1] + 1, len(ranges) - runs + k + 1), key=lambda i: abs(done[i - 1] - total * k / runs))
        cuts.append(cut)
    cuts.append(len(ranges))
    return [tuple(ranges[lo:hi]) for lo, hi in zip(cuts, cuts[1:])]


def build(
    pipeline: beam.Pipeline, spec: JobSpec, engine_factory: EngineFactory | None = None, worker_processes: int | None = None,
    complete: bool = False,
):
    """The whole job as a Beam graph: shard ranges (``work_items``), spread over the workers -> each
    range read, computed and written as its shard (``ComputeShards``; a complete shard kept) -> one
    ``ShardRecord`` each -> ``Finalize``: aggregates, ``jacobians.h5``, ``rejected.jsonl``, the manifest.

    Only ranges and records travel between steps, every output comes out of ``process``, no step has a
    side input or a tagged output: the shape runs as intended on any runner (Dask's too, which keeps
    none of those as the others do).

    Args:
        pipeline: the pipeline to add the job's transforms to (``beam.Pipeline``, or a ``TestPipeline``).
        spec: the planned job (``plan.make_job``).
        engine_factory: builds each worker's engine (see ``ComputeJacobians``); None is TensorFlow's
            ``JacobianEngine``. A test seam: ``transforms.testing.fake_engine.FakeEngineFactory``.
        worker_processes: a local runner's worker processes (see ``work_items``); None: one range per
            element.
        complete: every shard is complete already (``ComputeShards``: no worker loads the model).

    Returns:
        ``PCollection[dict]`` of one element, the manifest ``Finalize`` writes when every shard is
        done.
    """
    return (
        pipeline
        | "ShardRanges" >> beam.Create(work_items(spec, worker_processes))
        | "Spread" >> beam.Reshuffle()  # a no-op on Dask, where the partitions spread (with_dask_partitions)
        | "ComputeShards" >> ComputeShards(spec, engine_factory, complete)
        | "Finalize" >> Finalize(spec)
    )


def with_filesystem_plugins(options: PipelineOptions) -> PipelineOptions:
    """Name every Beam ``FileSystem`` known here in ``--beam_plugins``, so that worker processes import
    them too (Beam finds a file system by subclass; only the DataflowRunner passes them on by itself).
    A file system of a project's own, registered by importing its module, then works on every runner."""
    from apache_beam.io.filesystem import FileSystem
    from apache_beam.options.pipeline_options import SetupOptions

    setup = options.view_as(SetupOptions)
    known = list(setup.beam_plugins or [])
    for plugin in FileSystem.get_all_plugin_paths():
        if plugin not in known and not plugin.startswith("apache_beam."):
            known.append(plugin)
    setup.beam_plugins = known or None
    return options


def unknown_options(beam_args: list[str]) -> tuple[list[str], list[str]]:
    """The arguments in ``beam_args`` that no ``PipelineOptions`` class parses (as Beam's own parsing, which
    only logs them as it discards them), and every option name Beam knows here: those of the options
    classes Beam defines and of those registered by the modules imported so far (file systems, runners)."""
    from apache_beam.options.pipeline_options import _BeamArgumentParser

    if any("dask" in arg.lower() for arg in beam_args):
        _dask_runner_module()  # registers DaskOptions (--dask_client_address, ...), which Beam defines there
    parser = _BeamArgumentParser(allow_abbrev=False)
    # As PipelineOptions.get_all_options: each direct subclass (by name: a class may be defined twice)
    for cls in {str(cls): cls for cls in PipelineOptions.__subclasses__()}.values():
        cls._add_argparse_args(parser)
    _, unknown = parser.parse_known_args(beam_args)
    known = sorted(name for action in parser._actions for name in action.option_strings if name.startswith("--"))
    return unknown, known


def _runner(options: PipelineOptions):
    if is_dask(options):  # beam.Pipeline() knows the DaskRunner only by its module path
        return _dask_runner_module().DaskRunner()
    if not is_local(options):
        return None  # Beam picks the runner named by --runner
    from apache_beam.options.pipeline_options import SetupOptions

    setup = options.view_as(SetupOptions)
    setup.beam_plugins = [*(setup.beam_plugins or []), WORKER_START]  # worker processes: quiet.start_worker
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    # As Beam's DirectRunner does: hand the options to worker processes (log level, for one).
    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options(drop_default=True))
    provision = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(provision))


def _close_client(result) -> None:
    """Beam's DaskRunner leaves its ``distributed.Client`` connected after the run (``result.client``):
    closing it releases what the run left on the cluster (its records, the manifest) and, should the
    run have failed, its tasks still pending."""
    client = getattr(result, "client", None)
    if client is not None:
        client.close()


def _manifest_counts(manifest: dict[str, Any]) -> dict[str, int]:
    """jacobeam's own counts from a run's manifest, for a run without Beam's metrics: ``samples`` computed,
    ``shards_written`` and ``shards_skipped``."""
    shards = manifest["shards"]
    return {
        "samples": manifest["run"]["samples_computed"],
        "shards_written": sum(1 for shard in shards if shard["computed_in_this_run"]),
        "shards_skipped": sum(1 for shard in shards if not shard["computed_in_this_run"]),
    }


def _metrics(result, manifest: dict[str, Any]) -> dict[str, Any]:
    """The run's Beam metrics by name; where the runner collects none (Beam's DaskRunner raises
    ``NotImplementedError``), jacobeam's own counts from the manifest: ``samples`` computed,
    ``shards_written`` and ``shards_skipped``."""
    try:
        query = result.metrics().query()
    except NotImplementedError:
        log.info("the runner reports no metrics; counting samples and shards from the manifest")
        return _manifest_counts(manifest)
    found: dict[str, Any] = {}
    for counter in query["counters"]:
        found[counter.key.metric.name] = counter.committed
    for gauge in query["gauges"]:
        if gauge.committed is not None:
            found[gauge.key.metric.name] = gauge.committed.value
    for dist in query["distributions"]:
        value = dist.committed
        if value is not None and value.count:
            found[dist.key.metric.name] = {"count": value.count, "mean": value.mean, "max": value.max}
    return found


def run(
    config: Config,
    beam_args: list[str],
    show_progress: bool = True,
    overwrite: bool = False,
    verify_samples: int = 0,
    accept_library_versions: bool = False,
    *,
    pipeline: beam.Pipeline | None = None,
    engine_factory: EngineFactory | None = None,
    planned: Callable[[JobSpec], None] | None = None,
    wait: bool = False,
) -> RunResult:
    """Plan (checking everything first), build and run the job; blocks until the manifest is written.
    With ``verify_samples``, verify the output afterwards and record the result in the manifest.

    Args:
        config: the validated job configuration.
        beam_args: Beam's command-line options (``--runner`` and the like): they choose the runner of
            the pipeline made here, and give file systems their options while the job is planned.
        show_progress: show the shards' progress (local runners only).
        overwrite: replace what another run left in the output folder (only files jacobeam wrote).
        verify_samples: after the run, ``verify`` the folder, recomputing this many samples (0: do not).
        accept_library_versions: extend or resume a folder computed with other versions of TensorFlow,
            Keras, numpy or jacobeam (the new shards record their own).
        pipeline: run the job in this pipeline instead of making one from ``beam_args`` (as Beam's
            examples take ``test_pipeline``): a test passes a ``TestPipeline``. It runs with its own
            runner and options (``beam_args`` still serve the plan), and this call runs it: it should
            hold nothing but the job.
        engine_factory: builds each worker's engine (see ``ComputeJacobians``); None is TensorFlow's
            ``JacobianEngine``. With a factory the model the config names is neither loaded nor
            checked while planning (the factory's engine stands in for it), the shards record the
            factory engine's fingerprint and no model identity.
        planned: called with the job's spec once it is planned and the output folder prepared, before
            the pipeline runs (the command line uses it to say what an interrupted run kept).
        wait: when another run holds the output folder's lease, wait for it to end instead of
            raising ``LeaseBusy``.

    Returns:
        The manifest as written, the run's Beam metrics (``jacobeam`` counters, gauges, distributions
        by name) and, with ``verify_samples``, the ``verify.Report``.

    Raises:
        LeaseBusy: (an ``OutputError``) another live run writes the output folder (without ``wait``).
        JacobeamError: (``ConfigError``, ``InputError``, ``ModelError``, ``OutputError``) the plan
            found a problem (nothing was written), or the output folder cannot be written.
        Exception: the pipeline failed (the runner's exception, wrapping the worker's error).
    """
    options = with_filesystem_plugins(PipelineOptions(beam_args))
    if is_dask(options):
        options = with_dask_partitions(options)
    # The plan reads inputs and the output folder before a Pipeline exists (which would do this): file
    # systems that take options (--hdfs_host, --s3_region_name, ...) need them here already.
    FileSystems.set_options(options)
    # One writer per folder (issue 23): the lease is taken before the plan reads the folder, so that a
    # second run plans on the first's complete result, and held until the manifest is written.
    lease, created = take_lease(config.output.path, wait)
    done = False
    try:
        with _heap_frozen():
            # An --overwrite whose new result was committed, stopped before it replaced the old one.
            overwrite_module.finish(config.output.path, to_dict(config)["output"]["path"], _guard(config, lease))
            result = _run_leased(config, options, show_progress, overwrite, verify_samples, pipeline, engine_factory,
                                 planned, accept_library_versions, lease)
            if isinstance(result, plan.Replace):
                result = _replace(result, config, options, show_progress, verify_samples, pipeline, engine_factory,
                                  planned, accept_library_versions, wait, lease)
            else:
                overwrite_module.warn_unfinished(config.output.path)
        done = True
        return result
    finally:
        loading = sys.modules.get("jacobeam.transforms.engine.models")  # imported where a model was loaded
        if loading is not None:
            loading.forget_kept()  # the checked model, if no engine of this process took it
        if lease is not None:
            lease.release()
            if not done:
                remove_created(created)


def _guard(config: Config, lease: Lease | None) -> fence.Fence | None:
    """The fence of the commits of the run holding ``lease`` on the folder ``config`` writes."""
    return fence.Fence(storage.normalize(config.output.path), lease.run_id) if lease is not None else None


def _replace(
    replace: plan.Replace, config, options, show_progress, verify_samples, pipeline, engine_factory, planned,
    accept_library_versions, wait, lease: Lease | None,
) -> RunResult:
    """``--overwrite`` of another run's complete result (``pipeline.overwrite``): the run, in the staging
    folder inside the output folder, then its result moved in."""
    staged = overwrite_module.staging(replace.root)
    log.warning("--overwrite: replacing the different run in %s once this run's result is complete (computed in "
                "%s until then; the old result stays whole and readable)", replace.root, staged)
    staged_config = config.model_copy(update={"output": config.output.model_copy(update={"path": staged})})
    # Its own lease, as any run's, where the folder has one (a file system without one was said so once).
    inner, created = take_lease(staged, wait) if lease is not None else (None, [])
    try:
        result = _run_leased(staged_config, options, show_progress, True, 0, pipeline, engine_factory, planned,
                             accept_library_versions, inner)
    finally:
        if inner is not None:
            inner.release()
        remove_created(created)  # the staging folder, if the run failed before it wrote anything
    guard = _guard(config, lease)
    manifest = overwrite_module.finish(replace.root, to_dict(config)["output"]["path"], guard)
    return _verified(replace.root, manifest, result.metrics, verify_samples, guard)


def _warn_idle_workers(spec: JobSpec, options: PipelineOptions) -> None:
    """Say when local worker processes cannot all help (two processes ran slower than one here, without
    a word): fewer shards to compute than processes, or more TensorFlow threads than cores."""
    workers = local_worker_processes(options)
    if workers < 2:
        return
    complete = set(storage.listdir(storage.join(spec.output_dir, SHARDS_DIR)))
    todo = sum(1 for r in spec.ranges() if shard_name(r.start, r.stop) not in complete)
    if 0 < todo < workers:
        log.warning("%d shard(s) to compute for %d worker processes: %d will idle (a smaller "
                    "output.samples_per_shard gives each work)", todo, workers, workers - todo)
    cores = os.cpu_count() or 1
    if spec.tf_threads and workers * spec.tf_threads > cores:
        log.warning("%d worker processes x %d TensorFlow threads (jacobian.threads) on %d cores: they compete "
                    "for the cores (jacobian.threads: auto splits them)", workers, spec.tf_threads, cores)


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """The objects alive when the run starts, and again once it is planned (the imported libraries, the
    plan's per-file records), left out of Python's garbage collection until it ends (``gc.freeze``): a
    full collection walks every tracked object, and TensorFlow's and a big plan's are millions, each
    pass a third of a second, which a run of many small files triggered again and again
    (benchmarks/README.md). Unfrozen at the end, they are collectable as before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _lost_lease_first(spec: JobSpec) -> Iterator[None]:
    """A failed pipeline of a run that lost its folder's lease fails for that reason (``LostLeaseError``,
    exit status 76): what failed first (another run's shard in its way) is only its symptom."""
    try:
        yield
    except Exception as err:
        lost = fence.lost(spec)
        if lost is not None:
            raise lost from err
        raise


def _run_leased(
    config, options, show_progress, overwrite, verify_samples, pipeline, engine_factory, planned, accept_library_versions,
    lease: Lease | None,
) -> RunResult | plan.Replace:
    folder = read_folder(config.output.path)
    check_model = engine_factory is None and (pipeline is not None or launcher_loads_model(config, options, folder))
    run_id = lease.run_id if lease is not None else ""
    job = plan.plan_run(
        config, tf_threads(config, options), overwrite=overwrite, check_model=check_model,
        accept_library_versions=accept_library_versions, identify_model=engine_factory is None, run_id=run_id,
        folder=folder, shortcut=pipeline is None,
    )
    if isinstance(job, plan.Replace):
        return job
    if isinstance(job, plan.UpToDate):
        guard = fence.Fence(job.root, run_id) if run_id else None
        manifest = _record_up_to_date(job, run_id or uuid.uuid4().hex[:12], guard, tf_threads(config, options))
        return _verified(job.root, manifest, _manifest_counts(manifest), verify_samples, guard)
    spec, already_done = job.spec, job.already_done
    gc.freeze()  # the plan and what it imported (see _heap_frozen)
    plan.prepare_output(job)
    if planned is not None:
        planned(spec)
    faults.reached("plan")
    ranges = spec.ranges()
    to_read = sum(stop - start for start, stop in map(shard_ids, spec.stale))  # kept where they read as before
    removed = spec.removed_in(0, spec.num_samples)  # ids of input files gone: taken, stored no more
    log.info(
        "%d samples of shape %s in %d file(s)%s -> %d shard(s) in %s (%d samples already complete, %d to read again, "
        "%d unreadable file(s))", spec.num_samples, spec.sample_shape, len(spec.files),
        f" ({removed} of them removed: {len(spec.removed)} input file(s) gone)" if removed else "", len(ranges),
        spec.output_dir, already_done, to_read, len(spec.file_rejects),
    )
    _warn_idle_workers(spec, options)
    progress = ShardProgress(spec, already_done) if show_progress and is_local(options) else contextlib.nullcontext()
    with progress:
        if pipeline is None:
            pipeline = beam.Pipeline(runner=_runner(options), options=options)
        build(pipeline, spec, engine_factory, local_worker_processes(options) if is_local(options) else None, job.complete)
        with _lost_lease_first(spec):
            result = pipeline.run()
            try:
                result.wait_until_finish()
            finally:
                _close_client(result)
    manifest = json.loads(storage.read_text(storage.join(spec.output_dir, MANIFEST)))
    return _verified(spec.output_dir, manifest, _metrics(result, manifest), verify_samples, fence.of(spec))


def _record_up_to_date(done: plan.UpToDate, run_id: str, guard: fence.Fence | None, threads: int | None
                       ) -> dict[str, Any]:
    """A run whose folder holds its complete result already: its manifest, and nothing else, written."""
    log.info("nothing to do: %s holds this run's complete result (%d input files unchanged since, %d shard(s))",
             done.root, done.files, len(done.manifest["shards"]))
    manifest = rerun_manifest(done.manifest, run_id, time.time(), threads)
    write_manifest(done.root, manifest, guard)
    return manifest


def _verified(root: str, manifest: dict[str, Any], metrics: dict[str, Any], verify_samples: int,
              guard: fence.Fence | None) -> RunResult:
    """The run's result; with ``verify_samples``, the folder ``root`` verified first and the verdict recorded."""
    verification = None
    if verify_samples:
        from jacobeam.pipeline import verify

        verification = verify.verify(root, samples=verify_samples)
        manifest = verify.record(root, verification, guard)
    return RunResult(manifest=manifest, metrics=metrics, verification=verification)
