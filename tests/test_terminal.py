"""The first hour of a new user: what the terminal shows. ``python -m jacobeam`` in a subprocess, as a
user runs it (without the test environment's TF_CPP_MIN_LOG_LEVEL): jacobeam's own lines only, with or
without worker processes; ``-v`` shows the rest but no Beam type-hint conversion; Ctrl-C is one line,
exit status 130, no process left behind, and the same command finishes the run with the same shards.
Then the one-line errors: a JacobeamError raised inside the pipeline, ``inspect --plot`` without
matplotlib, a corrupt ``.keras`` file, a mistyped Beam option, a missing ``.h5`` dataset."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from jacobeam.pipeline import cli, runner
from jacobeam.transforms.errors import InputError
from jacobeam.transforms.inputs.readers import describe
from jacobeam.transforms.testing import faults

REPO = Path(__file__).resolve().parent.parent
# Each worker with the one process's TensorFlow threads (threads: auto would halve them): on some CPUs float32
# round-off depends on the thread count (docs/engine.md), and the tests compare shards with a one-process run's
# bit for bit.
TWO_PROCESSES = [
    "--direct_num_workers", "2", "--direct_running_mode", "multi_processing", "--set", f"jacobian.threads={os.cpu_count()}"
]
SHARDS = 8
# What the run says of TWO_PROCESSES, which oversubscribes the cores on purpose (above): one warning line
# each for the threads and, when fewer shards are left than processes, for the idle one.
_WORKER_NOTES = re.compile(r"[\d:]+ WARNING jacobeam\.pipeline\.runner: (?:2 worker processes x \d+ TensorFlow threads "
                           r"|\d+ shard\(s\) to compute for 2 worker processes: ).*\n")


def _without_worker_notes(stderr: str) -> str:
    return _WORKER_NOTES.sub("", stderr)

# jacobeam's own lines on stderr: its log records, its progress, its errors
OWN = re.compile(r"\d\d:\d\d:\d\d (INFO|WARNING|ERROR) jacobeam(\.[\w.]+)?: .*|jacobeam: .*")
INTERRUPTED = re.compile(rf"jacobeam: interrupted: \d of {SHARDS} shards complete and kept; run the same command again to finish")
TERMINATED = re.compile(rf"jacobeam: terminated \(SIGTERM\): \d of {SHARDS} shards complete and kept; run the same command "
                        "again to finish")


def _env(**extra) -> dict[str, str]:
    """The environment of a user's shell: none of the test settings (conftest sets TF_CPP_MIN_LOG_LEVEL)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL" and not k.startswith("JACOBEAM_")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _jacobeam(*args, cwd, timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jacobeam", *args], cwd=cwd, env=_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def _foreign(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not OWN.fullmatch(line)]


def _write_job(root: Path) -> Path:
    """32 samples of the built-in MLP in 3 files, 8 shards of 4."""
    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True)
    for name, size in {"a": 10, "b": 12, "c": 10}.items():
        np.save(root / "data" / f"{name}.npy", rng.normal(size=(size, 784)).astype(np.float32))
    config = root / "config.yaml"
    config.write_text(json.dumps({
        "model": {"builtin": "mlp"},
        "input": {"paths": ["data/*.npy"]},
        "jacobian": {"batch_size": 4},
        "output": {"path": "out", "samples_per_shard": 4},
    }))
    return config


