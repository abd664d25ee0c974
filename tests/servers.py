"""``attnkit serve`` started as the real command, on 127.0.0.1 and a free port, for the tests
that call it with clients nobody here wrote."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(
    log: Path,
    *options: str,
    model: str = "smollm2",
    headers: dict | None = None,
    env: dict | None = None,
):
    """Run ``attnkit serve MODEL *options`` until the block ends, with ``env`` added to the
    environment; yields its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "attnkit.cli", "serve", model, "--port", str(port), *options]
    with log.open("w") as out:
        # Ctrl-C as a terminal delivers it, even when pytest itself was started in the
        # background (a shell's background job passes SIGINT on as ignored)
        process = subprocess.Popen(
            command,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", headers=headers).status_code == 200:
                break
        except httpx.TransportError:
            assert process.poll() is None, log.read_text()
            time.sleep(0.2)
    else:
        process.kill()
        raise TimeoutError(f"attnkit serve did not answer: {log.read_text()}")
    try:
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
