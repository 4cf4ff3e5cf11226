"""A keyed Step outlasts a manager restart: the client repeats it on every outcome a restart produces
(UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED) and the manager applies it exactly once."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any

import grpc
import pytest

from kv_manager_service.client import KVManagerClient, RetryPolicy
from kv_manager_service.core import AllocateOp, FreeOp
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from processes import free_port, launch, stop_all
from svc_support import CALL_TIMEOUT_S, LostResponse, connect, pool_config, stats, tables, write_config

STEP_METHOD = "/kvcache.v1.KVManagerService/Step"
NUM_CALLERS = 4
NUM_RESTARTS = 3
NUM_STEPS_BETWEEN_RESTARTS = 40  # completed keyed Steps, all callers together
# Long enough to outlast a restart of the manager on a busy machine.
RESTART_RETRY = RetryPolicy(attempts=100, first_backoff_s=0.02, max_backoff_s=0.25, max_total_s=60.0)


class StepOutcomes(grpc.UnaryUnaryClientInterceptor):
    """Counts how each Step try ended (OK or its status code); can end the next ones with `inject`."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.inject: list[grpc.StatusCode] = []  # codes the caller sees after the server has answered
        self.lock = threading.Lock()

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        outcome = continuation(details, request)
        if details.method != STEP_METHOD:
            return outcome
        code = outcome.code()
        with self.lock:
            self.outcomes["OK" if code is grpc.StatusCode.OK else code.name] += 1
            injected = self.inject.pop(0) if self.inject and code is grpc.StatusCode.OK else None
        if injected is not None:
            raise LostResponse(injected, "ended by the test after the server answered")
        return outcome



def client(address: str, outcomes: StepOutcomes) -> KVManagerClient:
    channel = grpc.intercept_channel(grpc.insecure_channel(address), outcomes)
    return KVManagerClient(address, timeout_s=CALL_TIMEOUT_S, channel=channel, step_retry=RESTART_RETRY)


@pytest.fixture
def manager_argv(tmp_path) -> list[str]:
    config = write_config(tmp_path, pool_config(1024), "pool.json")
    return [
        sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", str(free_port()), "--replica-id", "retried",
        "--config", str(config), "--journal", str(tmp_path / "retried.journal"), "--journal-fsync", "never",
    ]  # fmt: skip


def test_a_keyed_step_that_ends_cancelled_is_retried_and_applied_once(tmp_path, manager_argv):
    manager = launch(manager_argv, MANAGER_READY_PREFIX, tmp_path / "manager.log")
    outcomes = StepOutcomes()
    try:
        with client(manager.address, outcomes) as kv:
            outcomes.inject = [grpc.StatusCode.CANCELLED, grpc.StatusCode.CANCELLED]
            result = kv.step([AllocateOp("once", list(range(40)), 40)], idempotency_key="once-1")
        assert outcomes.outcomes == Counter(OK=3)  # three tries, each answered by the manager
        channel, stub = connect(manager.address)
        with channel:
            assert stats(stub).last_step_id == result.step_id == 1  # applied once
            assert list(tables(stub)) == ["once"]
    finally:
        failures = stop_all([manager])
        assert not failures, "\n\n".join(failures)


def test_keyed_steps_in_flight_across_manager_restarts_are_each_applied_exactly_once(tmp_path, manager_argv):
    """Callers send keyed Steps without pause while the manager is stopped (SIGTERM) and started again
    on the same port and journal, several times. Every Step returns, and the step log holds each once."""
    managers = [launch(manager_argv, MANAGER_READY_PREFIX, tmp_path / "manager-0.log")]
    address = managers[0].address
    outcomes = StepOutcomes()
    stop = threading.Event()
    progress = threading.Condition()
    step_ids: dict[str, int] = {}  # request id -> the step that allocated it
    last_request_ids: dict[str, str] = {}  # caller -> the request its last Step allocated
    failures: list[Exception] = []

    def caller(name: str) -> None:
        """Step i allocates {name}-{i} and frees {name}-{i-1}: a Step applied twice or not at all fails a later one."""
        with client(address, outcomes) as kv:
            i = 0
            while not stop.is_set():
                request_id = f"{name}-{i}"
                ops = [AllocateOp(request_id, list(range(i, i + 16)), 16)]
                if i:
                    ops.append(FreeOp((f"{name}-{i - 1}",)))
                try:
                    result = kv.step(ops, idempotency_key=f"{request_id}-key")
                except Exception as error:
                    failures.append(error)
                    break
                with progress:
                    step_ids[request_id] = result.step_id
                    last_request_ids[name] = request_id
                    progress.notify_all()
                i += 1

    def wait_for_more_steps() -> None:
        with progress:
            target = len(step_ids) + NUM_STEPS_BETWEEN_RESTARTS
            assert progress.wait_for(lambda: len(step_ids) >= target or failures, timeout=120), len(step_ids)

    callers = [threading.Thread(target=caller, args=(f"caller{c}",)) for c in range(NUM_CALLERS)]
    try:
        try:
            for thread in callers:
                thread.start()
            for restart in range(1, NUM_RESTARTS + 1):
                wait_for_more_steps()
                assert not stop_all(managers[-1:])  # SIGTERM: a clean exit while Steps arrive
                managers.append(launch(manager_argv, MANAGER_READY_PREFIX, tmp_path / f"manager-{restart}.log"))
            wait_for_more_steps()
        finally:
            stop.set()
            for thread in callers:
                thread.join(timeout=120)
        assert not failures, f"{failures[0]!r}; the Step tries ended {dict(outcomes.outcomes)}"
        channel, stub = connect(address)
        with channel:
            # Each Step once: the step ids the callers got are exactly the manager's step log.
            assert sorted(step_ids.values()) == list(range(1, stats(stub).last_step_id + 1))
            assert set(tables(stub)) == set(last_request_ids.values())
    finally:
        failures_on_stop = stop_all(managers)
        assert not failures_on_stop, "\n\n".join(failures_on_stop)
