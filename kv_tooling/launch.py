"""Start a server as a child process and wait until it serves; stop it with SIGTERM, or kill it.

Used by everything that runs servers as local processes: the demo, the
benchmarks and the tests. Our servers announce themselves with a ready line
on stdout (`launch`, `launch_many`); a server that prints no line of ours,
such as `redis-server`, is ready once a probe says so (`launch_until_ready`,
`launch_redis`).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

from kv_manager_service.shared.ready_line import NotReadyError, wait_for_ready_line

if TYPE_CHECKING:
    import redis

PROBE_INTERVAL_S = 0.02
LOG_TAIL_CHARS = 4000
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Interrupted(Exception):
    """A stop signal arrived (`stopped_on_signals`): the `with` body ends, so its `finally` blocks run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stopped_on_signals() -> Iterator[None]:
    """Within it, SIGTERM, SIGHUP and SIGINT raise Interrupted (in the main thread), so a program that
    started children stops them in its `finally` blocks instead of leaving them to run on. The first
    signal ignores the later ones, so the stopping is not cut short; the handlers are restored after."""

    def interrupt(signum: int, frame: object) -> None:
        for other in STOP_SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        if _spawn_guard.spawning:
            _spawn_guard.held = signum  # `_spawn` raises it once the child is known
            return
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class LaunchedProcess:
    """One running server subprocess, its address, and its log file.

    `returncode` is set once the process has been stopped or killed through
    this object; `killed` says it was killed on purpose (`kill`), so that a
    check of its exit code can tell a crash the caller caused from a failed
    shutdown.
    """

    def __init__(self, process: subprocess.Popen, address: str, log_path: Path, args: list[str]) -> None:
        self.process = process
        self.address = address
        self.log_path = log_path
        self.args = args
        self.returncode: int | None = None
        self.killed = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 8.0) -> int:
        """SIGTERM, then wait for the exit code; SIGKILL (code -9) if it takes longer than `timeout_s`.

        Once stopped or killed, returns the code it had then.
        """
        if self.returncode is not None:
            return self.returncode
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(self.process)
            self.returncode = -signal.SIGKILL
        finally:
            _close_stdout(self.process)
        return self.returncode

    def kill(self) -> int:
        """SIGKILL now, as a crash would (no graceful shutdown); marks the process `killed`."""
        self.killed = True
        if self.returncode is None:
            _kill(self.process)
            self.returncode = self.process.returncode
            _close_stdout(self.process)
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
    return launch_many([argv], ready_prefix, [log_path], cwd, env, timeout_s)[0]