def _checksums(folder: Path) -> list[str]:
    return [shard["crc32c"] for shard in json.loads((folder / "manifest.json").read_text())["shards"]]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job, and one uninterrupted run of it as a user starts it (``jacobeam run config.yaml``)."""
    root = tmp_path_factory.mktemp("first_hour")
    _write_job(root)
    done = _jacobeam("run", "config.yaml", cwd=root)
    return root, done


@pytest.mark.slow
def test_a_run_prints_jacobeam_lines_only(job):
    root, done = job
    assert done.returncode == 0, done.stderr
    assert _foreign(done.stderr) == []
    assert done.stdout.startswith("done: 32 samples")
    assert re.search(r"\nmetrics: batch_latency_ms=mean [\d.]+ max [\d.]+, batches=8, ", done.stdout), done.stdout
    # what the self-check found, in its own line: one sample of each of the 8 shards of 4, all right (tanh MLP)
    assert ("\nself-check: 8 sample(s) in 8 shard(s) recomputed on their own: 8 passed, 0 at a kink, 0 mismatch(es); "
            "max relative error ") in done.stdout
    assert "jacobeam.pipeline.runner: 32 samples of shape (784,)" in done.stderr  # the INFO lines stay


@pytest.mark.slow
def test_two_worker_processes_print_jacobeam_lines_only(job, tmp_path):
    root, done = job
    two = _jacobeam("run", str(root / "config.yaml"), "--set", f"output.path={tmp_path / 'out'}", *TWO_PROCESSES, cwd=root)
    assert two.returncode == 0, two.stderr
    assert _foreign(two.stderr) == []
    assert two.stdout.startswith("done: 32 samples")
    assert _checksums(tmp_path / "out") == _checksums(root / "out")


@pytest.mark.slow
def test_verbose_shows_the_libraries_but_no_type_hint_conversions(job, tmp_path):
    root, _ = job
    verbose = _jacobeam("-v", "run", str(root / "config.yaml"), "--set", f"output.path={tmp_path / 'out'}", cwd=root)
    assert verbose.returncode == 0, verbose.stderr
    assert "apache_beam" in verbose.stderr  # Beam's own log lines are back
    assert "Converting string literal type hint" not in verbose.stderr


def _descendants(pid: int) -> set[int]:
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except (OSError, ValueError):
            continue
        parents[int(entry)] = int(stat.rsplit(b")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


def _interrupt(root: Path, out: Path, beam_args: list[str], whole_group: bool, signum=signal.SIGINT) -> None:
    """Start ``jacobeam -q run`` slowed down at each finished shard, Ctrl-C it once 3 shards are complete
    (SIGINT to the command, or to its process group as a terminal does; or ``signum``, SIGTERM as a scheduler
    stops a job); check what it leaves: complete shards, no lease, no process."""
    command = [sys.executable, "-m", "jacobeam", "run", str(root / "config.yaml"), "-q",
               "--set", f"output.path={out}", *beam_args]
    proc = subprocess.Popen(command, cwd=root, env=_env(**{faults.DELAY_AT: "shard_done:1.5"}), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=whole_group)
    deadline = time.monotonic() + 240
    while len(list((out / "shards").glob("*.h5"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    children = _descendants(proc.pid)
    assert len(children) >= (2 if beam_args else 0)
    if whole_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    stderr = _without_worker_notes(stderr)

    assert proc.returncode == (130 if signum == signal.SIGINT else 143), stderr
    assert stdout == ""
    assert (INTERRUPTED if signum == signal.SIGINT else TERMINATED).fullmatch(stderr.rstrip("\n")), stderr
    assert not (out / ".jacobeam-lease.json").exists()
    kept = int(stderr.split(": ")[2].split()[0])
    assert 3 <= kept < SHARDS and len(list((out / "shards").glob("*.h5"))) == kept
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def _finish(root: Path, out: Path, beam_args: list[str], reference: list[str]) -> None:
    """The same command again finishes the run: the shards equal an uninterrupted run's."""
    before = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.h5")}
    again = _jacobeam("run", str(root / "config.yaml"), "-q", "--set", f"output.path={out}", *beam_args, cwd=root)
    assert again.returncode == 0, again.stderr
    assert _without_worker_notes(again.stderr) == ""
    assert f"{4 * len(before)} already complete" in again.stdout
    assert _checksums(out) == reference
    assert {name: (out / "shards" / name).stat().st_mtime_ns for name in before} == before  # kept, not rewritten


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_the_same_command_finishes(job, tmp_path):
    root, done = job
    _interrupt(root, tmp_path / "out", [], whole_group=False)
    _finish(root, tmp_path / "out", [], _checksums(root / "out"))


