"""WorkerService over real gRPC: every refusal names its field, and changes nothing; a read of KV the
worker does not hold is refused and reported to the manager."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from e2e_support import DenseOracle, start_stack, stop_stack
from processes import launch, stop_all

from gpu_worker.sampling import GREEDY
from gpu_worker.kv_reports import MissingKVReporter
from kv_manager_service.client import KVManagerClient, RetryPolicy
from kv_manager_service.core import AllocateOp, AllocateStatus, FreeOp, KVLossCause
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kv_manager_service.shared.status import error_info
from kvcache.v1 import kv_manager_pb2 as manager_pb
from kvcache.v1 import kv_manager_pb2_grpc as manager_pb_grpc
from kvcache.v1 import worker_pb2 as pb

POOL = {"num_blocks": 64, "groups": [{"kind": "full_attention", "block_size": 16}]}
MODEL = "tiny"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    stack, processes = start_stack(
        tmp_path_factory.mktemp("worker-service"), MODEL, "torch", POOL, worker_args=["--step-timeout-s", "1"]
    )
    try:
        yield stack
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)


def execute(stack, step_id, *requests):
    return stack.worker_client.stub.Execute(pb.ExecuteRequest(step_id=step_id, requests=list(requests)), timeout=30)


def scheduled(request_id, token_ids, start_position=0):
    return pb.ScheduledRequest(request_id=request_id, token_ids=token_ids, start_position=start_position)


def refused(call) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info = error_info(caught.value)
    return caught.value.code(), (info.metadata.get("field") if info is not None else None)


def test_worker_info_describes_the_model_and_the_cache(setup):
    info = setup.worker_client.info()
    assert (info.worker_id, info.model, info.device, info.backend, info.dtype) == ("worker-0", MODEL, "cpu", "torch", "float32")
    assert (info.num_layers, info.num_blocks, info.block_size) == (2, 64, 16)
    # 2 layers x 64 blocks x (K, V) x 16 slots x 2 KV heads x 16 dims x 4 bytes
    assert info.kv_cache_bytes == 2 * 64 * 2 * 16 * 2 * 16 * 4


def test_bad_executes_are_refused_with_their_field_and_change_nothing(setup):
    stack = setup
    oracle = DenseOracle(MODEL)
    tokens = list(range(1, 21))
    step = stack.manager_client.step([AllocateOp("err-a", tokens, len(tokens))])
    n = step.step_id
    cases = {
        "step 0": (lambda: execute(stack, 0, scheduled("err-a", tokens)), grpc.StatusCode.INVALID_ARGUMENT, "step_id"),
        "no request": (lambda: execute(stack, n), grpc.StatusCode.INVALID_ARGUMENT, "requests"),
        "no token": (lambda: execute(stack, n, scheduled("err-a", [])), grpc.StatusCode.INVALID_ARGUMENT, "requests[0].token_ids"),
        "token past the vocabulary": (
            lambda: execute(stack, n, scheduled("err-a", [256] + tokens[1:])), grpc.StatusCode.INVALID_ARGUMENT, "requests[0].token_ids",
        ),
        "twice in one call": (
            lambda: execute(stack, n, scheduled("err-a", tokens), scheduled("err-a", tokens)),
            grpc.StatusCode.INVALID_ARGUMENT, "requests[1].request_id",
        ),
        "unknown request": (lambda: execute(stack, n, scheduled("nobody", [1])), grpc.StatusCode.NOT_FOUND, "request_id"),
        "past its blocks": (
            lambda: execute(stack, n, scheduled("err-a", tokens, 20)), grpc.StatusCode.FAILED_PRECONDITION, "requests[0].start_position",
        ),
        "a step that never comes": (lambda: execute(stack, n + 1000, scheduled("err-a", tokens)), grpc.StatusCode.UNAVAILABLE, None),
    }  # fmt: skip
    for name, (call, code, field) in cases.items():
        assert refused(call) == (code, field), name
    # Nothing was computed or stored: the real call still matches the dense pass.
    first = execute(stack, n, scheduled("err-a", tokens)).outputs[0]
    assert first.token_id == oracle.next_token(tokens, GREEDY)[0]
    # Each refusal that came after the step's deltas were applied was reported: the manager counts err-a
    # as lost, and its scheduler frees it and admits it again.
    lost = stack.manager_client.step([AllocateOp("err-a", [first.token_id], 1)])
    assert lost.results[0].status is AllocateStatus.KV_LOST
    assert dict(lost.lost_requests) == {"err-a": KVLossCause.STEP_REFUSED}
    stack.manager_client.free(["err-a"])
    tokens.append(first.token_id)
    later = stack.manager_client.step([AllocateOp("err-b", tokens, len(tokens))]).step_id
    again = execute(stack, later, scheduled("err-b", tokens)).outputs[0]
    assert again.token_id == oracle.next_token(tokens, GREEDY)[0]
    # The tables here are at step `later` now: step n cannot run again.
    assert refused(lambda: execute(stack, n, scheduled("err-b", tokens[-1:], 20))) == (
        grpc.StatusCode.FAILED_PRECONDITION, "step_id",
    )  # fmt: skip
    stack.manager_client.free(["err-b"])


def test_a_worker_refuses_a_pool_it_cannot_run(tmp_path):
    """A mamba group (or a model/pool mismatch) stops the worker at startup with a clear error."""
    config = tmp_path / "pool.json"
    config.write_text('{"num_blocks": 32, "groups": [{"kind": "full_attention", "block_size": 16}, {"kind": "mamba", "block_size": 16}]}')
    manager = launch(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--config", str(config)],
        MANAGER_READY_PREFIX,
        tmp_path / "manager.log",
    )
    try:
        for model, message in (("tiny", "GROUP_KIND_MAMBA"), ("no-such-model", "neither a built-in model")):
            done = subprocess.run(
                [sys.executable, "-m", "gpu_worker.cli", "--manager", manager.address, "--model", model],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 2 and message in done.stderr, done.stderr
    finally:
        assert not stop_all([manager])


def kv_missing(call) -> tuple[grpc.StatusCode, str, str | None, list[str]]:
    """The code, reason, field and request ids of a refused Execute."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info = error_info(caught.value)
    request_ids = json.loads(info.metadata.get("request_ids", "null"))
    return caught.value.code(), info.reason, info.metadata.get("field"), request_ids


