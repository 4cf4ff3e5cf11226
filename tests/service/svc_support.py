"""Helpers shared by the service tests (raw stubs, error checks, snapshots, streams)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import cbor2
import grpc

from kv_manager_service.shared.status import ERROR_DOMAIN, error_info
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]  # the repository

STREAM_TIMEOUT_S = 20.0  # a stream that stalls fails the test instead of hanging it
CALL_TIMEOUT_S = 10.0

OK = pb.ALLOCATE_STATUS_OK
NO_SPACE = pb.ALLOCATE_STATUS_NO_SPACE


def connect(address: str) -> tuple[grpc.Channel, pb_grpc.KVManagerServiceStub]:
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    )
    grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
    return channel, pb_grpc.KVManagerServiceStub(channel)


def write_config(directory: Path, config: dict[str, Any], name: str = "pool.json") -> Path:
    path = directory / name
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def pool_config(num_blocks: int, block_size: int = 16, **extra: Any) -> dict[str, Any]:
    """A --config file body with one full-attention group."""
    return {"num_blocks": num_blocks, "groups": [{"kind": "full_attention", "block_size": block_size}], **extra}


# -- requests ----------------------------------------------------------------------


def alloc(request_id: str, token_ids: Sequence[int], num_new_tokens: int | None = None, **kwargs: Any) -> pb.AllocateRequest:
    """An AllocateRequest; num_new_tokens defaults to len(token_ids) (the whole prompt / all appended)."""
    n = len(token_ids) if num_new_tokens is None else num_new_tokens
    return pb.AllocateRequest(request_id=request_id, token_ids=list(token_ids), num_new_tokens=n, **kwargs)


def op_alloc(request_id: str, token_ids: Sequence[int], num_new_tokens: int | None = None, **kwargs: Any) -> pb.StepOp:
    return pb.StepOp(allocate=alloc(request_id, token_ids, num_new_tokens, **kwargs))


def op_free(*request_ids: str) -> pb.StepOp:
    return pb.StepOp(free=pb.FreeRequest(request_ids=list(request_ids)))


def op_fork(parent: str, *children: str) -> pb.StepOp:
    return pb.StepOp(fork=pb.ForkRequest(parent_request_id=parent, child_request_ids=list(children)))


def step_request(ops: Iterable[pb.StepOp] = (), decode: Sequence[tuple[str, int]] = ()) -> pb.StepRequest:
    request = pb.StepRequest(ops=list(ops))
    if decode:
        request.decode.request_ids.extend([r for r, _ in decode])
        request.decode.token_ids.extend([t for _, t in decode])
    return request


# -- reads -------------------------------------------------------------------------


def stats(stub: pb_grpc.KVManagerServiceStub) -> pb.GetStatsResponse:
    return stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S)


def last_step_id(stub: pb_grpc.KVManagerServiceStub) -> int:
    return stats(stub).last_step_id


def tables(stub: pb_grpc.KVManagerServiceStub, *request_ids: str) -> dict[str, tuple[int, tuple[tuple[int, ...], ...]]]:
    """request id -> (num_computed_tokens, block ids per group)."""
    response = stub.GetBlockTables(pb.GetBlockTablesRequest(request_ids=list(request_ids)), timeout=CALL_TIMEOUT_S)
    return {t.request_id: (t.num_computed_tokens, tuple(tuple(g.block_ids) for g in t.groups)) for t in response.tables}


def table(stub: pb_grpc.KVManagerServiceStub, request_id: str, group: int = 0) -> list[int]:
    return list(tables(stub, request_id)[request_id][1][group])


def snapshot(stub: pb_grpc.KVManagerServiceStub) -> dict[str, Any]:
    """Everything observable about the state: stats (last step and event included), tables, pending copies.

    The registered workers are left out: their idle times change by themselves, and they expire.
    """
    s = stats(stub)
    s.ClearField("workers")
    response = stub.GetBlockTables(pb.GetBlockTablesRequest(), timeout=CALL_TIMEOUT_S)
    return {
        "stats": {field.name: value for field, value in s.ListFields()},
        "tables": sorted(
            (t.request_id, t.num_computed_tokens, tuple(tuple(g.block_ids) for g in t.groups)) for t in response.tables
        ),
        "pending_copies": [(p.step_id, p.copy.src_block_id, p.copy.dst_block_id) for p in response.pending_copies],
        "tables_step_id": response.step_id,
    }


# -- errors ------------------------------------------------------------------------


def rpc_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
    """Run `call`, which must fail with an RpcError, and return the error."""
    kwargs.setdefault("timeout", CALL_TIMEOUT_S)
    try:
        response = call(*args, **kwargs)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"expected an RpcError, got a response: {response}")


def stream_error(call: Callable[..., Any], request: Any) -> grpc.RpcError:
    """Open a server stream that must fail before yielding anything, and return the error."""
    stream = call(request, timeout=STREAM_TIMEOUT_S)
    try:
        item = next(stream)
    except grpc.RpcError as error:
        return error
    finally:
        stream.cancel()
    raise AssertionError(f"expected the stream to fail, got an item: {item}")


def assert_error(
    error: grpc.RpcError, code: grpc.StatusCode, reason: str, field: str | None = None, in_details: str | None = None
) -> None:
    """The status code, the ErrorInfo (reason, domain, field) and the trailing metadata agree."""
    assert error.code() == code, (error.code(), error.details())
    info = error_info(error)
    assert info is not None, f"no ErrorInfo in the status details of {error.code()}: {error.details()}"
    assert info.domain == ERROR_DOMAIN
    assert info.reason == reason, (info.reason, error.details())
    metadata = dict(error.trailing_metadata() or ())
    assert metadata.get("kvcache-reason") == reason
    if field is not None:
        assert info.metadata.get("field") == field, (info.metadata.get("field"), error.details())
        assert metadata.get("kvcache-field") == field
    if in_details is not None:
        assert in_details in error.details(), error.details()


# -- streams -----------------------------------------------------------------------


def take(stream: Any, n: int) -> list[Any]:
    """The next n items of a server stream (which must be opened with a timeout)."""
    items = []
    for _ in range(n):
        items.append(next(stream))
    return items


def watch_steps(stub: pb_grpc.KVManagerServiceStub, worker_id: str, from_step_id: int) -> Any:
    return stub.WatchSteps(pb.WatchStepsRequest(worker_id=worker_id, from_step_id=from_step_id), timeout=STREAM_TIMEOUT_S)


def watch_events(stub: pb_grpc.KVManagerServiceStub, from_sequence: int) -> Any:
    return stub.WatchEvents(pb.WatchEventsRequest(from_sequence=from_sequence), timeout=STREAM_TIMEOUT_S)


def follow_steps(stub: pb_grpc.KVManagerServiceStub, worker_id: str, from_step_id: int) -> Any:
    """A WatchSteps stream, returned once GetStats lists `worker_id`. A worker the manager did not know
    empties the prefix cache when it registers, so a test that caches blocks must wait for this first."""
    stream = watch_steps(stub, worker_id, from_step_id)
    wait_for(lambda: worker_id in workers(stub), f"worker {worker_id} registered")
    return stream


def read_steps(stub: pb_grpc.KVManagerServiceStub, worker_id: str, from_step_id: int, n: int) -> list[pb.StepDelta]:
    stream = watch_steps(stub, worker_id, from_step_id)
    try:
        return take(stream, n)
    finally:
        stream.cancel()


def read_events(stub: pb_grpc.KVManagerServiceStub, from_sequence: int, n: int) -> list[pb.KVEvent]:
    stream = watch_events(stub, from_sequence)
    try:
        return take(stream, n)
    finally:
        stream.cancel()


# -- workers -----------------------------------------------------------------------


def workers(stub: pb_grpc.KVManagerServiceStub, metadata: Any = None) -> dict[str, pb.WorkerStatus]:
    """The registered workers GetStats lists, by id."""
    response = stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S, metadata=metadata)
    return {w.worker_id: w for w in response.workers}


def wait_for(done: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll `done` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g}s"
        time.sleep(0.05)


def register_worker(stub: pb_grpc.KVManagerServiceStub, worker_id: str, metadata: Any = None) -> None:
    """Register `worker_id` as having done every step so far (a WatchSteps stream, closed once GetStats
    lists the worker); it then stays registered while it acknowledges (see --worker-timeout-s)."""
    from_step_id = stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S, metadata=metadata).last_step_id + 1
    request = pb.WatchStepsRequest(worker_id=worker_id, from_step_id=from_step_id)
    stream = stub.WatchSteps(request, timeout=STREAM_TIMEOUT_S, metadata=metadata)
    try:
        wait_for(lambda: worker_id in workers(stub, metadata), f"worker {worker_id} registered")
    finally:
        stream.cancel()


# -- cleanup -----------------------------------------------------------------------


def release_everything(stub: pb_grpc.KVManagerServiceStub, worker_id: str) -> None:
    """Free every live request and acknowledge every step, so the next test starts from an empty pool."""
    live = list(tables(stub))
    if live:
        stub.Free(pb.FreeRequest(request_ids=live), timeout=CALL_TIMEOUT_S)
    register_worker(stub, worker_id)
    stub.AckSteps(pb.AckStepsRequest(worker_id=worker_id, step_id=last_step_id(stub)), timeout=CALL_TIMEOUT_S)
    s = stats(stub)
    assert s.num_requests == 0 and s.num_pending_copies == 0 and s.usage == 0.0, s


# -- independent hashing (vLLM's sha256_cbor) -----------------------------------------

ROOT_HASH = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH, extra: Any = None) -> list[bytes]:
    """The chained hash of every full block of token_ids, computed without the project's code."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(cbor2.dumps([parent, list(token_ids[start : start + block_size]), extra], canonical=True)).digest()
        hashes.append(parent)
    return hashes


