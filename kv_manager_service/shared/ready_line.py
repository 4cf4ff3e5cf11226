"""The one line a server prints on stdout when it accepts calls, and how a launcher waits for it.

`kv-manager serve` prints `KV manager listening on HOST:PORT`, `gpu-worker`
prints `GPU worker listening on HOST:PORT`. Whatever starts
it as a process (a test, a benchmark, a demo, an orchestrator) reads that
line to learn the address, instead of polling the port. A worker prints its
line only once the manager has registered it: the manager sends a
WatchSteps stream's initial metadata, `FIRST_STEP_ID_HEADER`, as soon as it
has registered the worker, before any step.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

MANAGER_READY_PREFIX = "KV manager listening on "
WORKER_READY_PREFIX = "GPU worker listening on "
FIRST_STEP_ID_HEADER = "kvcache-first-step-id"  # WatchSteps' initial metadata: the first step it will send


class NotReadyError(RuntimeError):
    """The process exited, or stayed silent past the timeout, before its ready line."""


def wait_for_ready_line(process: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    """The address from `process`'s first stdout line, which must start with `prefix`.

    `process.stdout` must be a pipe nothing has read from yet. Leaves the
    process running in every case: the caller decides whether to stop it.
    """
    deadline = time.monotonic() + timeout_s
    fd = process.stdout.fileno()
    buffer = b""
    while b"\n" not in buffer:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NotReadyError(f"no ready line within {timeout_s:g}s")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # EOF: the process died before it was ready
            raise NotReadyError(f"exited with code {process.wait(timeout=10)} before it was ready")
        buffer += chunk
    line = buffer.split(b"\n", 1)[0].decode(errors="replace")
    if not line.startswith(prefix):
        raise NotReadyError(f"unexpected first line {line!r}, expected {prefix!r}...")
    return line[len(prefix) :].strip()
