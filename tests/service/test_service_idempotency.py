"""Retries without double effects: a keyed Step is applied once, however often it is sent.

The client under test talks through a channel that loses responses: each
call reaches the server and completes there, then its response is discarded
and the caller sees UNAVAILABLE or DEADLINE_EXCEEDED, exactly what a
dropped connection or an expired deadline looks like. One server for the
module, started with `--idempotency-retention 4` (it remembers four keyed
Steps) and `--check-invariants`.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Iterator, Sequence

import grpc
import pytest

from kv_manager_service.client import KVManagerClient, RetryPolicy
from kv_manager_service.core import AllocateOp, FailedPreconditionError
from kv_manager_service.shared.errors import IdempotencyKeyReusedError
from kv_manager_service.server.idempotency import StepKeys, request_fingerprint
from kv_manager_service.server.retention import ServiceLimits
from kv_manager_service.shared.ops import StepResult
from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import (
    CALL_TIMEOUT_S,
    LostResponse,
    assert_error,
    connect,
    op_alloc,
    pool_config,
    read_steps,
    release_everything,
    rpc_error,
    snapshot,
    stats,
    step_request,
    tables,
    unchanged,
)

WORKER = "idempotency-worker"
RETENTION = 4
STEP_METHOD = "/kvcache.v1.KVManagerService/Step"
FAST_RETRY = RetryPolicy(attempts=4, first_backoff_s=0.01, max_backoff_s=0.02, max_total_s=10.0)
Code = grpc.StatusCode



class ResponseDropper(grpc.UnaryUnaryClientInterceptor):
    """Lets every Step reach the server and complete, then loses the first responses: one per code in `losses`."""

    def __init__(self, losses: Sequence[grpc.StatusCode]) -> None:
        self.losses = list(losses)
        self.sent: list[pb.StepRequest] = []  # every Step request, as it went out
        self.answers: list[pb.StepResponse] = []  # every response the server gave, lost or delivered

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        outcome = continuation(details, request)
        if details.method != STEP_METHOD:
            return outcome
        sent = pb.StepRequest()
        sent.CopyFrom(request)
        self.sent.append(sent)
        self.answers.append(outcome.result())  # the server answered: the step is done there
        if self.losses:
            raise LostResponse(self.losses.pop(0))
        return outcome


@pytest.fixture(scope="module")
def keyed_server(module_server_factory):
    return module_server_factory.start(
        "--replica-id", "idempotency", "--worker-timeout-s", "3600", "--check-invariants", "--idempotency-retention", str(RETENTION),
        config=pool_config(64),
    )  # fmt: skip


@pytest.fixture(scope="module")
def stub(keyed_server):
    channel, stub = connect(keyed_server.address)
    yield stub
    channel.close()


@pytest.fixture(autouse=True)
def empty_pool_after(stub):
    yield
    release_everything(stub, WORKER)


def lossy_client(address: str, dropper: ResponseDropper, retry: RetryPolicy = FAST_RETRY) -> KVManagerClient:
    channel = grpc.intercept_channel(grpc.insecure_channel(address), dropper)
    return KVManagerClient(address, timeout_s=CALL_TIMEOUT_S, channel=channel, step_retry=retry)


@pytest.fixture
def lossy(keyed_server) -> Iterator[Any]:
    """`lossy(codes)`: a client whose first len(codes) Step responses are lost, and its dropper."""
    clients = []

    def make(
        losses: Sequence[grpc.StatusCode], retry: RetryPolicy = FAST_RETRY
    ) -> tuple[KVManagerClient, ResponseDropper]:
        dropper = ResponseDropper(losses)
        clients.append(lossy_client(keyed_server.address, dropper, retry))
        return clients[-1], dropper

    yield make
    for client in clients:
        client.close()


def test_a_keyed_step_whose_responses_were_lost_is_applied_once(stub, lossy):
    client, dropper = lossy([Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED])
    before = stats(stub)
    result = client.step([AllocateOp("once", list(range(40)), 40)], idempotency_key="once-1")

    # Three sends of one request, under one key; the server answered each with the same response.
    assert len(dropper.sent) == 3 and all(sent == dropper.sent[0] for sent in dropper.sent)
    assert dropper.sent[0].idempotency_key == "once-1"
    assert all(answer == dropper.answers[0] for answer in dropper.answers)
    assert result.step_id == dropper.answers[0].step_id
    # Applied once: one step id, one request, three blocks (40 tokens of 16), one delta.
    after = stats(stub)
    assert after.last_step_id == before.last_step_id + 1 == result.step_id
    assert after.num_requests == before.num_requests + 1
    assert before.num_free_blocks - after.num_free_blocks == 3
    allocation = result.results[0]
    assert tables(stub, "once") == {"once": (40, (allocation.groups[0].new_block_ids,))}
    (delta,) = read_steps(stub, WORKER, result.step_id, 1)
    assert [row.request_id for row in delta.rows_added] == ["once"]


def test_a_keyed_decode_whose_response_was_lost_appends_its_token_once(stub, lossy):
    stub.Allocate(pb.AllocateRequest(request_id="dec", token_ids=range(20), num_new_tokens=20), timeout=CALL_TIMEOUT_S)
    client, dropper = lossy([Code.UNAVAILABLE])
    before = stats(stub).last_step_id
    result = client.decode(["dec"], [7], auto_key=True)
    assert len(dropper.sent) == 2 and dropper.sent[0] == dropper.sent[1]
    uuid.UUID(dropper.sent[0].idempotency_key)  # auto_key: a fresh UUID
    assert result.step_id == before + 1 == stats(stub).last_step_id
    assert result.num_computed_tokens == (20,)  # where its one token starts
    assert tables(stub, "dec")["dec"][0] == 21  # one token appended, not two


def test_without_a_key_a_lost_response_is_not_retried(stub, lossy):
    """The hazard keys remove: the caller sees a failure, but the step was applied."""
    client, dropper = lossy([Code.UNAVAILABLE])
    before = stats(stub).last_step_id
    with pytest.raises(grpc.RpcError) as raised:
        client.step([AllocateOp("unkeyed", list(range(8)), 8)])
    assert raised.value.code() is Code.UNAVAILABLE
    assert len(dropper.sent) == 1 and dropper.sent[0].idempotency_key == ""
    assert stats(stub).last_step_id == before + 1 and "unkeyed" in tables(stub)


def test_auto_keys_are_new_for_every_call(stub, lossy):
    client, dropper = lossy([])
    client.step([AllocateOp("twice", list(range(8)), 4)], auto_key=True)
    client.step([AllocateOp("twice", [], 4)], auto_key=True)
    assert dropper.sent[0].idempotency_key != dropper.sent[1].idempotency_key
    assert tables(stub, "twice")["twice"][0] == 8  # both applied


def test_retries_are_bounded_and_the_key_still_recovers_the_answer(stub, lossy):
    client, dropper = lossy([Code.UNAVAILABLE] * 10, RetryPolicy(attempts=3, first_backoff_s=0.01, max_backoff_s=0.01))
    before = stats(stub).last_step_id
    ops = [AllocateOp("bounded", list(range(24)), 24)]
    with pytest.raises(grpc.RpcError) as raised:
        client.step(ops, idempotency_key="bounded-1")
    assert raised.value.code() is Code.UNAVAILABLE and len(dropper.sent) == 3
    assert stats(stub).last_step_id == before + 1  # applied once by the three sends
    # Later (a reconnected scheduler, say), the same request under the same key gets the answer.
    dropper.losses.clear()
    result = client.step(ops, idempotency_key="bounded-1")
    assert result.step_id == before + 1 == stats(stub).last_step_id
    assert dropper.answers[-1] == dropper.answers[0]


def test_the_same_key_with_another_request_is_refused_and_changes_nothing(stub, lossy):
    first = stub.Step(
        pb.StepRequest(ops=[op_alloc("k-a", range(16))], idempotency_key="shared"), timeout=CALL_TIMEOUT_S
    )
    other = pb.StepRequest(ops=[op_alloc("k-b", range(16))], idempotency_key="shared")
    with unchanged(stub):
        error = rpc_error(stub.Step, other)
        assert_error(error, Code.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED", "idempotency_key", "idempotency_key")
        client, _ = lossy([])
        with pytest.raises(IdempotencyKeyReusedError) as raised:
            client.step([AllocateOp("k-b", list(range(16)), 16)], idempotency_key="shared")
        assert isinstance(raised.value, FailedPreconditionError) and raised.value.field == "idempotency_key"
        # The request the key belongs to still gets its answer, and nothing happens.
        again = stub.Step(
            pb.StepRequest(ops=[op_alloc("k-a", range(16))], idempotency_key="shared"), timeout=CALL_TIMEOUT_S
        )
        assert again == first
    assert "k-b" not in tables(stub)


def test_a_refused_keyed_step_is_not_remembered(stub):
    request = step_request(decode=[("late", 5)])
    request.idempotency_key = "refused-then-accepted"
    with unchanged(stub):
        assert rpc_error(stub.Step, request).code() is Code.NOT_FOUND  # "late" does not exist yet
    stub.Allocate(pb.AllocateRequest(request_id="late", token_ids=range(10), num_new_tokens=10), timeout=CALL_TIMEOUT_S)
    response = stub.Step(request, timeout=CALL_TIMEOUT_S)  # the same key: now applied
    assert response.step_id == stats(stub).last_step_id and tables(stub, "late")["late"][0] == 11


def test_an_over_long_key_is_refused(stub):
    request = pb.StepRequest(idempotency_key="k" * 257)
    with unchanged(stub):
        assert_error(rpc_error(stub.Step, request), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", "idempotency_key")


def test_keys_older_than_the_retention_are_forgotten(stub):
    requests = [
        pb.StepRequest(ops=[op_alloc(f"old-{i}", range(8))], idempotency_key=f"old-{i}") for i in range(RETENTION + 1)
    ]
    responses = [stub.Step(request, timeout=CALL_TIMEOUT_S) for request in requests]
    last = stats(stub).last_step_id
    # The newest RETENTION keys are remembered: sent again, nothing is applied.
    with unchanged(stub):
        for request, response in zip(requests[1:], responses[1:]):
            assert stub.Step(request, timeout=CALL_TIMEOUT_S) == response
    # The oldest is forgotten: the same request is a new step (here, "old-0" appends its 8 tokens again).
    again = stub.Step(requests[0], timeout=CALL_TIMEOUT_S)
    assert again.step_id == last + 1 != responses[0].step_id
    assert tables(stub, "old-0")["old-0"][0] == 16


def test_concurrent_copies_of_a_keyed_step_apply_it_once(stub):
    request = pb.StepRequest(ops=[op_alloc("racing", range(32))], idempotency_key="racing-1")
    before = stats(stub).last_step_id
    barrier = threading.Barrier(6)
    responses: list[pb.StepResponse] = []

    def send() -> None:
        barrier.wait()
        responses.append(stub.Step(request, timeout=CALL_TIMEOUT_S))

    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(responses) == 6 and all(response == responses[0] for response in responses)
    assert responses[0].step_id == before + 1 == stats(stub).last_step_id


def test_a_keyed_step_is_remembered_across_a_restart_from_the_journal(server_factory, tmp_path):
    args = ("--replica-id", "journaled", "--journal", str(tmp_path / "kv.journal"), "--journal-fsync", "never")
    config = pool_config(64)
    request = pb.StepRequest(ops=[op_alloc("j", range(20))], idempotency_key="before-restart")
    server = server_factory.start(*args, config=config)
    channel, stub = connect(server.address)
    with channel:
        answer = stub.Step(request, timeout=CALL_TIMEOUT_S)
    assert server.stop() == 0
    restarted = server_factory.start(*args, config=config)
    channel, stub = connect(restarted.address)
    with channel, unchanged(stub):
        assert stub.Step(request, timeout=CALL_TIMEOUT_S) == answer
        other = pb.StepRequest(ops=[op_alloc("j2", range(20))], idempotency_key="before-restart")
        assert rpc_error(stub.Step, other).code() is Code.FAILED_PRECONDITION


def test_a_restart_with_a_larger_retention_replays_every_applied_step(server_factory, tmp_path):
    """A key forgotten and then applied again is two steps in the journal; a restart that remembers
    more keys must still replay both, not take the second for a repeat."""
    journal = ("--replica-id", "replayed", "--journal", str(tmp_path / "kv.journal"), "--journal-fsync", "never")
    config = pool_config(64)
    keyed = pb.StepRequest(ops=[op_alloc("x", range(8))], idempotency_key="again")
    server = server_factory.start(*journal, "--idempotency-retention", "1", config=config)
    channel, stub = connect(server.address)
    with channel:
        stub.Step(keyed, timeout=CALL_TIMEOUT_S)
        stub.Step(pb.StepRequest(idempotency_key="other"), timeout=CALL_TIMEOUT_S)  # "again" is forgotten
        second = stub.Step(keyed, timeout=CALL_TIMEOUT_S)  # applied again: x holds 16 tokens
        before = snapshot(stub)
    assert before["stats"]["last_step_id"] == 3 == second.step_id
    assert server.stop() == 0
    restarted = server_factory.start(*journal, "--idempotency-retention", "100", config=config)
    channel, stub = connect(restarted.address)
    with channel:
        assert snapshot(stub) == before
        assert stub.Step(keyed, timeout=CALL_TIMEOUT_S) == second  # remembered, with its latest answer


# -- the key memory itself -------------------------------------------------------------------


def test_step_keys_remember_the_last_retention_keys_and_refuse_a_reused_one():
    keys = StepKeys(retention=2)
    requests = {name: pb.StepRequest(ops=[op_alloc(name, [1])], idempotency_key=name) for name in ("a", "b", "c")}
    for name, request in requests.items():
        assert keys.get(name, request_fingerprint(request)) is None
        keys.put(name, request_fingerprint(request), StepResult(ord(name), ()))
    assert len(keys) == 2 and "a" not in keys
    assert keys.get("c", request_fingerprint(requests["c"])) == StepResult(ord("c"), ())
    with pytest.raises(IdempotencyKeyReusedError):
        keys.get("c", request_fingerprint(requests["b"]))
    with pytest.raises(ValueError):
        ServiceLimits(idempotency_retention=0)


def test_the_fingerprint_does_not_depend_on_the_encoding():
    """Packed and unpacked repeated fields, fields in another order: one request, one fingerprint."""
    request = pb.StepRequest(ops=[op_alloc("x", [1, 2, 3])], idempotency_key="k")
    # AllocateRequest: num_new_tokens, then token_ids unpacked, then request_id.
    allocate = b"\x18\x03" + b"\x10\x01\x10\x02\x10\x03" + b"\x0a\x01x"
    step_op = b"\x0a" + bytes([len(allocate)]) + allocate
    other_encoding = b"\x1a\x01k" + b"\x0a" + bytes([len(step_op)]) + step_op  # the key first
    assert other_encoding != request.SerializeToString()
    assert pb.StepRequest.FromString(other_encoding) == request
    assert request_fingerprint(pb.StepRequest.FromString(other_encoding)) == request_fingerprint(request)
