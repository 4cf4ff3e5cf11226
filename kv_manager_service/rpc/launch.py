"""Start a server as a child process and wait for its ready line; stop it with SIGTERM.

Used by everything that runs the services as local processes: the demo, the
benchmarks and the tests.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from kv_manager_service.rpc.ready_line import NotReadyError, wait_for_ready_line


class LaunchedProcess:
    """One running server subprocess, its address, and its log file (stderr)."""

    def __init__(self, process: subprocess.Popen, address: str, log_path: Path, args: list[str]) -> None:
        self.process = process
        self.address = address
        self.log_path = log_path
        self.args = args
        self.returncode: int | None = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 8.0) -> int:
        """SIGTERM, then wait for the exit code; SIGKILL (code -9) if it takes longer than `timeout_s`."""
        if self.returncode is not None:
            return self.returncode
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            self.returncode = -9
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()
        return self.returncode


def launch(
    argv: Sequence[str],
    ready_prefix: str,
    log_path: Path,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> LaunchedProcess:
    """Start `argv` (stderr to `log_path`) and wait for its ready line.

    Raises NotReadyError, with the log's tail, when the process exits or stays
    silent past `timeout_s`; the process is killed then.
    """
    argv = list(argv)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, env=env)
    try:
        address = wait_for_ready_line(process, ready_prefix, timeout_s)
    except BaseException as error:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        process.stdout.close()
        if isinstance(error, NotReadyError):
            tail = log_path.read_text(errors="replace")[-4000:]
            raise NotReadyError(f"{' '.join(argv)}: {error}\n{tail}") from None
        raise
    return LaunchedProcess(process, address, log_path, argv)
