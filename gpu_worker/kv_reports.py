"""Reports of missing KV to the manager (ReportMissingKV): sent at once, and again until it answers."""

from __future__ import annotations

import collections
import logging
import threading
from typing import TYPE_CHECKING

import grpc

from kv_manager_service.client import KVManagerClient
from kv_manager_service.shared.errors import KVCacheError
from kv_manager_service.shared.logs import MAX_LOGGED_IDS
from kv_manager_service.shared.status import status_code
from kvcache.v1 import kv_manager_pb2 as manager_pb

if TYPE_CHECKING:
    from gpu_worker.service import WorkerMetrics

log = logging.getLogger("gpu_worker.kv_reports")

# A report that failed with one of these did not reach the manager, or the manager could not take it yet: retried.
_NO_ANSWER_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
)  # fmt: skip
MAX_PENDING_REPORTS = 1024


class MissingKVReporter:
    """Sends ReportMissingKV: at once, and again in the background until the manager answers.

    `report` tries once, bounded by the client's timeout (and its retries on
    UNAVAILABLE), so an Execute never waits on the manager for long. A report
    the manager did not answer (no connection, a deadline, a manager that is
    stopping) waits in an outbox, retried oldest first by a background thread
    with a backoff doubling up to `max_backoff_s`; past `max_pending` the
    oldest is dropped, with a WARNING. A report the manager answered with
    an error is dropped, with a WARNING: sending it again would not change
    the answer. Losing a report hides nothing for long: the guard finds the
    unfilled blocks again at the next read, and that read is reported.
    """

    def __init__(
        self,
        manager: KVManagerClient,
        metrics: WorkerMetrics | None = None,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_pending: int = MAX_PENDING_REPORTS,
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.max_pending = max_pending
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.pending: collections.deque[manager_pb.ReportMissingKVRequest] = collections.deque()
        self.changed = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None

    def report(self, request: manager_pb.ReportMissingKVRequest) -> bool:
        """Send `request` now; True when the manager took it. A report it did not answer is kept and retried."""
        answer = self._send(request)
        if answer is not None:
            return answer
        with self.changed:
            if len(self.pending) >= self.max_pending:
                dropped = self.pending.popleft()
                log.warning(
                    "dropping the oldest undelivered ReportMissingKV (step %d, %d requests): %d are waiting",
                    dropped.step_id, len(dropped.request_ids), self.max_pending,
                )  # fmt: skip
            idle = not self.pending
            self.pending.append(request)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="missing-kv-reports", daemon=True)
                self.thread.start()
            if idle:  # a thread backing off keeps its pace: this report just failed too
                self.changed.notify_all()
        return False

    @property
    def num_pending(self) -> int:
        with self.changed:
            return len(self.pending)

    def close(self) -> None:
        """Stop retrying; the reports still waiting are dropped (the guard finds their blocks again)."""
        with self.changed:
            self.closed = True
            thread = self.thread
            self.changed.notify_all()
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        backoff_s = self.first_backoff_s
        while True:
            with self.changed:
                while not self.pending and not self.closed:
                    self.changed.wait()
                if self.closed:
                    return
                request = self.pending[0]
            answered = self._send(request, retrying=True) is not None
            with self.changed:
                if answered:
                    if self.pending and self.pending[0] is request:
                        self.pending.popleft()
                    backoff_s = self.first_backoff_s
                    continue
                if self.closed:  # closed while this report was on its way: `close` notified no one
                    return
                self.changed.wait(backoff_s)
            backoff_s = min(2 * backoff_s, self.max_backoff_s)

    def _send(self, request: manager_pb.ReportMissingKVRequest, retrying: bool = False) -> bool | None:
        """True: the manager took it; False: it answered with an error (the report is dropped); None: no answer."""
        cause = manager_pb.KVLossCause.Name(request.cause)
        try:
            response = self.manager.report_missing_kv(request)
        except (KVCacheError, grpc.RpcError, ValueError) as error:
            if self.metrics is not None:
                self.metrics.kv_reports_failed.inc()
            code = _code_of(error)
            answered = code is not None and code not in _NO_ANSWER_CODES
            details = error.details() if isinstance(error, grpc.RpcError) else str(error)
            log.warning(
                "ReportMissingKV (%s, step %d, requests %s) failed%s: %s: %s (%s)", cause, request.step_id,
                list(request.request_ids[:MAX_LOGGED_IDS]), " again" if retrying else "",
                code.name if code else "not sent", details,
                "the manager's answer: dropped" if answered else "kept, to be sent again",
                extra={"step_id": request.step_id, "code": code.name if code else None},
            )  # fmt: skip
            return False if answered else None
        log.info(
            "reported %s to the manager: step %d, %d requests, %d device and %d host blocks; it uncached %d blocks "
            "and lost %d requests", cause, request.step_id, len(request.request_ids), len(request.device_block_ids),
            len(request.host_block_ids), response.num_uncached_blocks, response.num_lost_requests,
            extra={"step_id": request.step_id, "request_ids": list(request.request_ids[:MAX_LOGGED_IDS])},
        )  # fmt: skip
        return True


def _code_of(error: Exception) -> grpc.StatusCode | None:
    """The status a failed call ended with; None when it was never sent (a closed channel)."""
    if isinstance(error, KVCacheError):
        return status_code(error)
    if isinstance(error, grpc.RpcError):
        return error.code()
    return None
