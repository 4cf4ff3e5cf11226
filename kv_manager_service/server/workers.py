"""The registered workers: what each has acknowledged, and its lease.

A worker registers by opening a WatchSteps stream, and stays registered
while it streams or acknowledges: a worker with an open stream is never
expired; one without for `timeout_s` since it was last heard from (a stream
opened or closed, an acknowledgement, a registration restored from the
journal) is expired. Copies are held until every registered worker has
acknowledged their step, so the registry's `min_acked_step_id` is what the
replica may release.

Pure logic: no lock, no clock. The caller (the replica) holds its lock to
change it and passes monotonic time in seconds; `statuses` may be read
without the lock (it copies the table first).
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_manager_service.shared.ops import KVLossCause
from kv_manager_service.shared.errors import FailedPreconditionError


@dataclass
class _Worker:
    acked_step_id: int
    last_heard_s: float  # monotonic
    num_streams: int = 0  # open WatchSteps streams
    incarnation: int = 0  # new at every start of the worker process; 0: it did not say


@dataclass(frozen=True)
class WorkerLease:
    """One registered worker as GetStats and the metrics show it."""

    worker_id: str
    acked_step_id: int
    num_streams: int
    idle_s: float  # since last heard from; 0 while it streams


class WorkerRegistry:
    """Registered workers by id (see the module docstring). Invariant: `num_streams >= 0`."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"worker timeout must be > 0 s, got {timeout_s}")
        self.timeout_s = timeout_s
        self._workers: dict[str, _Worker] = {}

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def register(self, worker_id: str, acked_step_id: int, now_s: float, incarnation: int = 0) -> bool:
        """Register `worker_id` as having done every step up to `acked_step_id`.

        Returns True when it is new; registering again changes nothing but its
        lease, and its incarnation when `incarnation` is nonzero.
        """
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.last_heard_s = now_s
            if incarnation:
                worker.incarnation = incarnation
            return False
        self._workers[worker_id] = _Worker(acked_step_id, now_s, incarnation=incarnation)
        return True

    def memory_loss(self, worker_id: str, incarnation: int) -> KVLossCause | None:
        """Why a worker registering as (`worker_id`, `incarnation`) has empty memory, or None when it is
        the registered process itself coming back (a stream that reconnects).

        A worker id not registered is a new worker (WORKER_JOINED: its memory
        was never filled, or nothing proves it still holds what it held before
        it was dropped); a registered one with another nonzero incarnation has
        restarted (WORKER_RESTARTED). Incarnation 0 proves nothing for a new id
        and is taken as the same process for a registered one.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return KVLossCause.WORKER_JOINED
        if incarnation and incarnation != worker.incarnation:
            return KVLossCause.WORKER_RESTARTED
        return None

    def incarnation(self, worker_id: str) -> int:
        """The registered incarnation of `worker_id`; FailedPreconditionError naming worker_id when not registered."""
        return self._get(worker_id).incarnation

    def open_stream(self, worker_id: str, now_s: float) -> None:
        """A stream of a registered worker opened: it cannot expire until every stream it has closes."""
        worker = self._get(worker_id)
        worker.num_streams += 1
        worker.last_heard_s = now_s

    def close_stream(self, worker_id: str, now_s: float) -> None:
        """A stream closed; its lease runs from now. A worker dropped meanwhile is ignored."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        assert worker.num_streams > 0, worker_id
        worker.num_streams -= 1
        worker.last_heard_s = now_s

    def ack(self, worker_id: str, step_id: int, now_s: float) -> None:
        """`worker_id` did every step up to `step_id` (an older step changes nothing but its lease).

        FailedPreconditionError naming worker_id when it is not registered.
        """
        worker = self._get(worker_id)
        worker.acked_step_id = max(worker.acked_step_id, step_id)
        worker.last_heard_s = now_s

    def remove(self, worker_id: str) -> None:
        """Drop `worker_id`; FailedPreconditionError naming worker_id when it is not registered."""
        self._get(worker_id)
        del self._workers[worker_id]

    def expired(self, now_s: float) -> list[str]:
        """The workers without an open stream not heard from for `timeout_s` (not removed here)."""
        deadline = now_s - self.timeout_s
        return [w_id for w_id, w in self._workers.items() if w.num_streams == 0 and w.last_heard_s <= deadline]

    def renew_all(self, now_s: float) -> None:
        """Every worker's lease runs from now (after a restart: its workers had no chance to call)."""
        for worker in self._workers.values():
            worker.last_heard_s = now_s

    def min_acked_step_id(self) -> int | None:
        """The last step every registered worker has done; None when no worker is registered."""
        return min((w.acked_step_id for w in self._workers.values()), default=None)

    def acked_step_ids(self) -> dict[str, int]:
        """Each registered worker's acknowledged step."""
        return {worker_id: w.acked_step_id for worker_id, w in self._workers.items()}

    def acks_and_incarnations(self) -> dict[str, tuple[int, int]]:
        """Each registered worker's acknowledged step and incarnation, in registration order (for a snapshot)."""
        return {worker_id: (w.acked_step_id, w.incarnation) for worker_id, w in self._workers.items()}

    def statuses(self, now_s: float) -> list[WorkerLease]:
        """Every registered worker, by id."""
        return [
            WorkerLease(
                worker_id, w.acked_step_id, w.num_streams, 0.0 if w.num_streams else max(0.0, now_s - w.last_heard_s)
            )
            for worker_id, w in sorted(list(self._workers.items()))  # list(): one step, under the GIL
        ]

    def _get(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise FailedPreconditionError(
                f"worker_id {worker_id[:128]!r} is not registered: register with WatchSteps first", "worker_id"
            )
        return worker