@pytest.mark.slow
@pytest.mark.parametrize("whole_group", [False, True])  # Kubernetes signals the command; Slurm the whole step
def test_sigterm_stops_as_ctrl_c_does_and_releases_the_lease(job, tmp_path, whole_group):
    """SIGTERM killed the command with status 143, no line, its lease and a temporary file left: a job
    rescheduled elsewhere waited for the lease to go stale."""
    root, done = job
    beam_args = TWO_PROCESSES if whole_group else []
    _interrupt(root, tmp_path / "out", beam_args, whole_group=whole_group, signum=signal.SIGTERM)
    _finish(root, tmp_path / "out", beam_args, _checksums(root / "out"))


@pytest.mark.slow
def test_ctrl_c_of_an_overwrite_says_the_result_it_replaces_is_untouched(job, tmp_path):
    """An ``--overwrite`` computes in a folder of its own: stopped, it says that the old result is as it was,
    and it is; the same command then replaces it."""
    root, _ = job
    out = tmp_path / "out"
    old = _jacobeam("run", "config.yaml", "-q", "--set", f"output.path={out}", "--set", "jacobian.outputs=[0]", cwd=root)
    assert old.returncode == 0, old.stderr
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    command = [sys.executable, "-m", "jacobeam", "run", "config.yaml", "-q", "--set", f"output.path={out}", "--overwrite"]
    proc = subprocess.Popen(command, cwd=root, env=_env(**{faults.DELAY_AT: "shard_done:1.5"}), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    staged, deadline = out / ".jacobeam-overwrite" / "shards", time.monotonic() + 240
    while len(list(staged.glob("*.h5"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)

    assert proc.returncode == 130, stderr
    warning, line = stderr.rstrip("\n").split("\n")
    assert re.fullmatch(r"[\d:]+ WARNING jacobeam\.pipeline\.runner: --overwrite: replacing the different run in .*", warning)
    assert re.fullmatch(INTERRUPTED.pattern + "; the result it replaces is untouched", line), stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".jacobeam-overwrite" not in p.parts} == before
    again = _jacobeam("run", "config.yaml", "-q", "--set", f"output.path={out}", "--overwrite", cwd=root)
    assert again.returncode == 0, again.stderr
    assert _checksums(out) == _checksums(root / "out") and not (out / ".jacobeam-overwrite").exists()


@pytest.mark.slow
def test_ctrl_c_while_an_overwrite_moves_its_result_in_says_the_next_run_finishes_it(job, tmp_path):
    root, _ = job
    out = tmp_path / "out"
    old = _jacobeam("run", "config.yaml", "-q", "--set", f"output.path={out}", "--set", "jacobian.outputs=[0]", cwd=root)
    assert old.returncode == 0, old.stderr
    command = [sys.executable, "-m", "jacobeam", "run", "config.yaml", "-q", "--set", f"output.path={out}", "--overwrite"]
    proc = subprocess.Popen(command, cwd=root, env=_env(**{faults.DELAY_AT: "overwrite_move:2"}), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while (out / "manifest.json").exists():  # the old result ends once the new one is committed
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)

    assert proc.returncode == 130, stderr
    assert stderr.rstrip("\n").split("\n")[-1] == (
        f"jacobeam: interrupted while this run's result replaced the one in {out}: the next run of the folder finishes "
        "replacing it")
    again = _jacobeam("run", "config.yaml", "-q", "--set", f"output.path={out}", cwd=root)  # no --overwrite needed
    assert again.returncode == 0, again.stderr
    assert _checksums(out) == _checksums(root / "out") and not (out / ".jacobeam-overwrite").exists()


def test_the_interrupt_line_of_an_overwrite_says_where_it_was(tmp_path):
    """Computing (the old result untouched), moving its result in, or done (verifying): each its own line."""
    from types import SimpleNamespace

    from jacobeam.pipeline.interrupt import CtrlC

    out, staged = tmp_path / "out", tmp_path / "out" / ".jacobeam-overwrite"
    (staged / "shards").mkdir(parents=True)
    handler = CtrlC(130, 143)
    handler.planned(SimpleNamespace(output_dir=str(staged), run_id="new", ranges=lambda: []))
    (out / "manifest.json").write_text(json.dumps({"run": {"id": "old"}}))
    assert handler.message() == ("jacobeam: interrupted: 0 of 0 shards complete and kept; run the same command again "
                                 "to finish; the result it replaces is untouched")
    (staged / "manifest.json").write_text(json.dumps({"run": {"id": "new"}}))
    (out / "manifest.json").unlink()
    assert handler.message() == (f"jacobeam: interrupted while this run's result replaced the one in {out}: the next "
                                 "run of the folder finishes replacing it")
    (staged / "manifest.json").rename(out / "manifest.json")
    assert handler.message() == f"jacobeam: interrupted: this run's result has replaced the one in {out}"


@pytest.mark.slow
def test_a_grown_compressed_tfrecord_file_is_counted_without_a_warning_about_threads(tmp_path):
    """Counting a .tfrecord.gz file's records (read through: it grew) was the launcher's first TensorFlow op,
    before its threads were set: each rerun warned that they could not be."""
    from tests.test_more_inputs import example, write_tfrecord

    rng = np.random.default_rng(0)
    samples = rng.normal(size=(20, 784)).astype(np.float32)
    (tmp_path / "data").mkdir()
    (tmp_path / "config.yaml").write_text(json.dumps({
        "model": {"builtin": "mlp"}, "input": {"paths": ["data/*.tfrecord.gz"], "key": "x", "sample_shape": [784]},
        "jacobian": {"batch_size": 8}, "output": {"path": "out", "samples_per_shard": 8}}))
    for rows in (12, 20):
        write_tfrecord(tmp_path / "data" / "a.tfrecord.gz", [example(x=x) for x in samples[:rows]])
        done = _jacobeam("run", "config.yaml", "-q", cwd=tmp_path)
        assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["num_samples"] == 20


@pytest.mark.slow
def test_ctrl_c_with_two_worker_processes_stops_them_all(job, tmp_path):
    root, done = job
    _interrupt(root, tmp_path / "out", TWO_PROCESSES, whole_group=True)
    _finish(root, tmp_path / "out", TWO_PROCESSES, _checksums(root / "out"))


# A factory that builds the model for the plan's check, then fails in the worker's setup(): its second
# call in a process (one process: the plan's, then setup's), or its first in a worker process.
_calls = 0


def failing_in_setup():
    global _calls
    from jacobeam.transforms.engine.models import build_mlp
    from jacobeam.transforms.errors import ModelError

    _calls += 1
    if _calls > 1 or "sdk_worker_main" in " ".join(sys.argv):
        raise ModelError("tests: this model cannot be built in a worker")
    return build_mlp()


def _failing_job(root: Path, tmp_path: Path) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "model": {"factory": "tests.test_terminal:failing_in_setup"},
        "input": {"paths": [str(root / "data" / "*.npy")]},
        "output": {"path": str(tmp_path / "out"), "samples_per_shard": 16},
    }))
    return config