def test_a_hit_on_blocks_no_execute_filled_is_refused_and_the_rest_of_the_step_runs_again(setup):
    """A scheduler allocates a prompt and drops it before Execute; the manager still counts its blocks
    as cached, and a later request hits them. The worker refuses to read them, names the request, and
    tells the manager, which uncaches the blocks and counts the request as lost."""
    stack = setup
    oracle = DenseOracle(MODEL)
    prompt = [(7 * i + 3) % 256 for i in range(40)]  # two full blocks of 16 and a tail
    stack.manager_client.step([AllocateOp("kvm-dropped", prompt, len(prompt))])
    stack.manager_client.step([FreeOp(["kvm-dropped"])])
    assert stack.manager_client.find_cache_hit(prompt)[0].num_cached_tokens == 32
    hit_tokens, other_tokens = prompt + [1, 2], [(5 * i + 1) % 256 for i in range(9)]
    step = stack.manager_client.step(
        [AllocateOp("kvm-other", other_tokens, len(other_tokens)), AllocateOp("kvm-hit", hit_tokens, len(hit_tokens))]
    )
    assert step.results[1].num_computed_tokens == 32
    batch = [scheduled("kvm-other", other_tokens), scheduled("kvm-hit", hit_tokens[32:], 32)]
    assert kv_missing(lambda: execute(stack, step.step_id, *batch)) == (
        grpc.StatusCode.FAILED_PRECONDITION, "KV_MISSING", "requests[1]", ["kvm-hit"],
    )  # fmt: skip
    # The manager heard it before the reply.
    assert dict(stack.manager_client.step([]).lost_requests) == {"kvm-hit": KVLossCause.KV_MISSING}
    assert stack.manager_client.find_cache_hit(prompt)[0].num_cached_tokens == 0
    # The same step again, without the request it named: its deltas are applied already.
    (output,) = execute(stack, step.step_id, batch[0]).outputs
    assert output.token_id == oracle.next_token(other_tokens, GREEDY)[0]
    stack.manager_client.step([FreeOp(["kvm-hit", "kvm-other"])])


