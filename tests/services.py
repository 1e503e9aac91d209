"""Services that tests start on loopback: a Beam worker pool or job service, a local S3 server."""

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


@contextlib.contextmanager
def _service(argv: list[str], port: int, name: str, env: dict[str, str] | None = None, wait: float = 60) -> Iterator[int]:
    """Run ``argv`` in its own process group until the block ends; yields ``port`` once the process
    accepts connections there. The whole group is killed at the end."""
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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