def test_an_error_inside_the_pipeline_is_one_line(job, tmp_path, capsys):
    global _calls
    root, _ = job
    config = _failing_job(root, tmp_path)
    _calls = 0
    assert cli.main(["run", str(config)]) == cli.FAILED
    err = capsys.readouterr().err
    assert _foreign(err) == []
    assert err.splitlines()[-1] == "jacobeam: error: tests: this model cannot be built in a worker"

    _calls = 0
    assert cli.main(["-v", "run", str(config), "--set", f"output.path={tmp_path / 'again'}"]) == cli.FAILED
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err  # -v keeps it
    assert err.splitlines()[-1] == "jacobeam: error: tests: this model cannot be built in a worker"


@pytest.mark.slow
def test_an_error_in_a_worker_process_is_one_line(job, tmp_path):
    root, _ = job
    failed = _jacobeam("run", str(_failing_job(root, tmp_path)), *TWO_PROCESSES, cwd=root)
    assert failed.returncode == cli.FAILED
    assert _foreign(failed.stderr) == []
    assert failed.stderr.splitlines()[-1] == "jacobeam: error: tests: this model cannot be built in a worker"


def test_plot_without_matplotlib_says_what_to_install(job, monkeypatch, capsys):
    root, _ = job
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["inspect", str(root / "out"), "--plot", str(root / "plot.png")]) == 3
    assert capsys.readouterr().err == "jacobeam: --plot needs matplotlib: pip install 'jacobeam[plot]'\n"
    assert not (root / "plot.png").exists()
    assert "3    an optional package is missing" in cli._parser().format_help()


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "not a zip archive"),
    ("empty", "not a zip archive"),
    ("no config", "the zip archive holds no config.json"),
])
def test_a_corrupt_keras_file_is_not_reported_missing(job, tmp_path, capsys, damage, reason):
    import zipfile

    from jacobeam.transforms.engine.models import build_mlp

    root, _ = job
    model = tmp_path / "model.keras"
    if damage == "no config":
        with zipfile.ZipFile(model, "w") as archive:
            archive.writestr("model.weights.h5", b"")
    else:
        build_mlp().save(model)
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2] if damage == "truncate" else b"")
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "model": {"path": str(model)}, "input": {"paths": [str(root / "data" / "*.npy")]},
        "output": {"path": str(tmp_path / "out")},
    }))
    assert cli.main(["-q", "run", str(config)]) == cli.FAILED
    err = capsys.readouterr().err
    assert f"model.path {model}: the file exists but cannot be read as a Keras model: {reason}" in err
    assert "not found" not in err.lower()