class unchanged:
    """`with unchanged(stub): ...`: the observable state (stats incl. last_step_id, tables, copies) is the same after."""

    def __init__(self, stub: pb_grpc.KVManagerServiceStub) -> None:
        self.stub = stub

    def __enter__(self) -> "unchanged":
        self.before = snapshot(self.stub)
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            after = snapshot(self.stub)
            assert after == self.before, f"the state changed:\nbefore {self.before}\nafter  {after}"


class Worker:
    """Block tables rebuilt from deltas alone, as a GPU worker keeps them."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, list[int]]] = {}
        self.copies: list[tuple[int, int, int]] = []

    def apply(self, delta: pb.StepDelta) -> None:
        for row in delta.rows_added:
            assert row.request_id not in self.rows, f"step {delta.step_id} adds {row.request_id} twice"
            self.rows[row.request_id] = {g.group_id: list(g.block_ids) for g in row.groups}
        for update in delta.blocks_appended:
            table = self.rows[update.request_id][update.group_id]
            assert update.new_block_index <= len(table), (delta.step_id, update)
            table[update.new_block_index :] = list(update.block_ids)
        for request_id in delta.requests_freed:
            del self.rows[request_id]
        self.copies += [(delta.step_id, c.src_block_id, c.dst_block_id) for c in delta.copies]

    def block_ids(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        return {rid: tuple(tuple(groups[g]) for g in sorted(groups)) for rid, groups in self.rows.items()}


class LostResponse(grpc.RpcError):
    """What a caller sees when a call's response never arrives: the status `code`, raised by a client interceptor."""

    def __init__(self, code: grpc.StatusCode, details: str = "the response was lost on the way back") -> None:
        super().__init__(code.name)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
