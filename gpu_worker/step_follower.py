"""The manager's step deltas, received in the background and handed out in order, from the primary
of the manager's high-availability group when it has one."""

from __future__ import annotations

import collections
import logging
import threading
import time

import grpc

from kv_manager_service.client import KVManagerClient
from kv_manager_service.shared.ready_line import FIRST_STEP_ID_HEADER
from kvcache.v1 import kv_manager_pb2 as pb

log = logging.getLogger("gpu_worker.step_follower")


class FollowerError(RuntimeError):
    """The deltas can no longer be followed (the manager dropped steps this worker never saw)."""


class StepFollower:
    """Follows `WatchSteps` from `first_step_id` on, reconnecting where it left off.

    Deltas are kept until taken; `take_through(n)` waits until every step up
    to n has arrived. Invariant: the deltas held are consecutive, starting at
    the first step not yet taken. Every WatchSteps, reconnections included,
    carries `worker_id` and `incarnation`: the manager tells a worker process
    that restarted (empty memory) from one that reconnected (see
    WatchStepsRequest).

    A stream that a standby refuses (NOT_PRIMARY) or that breaks UNAVAILABLE
    moves the client to the primary named or the next address
    (`KVManagerClient.fail_over`). Once the stream is to another manager,
    the deltas not yet taken are dropped and asked again from it, from the
    first step not yet taken: every delta taken comes from the manager
    followed at the time.
    """

    def __init__(self, client: KVManagerClient, worker_id: str, first_step_id: int, incarnation: int = 0) -> None:
        """`incarnation`: nonzero and new at every start of the worker process; 0 says nothing."""
        self.client = client
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.next_step_id = first_step_id  # the next delta to receive
        self.deltas: collections.deque[pb.StepDelta] = collections.deque()
        self.error: FollowerError | None = None
        self.changed = threading.Condition()
        self.closed = False
        self.stream: grpc.Future | None = None
        self.registered = False  # the manager accepted a WatchSteps of this follower (its initial metadata came)
        self.thread = threading.Thread(target=self._run, name="step-follower", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Stop following; the manager keeps this worker registered until its lease runs out."""
        with self.changed:
            self.closed = True
            stream = self.stream
            self.changed.notify_all()
        if stream is not None:
            stream.cancel()
        self.thread.join(timeout=5)

    def leave(self) -> None:
        """Stop following and unregister from the manager (a clean shutdown): the copies only
        this worker held are released at once. If the manager cannot be told, its lease runs out."""
        self.close()
        try:
            self.client.unregister_worker(self.worker_id)
        except Exception as error:  # the manager is down, or already dropped this worker
            log.warning("could not unregister worker %s (%s); its lease will expire", self.worker_id, error)
        else:
            log.info("unregistered worker %s from the manager", self.worker_id)

    def wait_registered(self, timeout_s: float) -> None:
        """Wait until the manager has registered this worker (the first WatchSteps' initial metadata).

        Raises FollowerError when the manager refused the stream for good, and TimeoutError after
        `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not self.registered:
                if self.error is not None:
                    raise self.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"the manager at {' or '.join(self.client.addresses)} did not register worker "
                        f"{self.worker_id!r} within {timeout_s:g}s"
                    )
                self.changed.wait(remaining)

    @property
    def last_received_step_id(self) -> int:
        with self.changed:
            return self.next_step_id - 1

    def take_through(self, step_id: int, timeout_s: float) -> list[pb.StepDelta]:
        """Every delta not yet taken up to `step_id`, oldest first; waits up to `timeout_s` for them.

        Raises TimeoutError when step `step_id` has not arrived in time, and
        FollowerError when it never will.
        """
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while self.next_step_id <= step_id:
                if self.error is not None:
                    raise self.error
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    raise TimeoutError(
                        f"step {step_id} has not arrived from the manager within {timeout_s:g}s "
                        f"(last received: {self.next_step_id - 1})"
                    )
                self.changed.wait(remaining)
            taken = []
            while self.deltas and self.deltas[0].step_id <= step_id:
                taken.append(self.deltas.popleft())
            return taken

    def _run(self) -> None:
        backoff_s = 0.05
        registered_at: str | None = None  # the manager the last stream registered with
        while True:
            with self.changed:
                if self.closed:
                    return
                address = self.client.address
                if registered_at is not None and address != registered_at:
                    self._drop_untaken()
                self.stream = stream = self.client.watch_steps(self.worker_id, self.next_step_id, self.incarnation)
            try:
                metadata = stream.initial_metadata()  # waits for the headers, sent once the worker is registered
                if any(key == FIRST_STEP_ID_HEADER for key, _ in metadata or ()):
                    if registered_at != address:
                        log.info("worker %s registered with the manager at %s", self.worker_id, address)
                    registered_at, backoff_s = address, 0.05
                    with self.changed:
                        self.registered = True
                        self.changed.notify_all()
                for delta in stream:
                    with self.changed:
                        assert delta.step_id == self.next_step_id, (delta.step_id, self.next_step_id)
                        self.deltas.append(delta)
                        self.next_step_id += 1
                        self.changed.notify_all()
            except grpc.RpcError as error:
                if error.code() is grpc.StatusCode.OUT_OF_RANGE:
                    with self.changed:
                        self.error = FollowerError(f"the manager no longer has step {self.next_step_id}: {error.details()}")
                        self.changed.notify_all()
                    log.error("%s", self.error)
                    return
                not_primary = self.client.fail_over(address, error)
                if error.code() is not grpc.StatusCode.CANCELLED:
                    why = "refused: not the primary" if not_primary else f"broke ({error.code().name})"
                    log.warning("step stream from %s %s; reconnecting to %s", address, why, self.client.address)
            with self.changed:
                if self.closed:
                    return
                self.changed.wait(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    def _drop_untaken(self) -> None:
        """Forget the deltas not yet taken: the next stream asks for them again. The caller holds `changed`."""
        self.next_step_id -= len(self.deltas)
        self.deltas.clear()