def test_a_mistyped_beam_option_names_the_closest_one(job, tmp_path, capsys):
    root, _ = job
    out = tmp_path / "out"
    args = ["-q", "run", str(root / "config.yaml"), "--set", f"output.path={out}"]
    assert cli.main([*args, "--runnr", "DirectRunner"]) == cli.USAGE
    err = capsys.readouterr().err
    assert err.startswith("jacobeam: error: unknown option --runnr (did you mean --runner?)"), err
    assert not out.exists()  # before anything
    assert cli.main([*args, "--direct_num_worker", "2"]) == cli.USAGE
    assert "did you mean --direct_num_workers?" in capsys.readouterr().err


def test_unknown_beam_options_pass_after_double_dash_or_when_allowed(tmp_path, capsys):
    missing = str(tmp_path / "missing.yaml")  # the run stops at the config: the options were accepted
    for args in (["--", "--my_runner_option", "1"], ["--allow_unknown_beam_options", "--my_runner_option", "1"]):
        assert cli.main(["-q", "run", missing, *args]) == cli.USAGE
        err = capsys.readouterr().err
        assert "missing.yaml" in err and "--my_runner_option" not in err


def test_cli_main_in_a_process_logs_to_the_stderr_of_the_moment(tmp_path, monkeypatch):
    """``cli.main`` called in a process (a notebook, a test) sets the root logger up; a stream the caller
    later closes must not stay in it, or every later log line is a ``--- Logging error ---`` traceback."""
    import io
    import logging

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    assert cli.main(["run", str(tmp_path / "missing.yaml")]) == cli.USAGE
    first.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("jacobeam.test").info("after the caller closed its stream")
    assert later.getvalue().endswith("after the caller closed its stream\n"), later.getvalue()