def launch_many(
    argvs: Sequence[Sequence[str]],
    ready_prefix: str,
    log_paths: Sequence[Path],
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> list[LaunchedProcess]:
    """Start every command at once (their start-up work overlaps), then wait for each one's ready line, in order.

    `log_paths[i]` receives the stderr of `argvs[i]`. Raises NotReadyError,
    with the failing one's log tail, when one exits or stays silent past
    `timeout_s`; every process of the call is killed then.
    """
    assert len(argvs) == len(log_paths), "one log path per command"
    commands = [(list(argv), log_path) for argv, log_path in zip(argvs, log_paths)]
    processes: list[subprocess.Popen] = []
    try:
        for argv, log_path in commands:
            processes.append(_spawn(argv, log_path, cwd, env, stdout=subprocess.PIPE))
        launched = []
        for process, (argv, log_path) in zip(processes, commands):
            try:
                address = wait_for_ready_line(process, ready_prefix, timeout_s)
            except NotReadyError as error:
                raise NotReadyError(_with_log_tail(argv, error, log_path)) from None
            launched.append(LaunchedProcess(process, address, log_path, argv))
        return launched
    except BaseException:
        for process in processes:
            _kill(process)
            _close_stdout(process)
        raise


def launch_until_ready(
    argv: Sequence[str],
    is_ready: Callable[[], bool],
    address: str,
    log_path: Path,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
) -> LaunchedProcess:
    """Start `argv` (stdout and stderr to `log_path`) and call `is_ready()` until it is true.

    For a server that prints no ready line of ours: `address` is where it
    listens, `is_ready` must return False (not raise) while it does not serve
    yet. Raises NotReadyError, with the log's tail, when the process exits or
    is not ready past `timeout_s`; the process is killed then.
    """
    argv = list(argv)
    process = _spawn(argv, log_path, cwd, env, stdout=None)
    deadline = time.monotonic() + timeout_s
    try:
        while not is_ready():
            if process.poll() is not None:
                raise NotReadyError(f"exited with code {process.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise NotReadyError(f"not ready within {timeout_s:g}s")
            time.sleep(PROBE_INTERVAL_S)
    except BaseException as error:
        _kill(process)
        if isinstance(error, NotReadyError):
            raise NotReadyError(_with_log_tail(argv, error, log_path)) from None
        raise
    return LaunchedProcess(process, address, log_path, argv)


def launch_redis(
    port: int,
    log_path: Path,
    extra_args: Sequence[str] = (),
    *,
    tls: bool = False,
    ping_client: redis.Redis | None = None,
    binary: str = "redis-server",
    timeout_s: float = 10.0,
) -> LaunchedProcess:
    """`redis-server` on 127.0.0.1:`port` without persistence, ready once it answers PING.

    Nothing is saved, so a SIGKILL loses every key, as a crashed cache would.
    With `tls`, `port` is the TLS port and the plain one is off: `extra_args`
    then hold the certificate flags. `extra_args` come last (AUTH, TLS,
    cluster mode...). `ping_client` is the connection that must get the
    answer (give one for AUTH or TLS; it is left open); by default a plain
    connection to `port`. Working files go beside `log_path`. Raises
    NotReadyError like `launch_until_ready`.
    """
    import redis  # the optional `redis` extra: only a Redis launch needs it

    ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
    argv = [binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(log_path.parent), *extra_args]  # fmt: skip
    client = ping_client or redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0, socket_connect_timeout=5.0)

    def answers_ping() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        return launch_until_ready(argv, answers_ping, f"127.0.0.1:{port}", log_path, timeout_s=timeout_s)
    finally:
        if ping_client is None:
            client.close()


CLUSTER_BUS_OFFSET = 10_000  # a cluster node also listens on its port + 10000 (the cluster bus)


def launch_redis_cluster(
    ports: Sequence[int],
    log_dir: Path,
    *,
    replicas_per_master: int = 0,
    node_timeout_ms: int = 1000,
    extra_args: Sequence[str] = (),
    timeout_s: float = 30.0,
) -> list[LaunchedProcess]:
    """A Redis Cluster of `len(ports)` nodes on 127.0.0.1, `replicas_per_master` replicas per master.

    Each node is `launch_redis` with cluster mode on, in its own folder under
    `log_dir`; `redis-cli --cluster create` then spreads the 16384 slots over
    the masters. Returns once every node reports `cluster_state:ok`, nodes in
    `ports` order (`redis-cli` makes the first ones masters). Ports must be
    below 55536, their bus ports free too (`free_cluster_port`). Every node
    is killed when the cluster does not come up; raises NotReadyError then.
    """
    import redis

    if len(ports) < 3 * (1 + replicas_per_master):
        raise ValueError(f"a cluster needs at least 3 masters: {len(ports)} ports for {replicas_per_master} replicas each")
    too_high = [port for port in ports if port + CLUSTER_BUS_OFFSET > 65535]
    if too_high:
        raise ValueError(f"ports {too_high} leave no cluster bus port (port + {CLUSTER_BUS_OFFSET}): use ports below 55536")
    nodes: list[LaunchedProcess] = []
    try:
        for port in ports:
            node_dir = log_dir / f"redis-cluster-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms), *extra_args]  # fmt: skip
            nodes.append(launch_redis(port, node_dir / "redis.log", args, timeout_s=timeout_s))
        create = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
             "--cluster-replicas", str(replicas_per_master), "--cluster-yes"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if create.returncode != 0:
            raise NotReadyError(f"redis-cli --cluster create failed ({create.returncode}):\n{create.stdout}{create.stderr}")
        deadline = time.monotonic() + timeout_s
        for port in ports:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0, decode_responses=True)
            try:
                while client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise NotReadyError(f"the cluster node on port {port} is not ok within {timeout_s:g}s")
                    time.sleep(PROBE_INTERVAL_S * 5)
            finally:
                client.close()
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


def free_cluster_port() -> int:
    """A free loopback port below 55536 whose cluster bus port (+10000) is free too."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + CLUSTER_BUS_OFFSET > 65535:
            port -= 20_000  # the kernel's ephemeral range starts at 32768: this lands in 12768..35535
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
        except OSError:
            continue
        return port


def free_port() -> int:
    """A TCP port free on the loopback now (for a server that must keep its port across restarts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _SpawnGuard:
    """A stop signal that arrives while the main thread is inside `subprocess.Popen` is held here.

    Raised there, after the fork but before Popen returns, Interrupted would
    leave a running child that no caller knows of, so nobody stops it.
    """

    spawning = False
    held: int | None = None


_spawn_guard = _SpawnGuard()


def _spawn(
    argv: list[str], log_path: Path, cwd: Path | None, env: Mapping[str, str] | None, stdout: int | None
) -> subprocess.Popen:
    """`argv` with stderr to `log_path`; stdout to `stdout` (a pipe), or to the log as well when None.

    A stop signal held during the spawn (`_SpawnGuard`) kills the new child and raises Interrupted.
    """
    guarded = threading.current_thread() is threading.main_thread()  # signal handlers run there only
    if guarded:
        _spawn_guard.spawning = True
    process = None
    try:
        with open(log_path, "wb") as log_file:
            out: int | IO[bytes] = log_file if stdout is None else stdout
            process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=log_file)
    finally:
        if guarded:
            _spawn_guard.spawning = False
            held, _spawn_guard.held = _spawn_guard.held, None
            if held is not None:
                if process is not None:
                    _kill(process)
                    _close_stdout(process)
                raise Interrupted(held)  # the stop wins over whatever Popen raised
    return process


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def _close_stdout(process: subprocess.Popen) -> None:
    if process.stdout is not None:
        process.stdout.close()


def _with_log_tail(argv: list[str], error: NotReadyError, log_path: Path) -> str:
    tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return f"{' '.join(argv)}: {error}\n{tail}"