def test_a_hit_on_blocks_an_execute_filled_reads_them(setup):
    stack = setup
    oracle = DenseOracle(MODEL)
    prompt = [(11 * i + 5) % 256 for i in range(40)]
    first = stack.manager_client.step([AllocateOp("kvh-first", prompt, len(prompt))])
    execute(stack, first.step_id, scheduled("kvh-first", prompt))
    stack.manager_client.step([FreeOp(["kvh-first"])])
    tokens = prompt + [9, 8, 7]
    step = stack.manager_client.step([AllocateOp("kvh-hit", tokens, len(tokens))])
    assert step.results[0].num_computed_tokens == 32
    (output,) = execute(stack, step.step_id, scheduled("kvh-hit", tokens[32:], 32)).outputs
    assert output.token_id == oracle.next_token(tokens, GREEDY)[0]
    stack.manager_client.step([FreeOp(["kvh-hit"])])


class ManagerThatComesBack(manager_pb_grpc.KVManagerServiceServicer):
    """Only ReportMissingKV: UNAVAILABLE until `available`, then it takes every report with a cause."""

    def __init__(self) -> None:
        self.available = False
        self.received: list[manager_pb.ReportMissingKVRequest] = []

    def ReportMissingKV(self, request, context):
        if not self.available:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        if request.cause == manager_pb.KV_LOSS_CAUSE_UNSPECIFIED:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a report needs a cause")
        self.received.append(request)
        return manager_pb.ReportMissingKVResponse(num_lost_requests=len(request.request_ids))


@pytest.fixture
def flaky_manager():
    servicer = ManagerThatComesBack()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    manager_pb_grpc.add_KVManagerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = KVManagerClient(f"127.0.0.1:{port}", timeout_s=5, read_retry=RetryPolicy(attempts=1))
    try:
        yield servicer, client
    finally:
        client.close()
        server.stop(0)


def report(step_id: int, cause: int = manager_pb.KV_LOSS_CAUSE_KV_MISSING) -> manager_pb.ReportMissingKVRequest:
    return manager_pb.ReportMissingKVRequest(
        worker_id="w", incarnation=7, step_id=step_id, request_ids=["r"], cause=cause
    )


def test_a_report_the_manager_did_not_answer_is_sent_again_until_it_does(flaky_manager):
    manager, client = flaky_manager
    reporter = MissingKVReporter(client, first_backoff_s=0.02, max_backoff_s=0.05)
    try:
        assert reporter.report(report(1)) is False and reporter.num_pending == 1
        manager.available = True
        deadline = time.monotonic() + 10
        while reporter.num_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r.step_id for r in manager.received] == [1]
        assert reporter.report(report(2)) is True
        # An answer, even a refusal, ends a report: sending it again would get the same answer.
        assert reporter.report(report(3, manager_pb.KV_LOSS_CAUSE_UNSPECIFIED)) is False
        assert reporter.num_pending == 0 and [r.step_id for r in manager.received] == [1, 2]
    finally:
        reporter.close()


class ManagerSlowToRefuse(manager_pb_grpc.KVManagerServiceServicer):
    """ReportMissingKV: UNAVAILABLE at once the first time, then only once `release` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.retry_arrived = threading.Event()
        self.release = threading.Event()

    def ReportMissingKV(self, request, context):
        self.calls += 1
        if self.calls > 1:
            self.retry_arrived.set()
            self.release.wait(10)
        context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")


def test_closing_while_a_retry_is_on_its_way_stops_the_retries_at_once():
    """A retry whose failure comes back after `close` must not start its backoff: it ends there."""
    servicer = ManagerSlowToRefuse()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    manager_pb_grpc.add_KVManagerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = KVManagerClient(f"127.0.0.1:{port}", timeout_s=5, read_retry=RetryPolicy(attempts=1))
    reporter = MissingKVReporter(client, first_backoff_s=60)
    try:
        assert reporter.report(report(1)) is False
        assert servicer.retry_arrived.wait(5)  # the retry thread's call is on its way
        closing = threading.Thread(target=reporter.close)
        closing.start()
        time.sleep(0.2)  # close() has notified, with no one waiting yet
        servicer.release.set()
        closing.join(timeout=3)
        assert not closing.is_alive() and not reporter.thread.is_alive()
    finally:
        servicer.release.set()
        client.close()
        server.stop(0)


def test_the_reports_waiting_for_the_manager_are_bounded_oldest_dropped_first(flaky_manager):
    _, client = flaky_manager
    reporter = MissingKVReporter(client, first_backoff_s=60, max_pending=2)
    try:
        assert [reporter.report(report(n)) for n in (1, 2, 3)] == [False, False, False]
        assert [r.step_id for r in reporter.pending] == [2, 3]
    finally:
        reporter.close()
    assert not reporter.thread.is_alive()
