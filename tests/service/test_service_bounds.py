"""Every input that costs the server memory is bounded: ids and other strings, lists, and what the logs keep.

Against a real `kv-manager serve`: oversized strings are refused before any
handler (INVALID_ARGUMENT naming the field and the limit, never echoing the
value, in a small status and small log lines), and a server fed with
oversized ids, or with keyed Steps whose deltas, events and responses it
logs and remembers, keeps a flat resident set once its byte retentions are
full. Without the bounds each of these grows the server by tens to hundreds
of MiB over the same calls.
"""

from __future__ import annotations

import grpc
from processes import log_records
from svc_support import (
    CALL_TIMEOUT_S,
    alloc,
    assert_error,
    connect,
    op_alloc,
    op_free,
    pool_config,
    rpc_error,
    stats,
    step_request,
    stream_error,
)

from kv_manager_service.shared.bounds import MAX_ID_CHARS
from kvcache.v1 import kv_manager_pb2 as pb

HUGE = "x" * (1 << 20)
MAX_LOG_LINE_CHARS = 4096
RSS_MARGIN_MIB = 16  # growth allowed once the retentions are full; without the bounds: 40 MiB and more


def rss_mib(pid: int) -> float:
    """The resident set of process `pid` (VmRSS), in MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def assert_refused(error: grpc.RpcError, field: str) -> None:
    assert_error(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", field, in_details="the limit is")
    assert "xxxx" not in error.details() and len(error.details()) < 200


def test_oversized_strings_are_refused_in_every_call_naming_the_field_without_echoing_it(server_factory):
    server = server_factory.start(config=pool_config(64))
    channel, stub = connect(server.address)
    with channel:
        assert_refused(rpc_error(stub.Allocate, alloc(HUGE, [1] * 16)), "request_id")
        assert_refused(rpc_error(stub.Allocate, alloc("r", [1] * 16, cache_salt=HUGE)), "cache_salt")
        fork = pb.ForkRequest(parent_request_id="p", child_request_ids=["c", HUGE])
        assert_refused(rpc_error(stub.Fork, fork), "child_request_ids[1]")
        lookup = pb.FindCacheHitRequest(token_ids=[1], lora_name="l", lora_path=HUGE)
        assert_refused(rpc_error(stub.FindCacheHit, lookup), "lora_path")
        nested = step_request([op_alloc("a", [1] * 16), op_alloc(HUGE, [2] * 16)])
        assert_refused(rpc_error(stub.Step, nested), "ops[1].allocate.request_id")
        assert_refused(rpc_error(stub.Step, step_request(decode=[("a", 1), (HUGE, 2)])), "decode.request_ids[1]")
        assert_refused(rpc_error(stub.Step, pb.StepRequest(idempotency_key=HUGE)), "idempotency_key")
        assert_refused(rpc_error(stub.GetBlockTables, pb.GetBlockTablesRequest(request_ids=[HUGE])), "request_ids[0]")
        assert_refused(rpc_error(stub.AckSteps, pb.AckStepsRequest(worker_id=HUGE, step_id=0)), "worker_id")
        assert_refused(stream_error(stub.WatchSteps, pb.WatchStepsRequest(worker_id=HUGE)), "worker_id")
        # A Free of an unknown 16 KiB id is refused by its size, not by the size of the status it would echo.
        assert_refused(rpc_error(stub.Free, pb.FreeRequest(request_ids=["y" * 16384])), "request_ids[0]")
        unknown = rpc_error(stub.Free, pb.FreeRequest(request_ids=["y" * MAX_ID_CHARS]))
        assert_error(unknown, grpc.StatusCode.NOT_FOUND, "REQUEST_NOT_FOUND", "request_ids")
        assert stats(stub).last_step_id == 0  # nothing was applied
    lines = server.log().splitlines()
    assert max(map(len, lines)) < MAX_LOG_LINE_CHARS
    rejected = [r for r in log_records(server) if "rejected" in r["msg"]]
    assert len(rejected) == 12 and {r["field"] for r in rejected} >= {"request_id", "decode.request_ids[1]"}


def test_calls_with_1_mib_ids_leave_the_resident_set_flat(server_factory):
    """Before the bounds, 200 Allocate+Free pairs with 1 MiB ids grew the server by 400 MiB (the step log kept them)."""
    server = server_factory.start("--log-level", "WARNING", config=pool_config(64))
    channel, stub = connect(server.address)

    def pairs(start: int, stop: int) -> None:
        for index in range(start, stop):
            request_id = f"{index:08d}" + HUGE
            free = pb.FreeRequest(request_ids=[request_id])
            for call, request in ((stub.Allocate, alloc(request_id, [1] * 16)), (stub.Free, free)):
                try:
                    call(request, timeout=CALL_TIMEOUT_S)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()

    with channel:
        pairs(0, 15)
        warm = rss_mib(server.pid)
        pairs(15, 75)  # 120 MiB of ids
        grown = rss_mib(server.pid) - warm
    assert grown < RSS_MARGIN_MIB, f"the server grew by {grown:.0f} MiB over 60 Allocate+Free pairs with 1 MiB ids"


def test_keyed_steps_with_big_ops_leave_the_resident_set_flat_once_the_retentions_are_full(server_factory):
    """Each Step logs a ~0.6 MB delta and ~1,000 events and remembers an ~18 KB response; the byte
    retentions (4 MiB, 4 MiB, 512 KiB here; 100,000 entries each) drop the oldest."""
    server = server_factory.start(
        "--log-level", "WARNING",
        "--step-retention-bytes", str(4 << 20),
        "--event-retention-bytes", str(4 << 20),
        "--idempotency-retention-bytes", str(512 << 10),
        config=pool_config(16384),
    )  # fmt: skip
    num_requests = 1024
    channel, stub = connect(server.address)

    def batch(round_: int) -> list[str]:
        return [f"{round_:06d}-{j:06d}-".ljust(MAX_ID_CHARS, "r") for j in range(num_requests)]

    def keyed_step(round_: int) -> pb.StepRequest:
        first_token = round_ * num_requests * 32
        tokens = [range(first_token + 32 * j, first_token + 32 * (j + 1)) for j in range(num_requests)]
        ops = [op_alloc(request_id, token_ids) for request_id, token_ids in zip(batch(round_), tokens)]
        if round_ > 0:
            ops.append(op_free(*batch(round_ - 1)))
        request = step_request(ops)
        request.idempotency_key = f"round-{round_}"
        return request

    with channel:
        responses = [stub.Step(keyed_step(round_), timeout=60) for round_ in range(20)]
        warm = rss_mib(server.pid)
        responses += [stub.Step(keyed_step(round_), timeout=60) for round_ in range(20, 60)]
        grown = rss_mib(server.pid) - warm

        # The logs dropped entries by their bytes, long before their 100,000-entry retentions.
        last = stats(stub)
        assert last.last_step_id == 60
        behind = pb.WatchStepsRequest(worker_id="w", from_step_id=last.last_step_id - 20)
        error = stream_error(stub.WatchSteps, behind)
        assert_error(error, grpc.StatusCode.OUT_OF_RANGE, "OUT_OF_RANGE", "from_step_id")
        error = stream_error(stub.WatchEvents, pb.WatchEventsRequest(from_sequence=last.last_event_sequence - 20_000))
        assert_error(error, grpc.StatusCode.OUT_OF_RANGE, "OUT_OF_RANGE", "from_sequence")
        # The key memory kept the newest keys only: the last is answered from it, the first is applied anew.
        assert stub.Step(keyed_step(59), timeout=60) == responses[59]
        stub.Step(pb.StepRequest(ops=[op_free(*batch(59))]), timeout=60)
        assert stub.Step(keyed_step(0), timeout=60).step_id == 62
    assert grown < RSS_MARGIN_MIB, f"the server grew by {grown:.0f} MiB over 40 keyed Steps after its retentions filled"