def test_a_config_to_fix_exits_2_and_a_run_that_fails_exits_1(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    samples = np.zeros((4, 784), np.float32)
    samples[2, 5] = np.nan
    np.save(tmp_path / "data" / "a.npy", samples)
    raw = {
        "model": {"builtin": "mlp"},
        "input": {"paths": [str(tmp_path / "data" / "*.npy")], "on_bad_sample": "error"},
        "output": {"path": str(tmp_path / "out")},
    }
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({**raw, "jacobian": {"batchsize": 4}}))
    assert cli.main(["-q", "run", str(config)]) == cli.USAGE == 2
    assert "jacobian.batchsize: unknown key" in capsys.readouterr().err

    config.write_text(json.dumps(raw))  # a valid config: the bad sample is found reading the inputs
    assert cli.main(["-q", "run", str(config)]) == cli.FAILED == 1
    assert re.search(r"^jacobeam: error: .*a.npy: row 2: non-finite input: holds NaN", capsys.readouterr().err, re.M)
    assert not (tmp_path / "out").exists()


def test_known_beam_options_include_registered_options_classes():
    from apache_beam.options.pipeline_options import PipelineOptions

    class MyRunnerOptions(PipelineOptions):
        @classmethod
        def _add_argparse_args(cls, parser):
            parser.add_argument("--my_runner_endpoint")

    unknown, known = runner.unknown_options(["--my_runner_endpoint", "x", "--s3_region_name", "eu", "--runner", "X"])
    assert unknown == [] and "--my_runner_endpoint" in known and "--temp_location" in known
    assert runner.unknown_options(["--temp_locaton", "/tmp"])[0] == ["--temp_locaton", "/tmp"]


def test_a_missing_h5_dataset_lists_the_datasets(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as h5:
        h5["x"] = np.zeros((3, 2), np.float32)
        h5["group/y"] = np.zeros((3, 2), np.float32)
        h5.attrs["note"] = "not a dataset"
    with pytest.raises(InputError, match=r"a.h5: no dataset 'nope' \(input.key\); found \['group/y', 'x'\]$"):
        describe(str(tmp_path / "a.h5"), "nope")


def test_the_process_ends_as_python_would_without_tearing_down_modules():
    """``process_exit.end``: other threads finish, exit handlers run, buffered output and logging are
    flushed, and the status is the one given."""
    code = (
        "import atexit, logging, sys, threading, time\n"
        "from jacobeam.pipeline import process_exit\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(message)s')\n"
        "atexit.register(lambda: print('handler ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "print('buffered', end='')\n"
        "logging.info('logged')\n"
        "process_exit.end(3)\n"
        "print('never')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode == 3
    assert done.stdout == "bufferedthread done\nhandler ran\n"
    assert done.stderr.strip() == "logged"


@pytest.mark.parametrize("line, noise", [
    ("I0000 00:00:1764681000.123456  4242 port.cc:153] oneDNN custom operations are on.", True),
    ("W0000 00:00:1764681000.123456  4242 cpu_feature_guard.cc:210] This TensorFlow binary is optimized", True),
    ("E0000 00:00:1764681000.123456  4242 cuda_driver.cc:152] failed call to cuInit: INTERNAL: CUDA error", True),
    ("E0000 00:00:1764681000.123456  4242 op_kernel.cc:1839] OP_REQUIRES failed at conv_ops.cc:1: RESOURCE_EXHAUSTED",
     False),
    ("F0000 00:00:1764681000.123456  4242 logging.cc:43] Check failed: size >= 0", False),
    ("Traceback (most recent call last):", False),
])
def test_native_error_lines_reach_the_user_and_only_known_noise_is_dropped(line, noise):
    from jacobeam.pipeline.quiet import is_noise

    assert is_noise(line) is noise


def test_version_names_the_installed_package(capsys):
    from importlib import metadata

    from jacobeam.pipeline import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"jacobeam {metadata.version('jacobeam')}\n"
