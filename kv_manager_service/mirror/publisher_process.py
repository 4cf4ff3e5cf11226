"""The mirror's publisher in a process of its own, off the server's GIL.

Why. The publisher's per-key work (counting, building keys, packing
commands, parsing replies) is pure Python. In a thread of the server it
holds the GIL that the RPCs need: a Step that caches thousands of blocks
delays the Steps after it, and the mirror lags behind that Step by the
time the writer waits for the GIL. In a process of its own it runs on
another core, and the writer's thread waits for it without the GIL: for a
batch of 8,704 new hashes the server's GIL is held ~2 ms instead of ~20
(bench/mirror_publisher_bench.py). The batch costs more in all (its events
are pickled, sent and unpickled), so this is for a host with a core to
spare: `--redis-writer process`, not the default. On two cores shared with
Redis and the clients it did not pay (BENCHMARKS.md).

How. `PublisherProcess` starts `python -m
kv_manager_service.mirror.publisher_process FD`, where FD is one end of a
socket pair. The first message carries the Redis endpoint and the replica
(so a password never appears on a command line); then every call is one
request and one reply, with EntryPublisher's semantics: a failed write
raises redis.RedisError in the caller, and the next call must be a
republication.

A child that dies (killed, out of memory) fails the call in progress, or
the next one, as a redis.ConnectionError: the writer resyncs, and the
republication starts a new child. A child that does not answer a call
within `call_timeout_s` (stopped, or stuck) is killed and fails the call as
a redis.TimeoutError, with the same recovery: a stalled child never holds
the writer, so the backlog it leaves shows in the mirror's queue depth and
lag, and a new child takes over. That child does not know what the dead
one published, so its first republication sweeps: every entry of this
replica in Redis that the pool does not hold is deleted. A child whose
server dies reads the end of its socket and exits.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, Mapping, Sequence

import redis

from kv_manager_service.core.host_index import HostKeys
from kv_manager_service.shared.events import KVEvent
from kv_manager_service.mirror.connect import RedisEndpoint, connect
from kv_manager_service.mirror.publisher import EntryPublisher
from kv_manager_service.mirror.schema import BlockKey
from kv_manager_service.mirror.schema import KeySchema

CALLS = ("republish", "apply")
"""The EntryPublisher methods a parent may call in the child."""
DEFAULT_CALL_TIMEOUT_S = 30.0
"""How long a call may take before the child counts as stalled (--redis-writer-timeout-s)."""


class PublisherProcess:
    """An EntryPublisher in a child process: `republish` and `apply` as EntryPublisher's, called from one thread.

    The child starts at the first republication (the writer's first call).
    """

    def __init__(
        self, endpoint: RedisEndpoint, schema: KeySchema, replica_id: str, incarnation: str,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:  # fmt: skip
        if not call_timeout_s > 0:
            raise ValueError(f"the writer process's call timeout must be > 0 s, got {call_timeout_s}")
        self._setup = (endpoint, schema, replica_id, incarnation)
        self.call_timeout_s = call_timeout_s
        self._child: subprocess.Popen | None = None
        self._connection: Connection | None = None
        # Invariant: True from a child's death until a later child's republication succeeds.
        self._needs_sweep = False
        self.num_starts = 0  # children started

    @property
    def pid(self) -> int | None:
        """The running child's process id; None before the first republication or after its death."""
        return None if self._child is None else self._child.pid

    def republish(
        self, counts: Mapping[BlockKey, int], host_keys: HostKeys | None, sweep: bool = False
    ) -> tuple[int, int]:
        if self._connection is None:
            self._start()
        result = self._call("republish", counts, host_keys, sweep or self._needs_sweep)
        self._needs_sweep = False
        return result

    def apply(self, events: Sequence[KVEvent]) -> None:
        if self._connection is None:
            raise redis.ConnectionError("the mirror's writer process is not running; a republication starts one")
        self._call("apply", events)

    def close(self) -> None:
        """Stop the child: it loses nothing the writer relies on (the lease is dropped next)."""
        child, connection = self._child, self._connection
        self._child = self._connection = None
        if child is not None:
            child.terminate()  # a call in progress in another thread reads the end of the socket
            try:
                child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if connection is not None:
            connection.close()

    def _start(self) -> None:
        parent_end, child_end = socket.socketpair()
        with parent_end, child_end:
            try:
                self._child = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(child_end.fileno())], pass_fds=[child_end.fileno()]
                )
            except OSError as error:  # out of processes or memory: retried as any failed write is
                raise redis.ConnectionError(f"cannot start the mirror's writer process: {error}") from error
            self._connection = Connection(parent_end.detach())
        self.num_starts += 1
        self._connection.send(self._setup)

    def _call(self, name: str, *args: Any) -> Any:
        connection = self._connection  # close() may clear it meanwhile, from the thread that stops the writer
        if connection is None:
            raise redis.ConnectionError("the mirror's writer process was stopped")
        try:
            connection.send((name, args))
            if not connection.poll(self.call_timeout_s):
                self._stalled(name)
            status, value = connection.recv()
        except (EOFError, OSError) as error:
            self._lost(error)
        if status == "ok":
            return value
        if status == "redis":
            raise redis.RedisError(value)
        raise RuntimeError(f"the mirror's writer process failed in {name}:\n{value}")

    def _stalled(self, name: str) -> None:
        """The child did not answer `name` in time: kill it (a stopped process too), and fail the call."""
        child = self._child
        if child is not None:
            child.kill()
        self.close()
        self._needs_sweep = True
        raise redis.TimeoutError(
            f"the mirror's writer process (pid {child.pid if child else '?'}) did not answer {name} within "
            f"{self.call_timeout_s:g}s: killed; the next republication starts another"
        )

    def _lost(self, error: BaseException) -> None:
        child = self._child
        self.close()
        self._needs_sweep = True
        code = child.poll() if child is not None else None
        raise redis.ConnectionError(f"the mirror's writer process exited (code {code}): {error!r}") from error


def _serve(connection: Connection) -> None:
    """The child: build the publisher from the first message, then answer calls until the parent goes."""
    endpoint, schema, replica_id, incarnation = connection.recv()
    publisher = EntryPublisher(connect(endpoint), schema, replica_id, incarnation)
    while True:
        try:
            name, args = connection.recv()
        except EOFError:
            return
        try:
            if name not in CALLS:
                raise ValueError(f"unknown call {name!r}; the calls are {', '.join(CALLS)}")
            reply = ("ok", getattr(publisher, name)(*args))
        except redis.RedisError as error:
            reply = ("redis", f"{type(error).__name__}: {error}")
        except Exception:
            reply = ("bug", traceback.format_exc())
        connection.send(reply)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which stops this child
    try:
        _serve(Connection(int(sys.argv[1])))
    except (EOFError, OSError):
        pass  # the server went away
