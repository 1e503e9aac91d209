"""Beam services that tests start on loopback: a worker pool, a standalone job service."""

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
def beam_service(module: str, port_flag: str, env: dict[str, str] | None = None, wait: float = 60) -> Iterator[int]:
    """Run ``python -m module port_flag=PORT`` in its own process group until the block ends; yields
    PORT once the service accepts connections."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", module, f"{port_flag}={port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"{module} did not listen on port {port} within {wait} s")
        yield port
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
