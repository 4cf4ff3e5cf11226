"""Every error path over real gRPC: the status code, the ErrorInfo reason and field, and that nothing changed.

One server for the module: 11 blocks of 16 tokens (10 usable), max_model_len 64
and max_num_requests 4 from --config, --max-tokens-per-call 100,
--max-ops-per-step 8 and --max-message-bytes 16384. A rejected call takes no
step id, so "nothing changed" includes GetStats.last_step_id.
"""

from __future__ import annotations

import grpc
import pytest

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateStatus, KVCacheConfig, GroupKind, GroupSpec
from kv_manager_service.shared import errors as core_errors
from kv_manager_service.server.process import ServerOptions, start_server
from kv_manager_service.server.retention import ServiceLimits
from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import (
    NO_SPACE,
    OK,
    alloc,
    assert_error,
    connect,
    last_step_id,
    op_alloc,
    op_fork,
    op_free,
    pool_config,
    read_events,
    read_steps,
    release_everything,
    rpc_error,
    snapshot,
    stats,
    step_request,
    stream_error,
    tables,
    unchanged,
)

WORKER = "errors-worker"
MAX_MODEL_LEN = 64
MAX_NUM_REQUESTS = 4
MAX_TOKENS_PER_CALL = 100
MAX_MESSAGE_BYTES = 16384

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def limited_server(module_server_factory):
    return module_server_factory.start(
        "--replica-id", "errors", "--worker-timeout-s", "3600",
        "--max-tokens-per-call", str(MAX_TOKENS_PER_CALL),
        "--max-ops-per-step", "8",
        "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        config=pool_config(11, 16, max_model_len=MAX_MODEL_LEN, max_num_requests=MAX_NUM_REQUESTS),
    )


@pytest.fixture(scope="module")
def stub(limited_server):
    channel, stub = connect(limited_server.address)
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def client(limited_server):
    with KVManagerClient(limited_server.address) as client:
        yield client


@pytest.fixture(autouse=True)
def empty_pool_after(stub):
    yield
    release_everything(stub, WORKER)


@pytest.fixture
def live(stub):
    """Two live requests: 'live' (20 tokens, all computed) and 'other' (5 tokens)."""
    assert stub.Allocate(alloc("live", range(100, 120))).status == OK
    assert stub.Allocate(alloc("other", range(200, 205))).status == OK
    return "live"


def test_limits_are_reported_by_get_config(stub):
    config = stub.GetConfig(pb.GetConfigRequest())
    assert (config.max_model_len, config.max_num_requests, config.max_tokens_per_call) == (
        MAX_MODEL_LEN, MAX_NUM_REQUESTS, MAX_TOKENS_PER_CALL
    )


# -- unknown request: NOT_FOUND ---------------------------------------------------------------

NOT_FOUND_CASES = {
    "free": ("Free", pb.FreeRequest(request_ids=["ghost"]), "request_ids"),
    "free-live-then-ghost": ("Free", pb.FreeRequest(request_ids=["live", "ghost"]), "request_ids"),
    "fork-parent": ("Fork", pb.ForkRequest(parent_request_id="ghost", child_request_ids=["kid"]), "parent_request_id"),
    "block-tables": ("GetBlockTables", pb.GetBlockTablesRequest(request_ids=["live", "ghost"]), "request_id"),
    "step-free": ("Step", step_request([op_free("ghost")]), "ops[0].request_ids"),
}


@pytest.mark.parametrize("method, request_message, field", NOT_FOUND_CASES.values(), ids=NOT_FOUND_CASES.keys())
def test_unknown_request_is_not_found(stub, live, method, request_message, field):
    with unchanged(stub):
        error = rpc_error(getattr(stub, method), request_message)
        assert_error(error, Code.NOT_FOUND, "REQUEST_NOT_FOUND", field, in_details="ghost")


def test_decode_of_an_unknown_request_is_not_found(stub, live):
    """A decode column appends a token to an existing request; an unknown id must not admit a new one."""
    with unchanged(stub):
        error = rpc_error(stub.Step, step_request(decode=[("live", 1), ("ghost", 2)]))
        assert error.code() == Code.NOT_FOUND, (error.code(), error.details())
        assert_error(error, Code.NOT_FOUND, "REQUEST_NOT_FOUND")


# -- caller mistakes: INVALID_ARGUMENT naming the field -------------------------------------------

INVALID_CASES = {
    "first-call-without-tokens": ("Allocate", alloc("new", [], 5), "token_ids", "prompt"),
    "first-call-num-new-tokens-0": ("Allocate", alloc("new", [1, 2, 3], 0), "num_new_tokens", ">= 1"),
    "continuation-num-new-tokens-0": ("Allocate", alloc("other", [1], 0), "num_new_tokens", ">= 1"),
    "prompt-longer-than-max-model-len": (
        "Allocate", alloc("new", range(MAX_MODEL_LEN + 1)), "token_ids", "max_model_len"),
    "prompt-plus-lookahead-too-long": (
        "Allocate", alloc("new", range(60), num_lookahead_tokens=5), "token_ids", "max_model_len"),
    "continuation-past-max-model-len": ("Allocate", alloc("live", range(45)), "token_ids", "max_model_len"),
    "empty-request-id": ("Allocate", alloc("", [1, 2]), "request_id", None),
    "lora-path-without-name": ("Allocate", alloc("new", [1, 2], lora_path="/adapters/a"), "lora_name", None),
    "mm-feature-past-the-prompt": (
        "Allocate", alloc("new", range(10), mm_features=[pb.MMFeature(identifier="img", offset=8, length=4)]),
        "mm_features[0]", None),
    "mm-feature-empty": (
        "Allocate", alloc("new", range(10), mm_features=[pb.MMFeature(identifier="img", offset=0, length=0)]),
        "mm_features[0]", None),
    "continuation-changes-cache-salt": ("Allocate", alloc("other", [1], cache_salt="pepper"), "cache_salt", None),
    "find-cache-hit-mm-feature-past-the-prompt": (
        "FindCacheHit",
        pb.FindCacheHitRequest(token_ids=range(4), mm_features=[pb.MMFeature(identifier="img", offset=2, length=5)]),
        "mm_features[0]", None),
    "free-nothing": ("Free", pb.FreeRequest(), "request_ids", None),
    "fork-without-children": ("Fork", pb.ForkRequest(parent_request_id="live"), "child_request_ids", None),
    "fork-empty-child-id": (
        "Fork", pb.ForkRequest(parent_request_id="live", child_request_ids=[""]), "child_request_ids", None),
    "ack-without-worker": ("AckSteps", pb.AckStepsRequest(step_id=0), "worker_id", None),
    "step-op-with-no-kind": ("Step", pb.StepRequest(ops=[pb.StepOp()]), "ops[0]", None),
    "decode-more-request-ids-than-tokens": (
        "Step", pb.StepRequest(decode=pb.DecodeBatch(request_ids=["live", "other"], token_ids=[1])),
        "decode.token_ids", None),
    "decode-more-tokens-than-request-ids": (
        "Step", pb.StepRequest(decode=pb.DecodeBatch(request_ids=["live"], token_ids=[1, 2])),
        "decode.token_ids", None),
}


@pytest.mark.parametrize("method, request_message, field, in_details", INVALID_CASES.values(), ids=INVALID_CASES.keys())
def test_invalid_argument_names_the_field(stub, live, method, request_message, field, in_details):
    with unchanged(stub):
        error = rpc_error(getattr(stub, method), request_message)
        assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", field, in_details)


# -- oversized input ---------------------------------------------------------------------------


def _assert_limit_error(error: grpc.RpcError, field: str, limit_name: str) -> None:
    """Past a limit: INVALID_ARGUMENT or RESOURCE_EXHAUSTED (the contract allows both), naming field and limit."""
    assert error.code() in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED), (error.code(), error.details())
    reason = "INVALID_ARGUMENT" if error.code() == Code.INVALID_ARGUMENT else "RESOURCE_EXHAUSTED"
    assert_error(error, error.code(), reason, field, in_details=limit_name)


def test_more_token_ids_than_max_tokens_per_call(stub, live):
    with unchanged(stub):
        _assert_limit_error(
            rpc_error(stub.Allocate, alloc("big", range(MAX_TOKENS_PER_CALL + 1))), "token_ids", "max_tokens_per_call"
        )
        # The limit is per call: two prompts that are each fine add up past it in one Step.
        two = step_request([op_alloc("p1", range(60)), op_alloc("p2", range(60))])
        _assert_limit_error(rpc_error(stub.Step, two), "token_ids", "max_tokens_per_call")
        lookup = pb.FindCacheHitRequest(token_ids=range(MAX_TOKENS_PER_CALL + 1))
        _assert_limit_error(rpc_error(stub.FindCacheHit, lookup), "token_ids", "max_tokens_per_call")


def test_more_ops_than_max_ops_per_step(stub, live):
    with unchanged(stub):
        ops = [op_alloc(f"op-{i}", [i]) for i in range(9)]
        _assert_limit_error(rpc_error(stub.Step, step_request(ops)), "ops", "max_ops_per_step")


def test_message_larger_than_max_message_bytes(stub, client, live):
    huge = [1 << 31] * 4000  # 5 bytes each: about 20 KB
    with unchanged(stub):
        error = rpc_error(stub.Allocate, alloc("huge", huge))
        assert error.code() == Code.RESOURCE_EXHAUSTED, (error.code(), error.details())
        with pytest.raises(grpc.RpcError) as raised:  # not a caller mistake of the core: passed through as is
            client.allocate("huge", huge, len(huge))
        assert raised.value.code() == Code.RESOURCE_EXHAUSTED
    assert stats(stub).num_requests == 2  # and the server still serves


# -- invalid ops inside a Step: the whole Step is rejected -------------------------------------------

STEP_CASES = {
    "valid-allocate-then-free-ghost": (
        step_request([op_alloc("v1", range(10)), op_free("ghost")]), Code.NOT_FOUND, "REQUEST_NOT_FOUND",
        "ops[1].request_ids"),
    "free-then-bad-count": (
        step_request([op_free("other"), op_alloc("v1", range(10), 0)]), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT",
        None),
    "valid-fork-then-duplicate-decode": (
        step_request([op_fork("live", "kid")], decode=[("other", 1), ("live", 2)]), Code.INVALID_ARGUMENT,
        "INVALID_ARGUMENT", None),
    "allocate-then-fork-to-existing-child": (
        step_request([op_alloc("v1", range(10)), op_fork("live", "kid", "other")]), Code.ALREADY_EXISTS,
        "REQUEST_EXISTS", "ops[1].child_request_ids"),
    "allocate-then-nothing-to-compute": (
        step_request([op_alloc("v1", range(10)), op_alloc("live", [], 1)]), Code.FAILED_PRECONDITION,
        "FAILED_PRECONDITION", None),
    "decode-then-bad-mm-feature": (
        step_request([op_alloc("v1", range(4), mm_features=[pb.MMFeature(identifier="i", offset=3, length=9)])],
                     decode=[("live", 1)]),
        Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", None),
}


@pytest.mark.parametrize("request_message, code, reason, field", STEP_CASES.values(), ids=STEP_CASES.keys())
def test_invalid_op_rejects_the_whole_step(stub, live, request_message, code, reason, field):
    with unchanged(stub):
        error = rpc_error(stub.Step, request_message)
        assert_error(error, code, reason, field)
    assert "v1" not in tables(stub) and set(tables(stub)) == {"live", "other"}


DUPLICATE_CASES = {
    "two-allocates-of-one-new-id": step_request([op_alloc("dup", [1]), op_alloc("dup", [2])]),
    "free-and-allocate-one-id": step_request([op_free("other"), op_alloc("other", [1])]),
    "fork-child-also-allocated": step_request([op_fork("live", "kid"), op_alloc("kid", [1])]),
    "fork-parent-also-freed": step_request([op_fork("live", "kid"), op_free("live")]),
    "fork-same-child-twice": step_request([op_fork("live", "kid", "kid")]),
    "nested-op-and-decode": step_request([op_alloc("other", [1])], decode=[("other", 2)]),
    "decode-twice": step_request(decode=[("other", 1), ("live", 2), ("other", 3)]),
}


@pytest.mark.parametrize("request_message", DUPLICATE_CASES.values(), ids=DUPLICATE_CASES.keys())
def test_duplicate_request_ids_in_one_step(stub, live, request_message):
    with unchanged(stub):
        error = rpc_error(stub.Step, request_message)
        assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", in_details="more than one op")
        assert error_field(error) != ""


def error_field(error: grpc.RpcError) -> str:
    return dict(error.trailing_metadata() or ()).get("kvcache-field", "")


def test_errors_inside_a_step_name_the_offending_op(stub, live):
    """Within a Step a field only helps if it says which op: ops[i].<field> (as free's errors already do),
    and decode.<column> for the decode batch."""
    with unchanged(stub):
        error = rpc_error(stub.Step, step_request([op_alloc("v1", range(10)), op_alloc("v2", range(10), 0)]))
        assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT")
        field = error_field(error)
        assert field.startswith("ops[1]") and field.endswith("num_new_tokens"), field
        error = rpc_error(stub.Step, step_request([op_alloc("v1", range(10)), op_fork("live", "other")]))
        assert_error(error, Code.ALREADY_EXISTS, "REQUEST_EXISTS")
        field = error_field(error)
        assert field.startswith("ops[1]") and field.endswith("child_request_ids"), field
        error = rpc_error(stub.Step, step_request([op_alloc("v1", range(10))], decode=[("live", 1), ("live", 2)]))
        assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT")
        field = error_field(error)
        assert field.startswith("decode."), field  # not "ops[2]": the Step has one op


def test_duplicate_ids_in_a_unary_call_name_a_field_of_that_call(stub, live):
    """A unary Free or Fork has no `ops`: a duplicate must name request_ids / child_request_ids, not "ops[0]"."""
    with unchanged(stub):
        error = rpc_error(stub.Free, pb.FreeRequest(request_ids=["other", "other"]))
        assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", "request_ids", in_details="more than one")
        error = rpc_error(stub.Fork, pb.ForkRequest(parent_request_id="live", child_request_ids=["kid", "kid"]))
        assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", "child_request_ids", in_details="more than one")


# -- ALREADY_EXISTS / FAILED_PRECONDITION / RESOURCE_EXHAUSTED / OUT_OF_RANGE ----------------------------


def test_fork_to_an_existing_child_already_exists(stub, live):
    with unchanged(stub):
        for children in (["other"], ["fresh", "other"], ["live"]):
            error = rpc_error(stub.Fork, pb.ForkRequest(parent_request_id="live", child_request_ids=children))
            assert_error(error, Code.ALREADY_EXISTS, "REQUEST_EXISTS", "child_request_ids")
    assert "fresh" not in tables(stub)


def test_continuation_with_nothing_to_compute_is_failed_precondition(stub, live):
    with unchanged(stub):
        error = rpc_error(stub.Allocate, alloc("live", [], 1))
        assert_error(error, Code.FAILED_PRECONDITION, "FAILED_PRECONDITION", "token_ids")
    # Chunked prefill: nothing is left once the last chunk is scheduled.
    stub.Allocate(alloc("chunked", range(300, 340), 32))
    assert stub.Allocate(alloc("chunked", [], 32)).num_scheduled_tokens == 8
    with unchanged(stub):
        assert_error(rpc_error(stub.Allocate, alloc("chunked", [], 32)), Code.FAILED_PRECONDITION,
                     "FAILED_PRECONDITION", "token_ids")


def test_too_many_live_requests_is_resource_exhausted(stub, live):
    stub.Allocate(alloc("third", [1]))
    stub.Allocate(alloc("fourth", [2]))
    assert stats(stub).num_requests == MAX_NUM_REQUESTS
    for method, message in [
        ("Allocate", alloc("fifth", [3])),
        ("Fork", pb.ForkRequest(parent_request_id="live", child_request_ids=["kid"])),
        ("Step", step_request([op_alloc("fifth", [3])])),
    ]:
        with unchanged(stub):
            error = rpc_error(getattr(stub, method), message)
            assert_error(error, Code.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED", in_details="max_num_requests")
    # A continuation of a live request is not a new request.
    assert stub.Allocate(alloc("third", [4])).status == OK


def test_a_step_that_frees_before_it_admits_stays_within_max_num_requests(stub, live):
    """Free 'other' then admit 'fifth' in one Step: never more than 4 live requests, so it is accepted."""
    stub.Allocate(alloc("third", [1]))
    stub.Allocate(alloc("fourth", [2]))
    response = stub.Step(step_request([op_free("other"), op_alloc("fifth", [3])]))
    assert response.results[1].allocate.status == OK
    assert set(tables(stub)) == {"live", "third", "fourth", "fifth"}


def test_ack_of_a_future_step_is_out_of_range(stub, live):
    last = last_step_id(stub)
    with unchanged(stub):
        error = rpc_error(stub.AckSteps, pb.AckStepsRequest(worker_id=WORKER, step_id=last + 1))
        assert_error(error, Code.OUT_OF_RANGE, "OUT_OF_RANGE", "step_id")


def test_watch_steps_errors(stub, live):
    last = last_step_id(stub)
    with unchanged(stub):
        error = stream_error(stub.WatchSteps, pb.WatchStepsRequest(worker_id="future", from_step_id=last + 2))
        assert_error(error, Code.OUT_OF_RANGE, "OUT_OF_RANGE", "from_step_id")
        error = stream_error(stub.WatchSteps, pb.WatchStepsRequest(from_step_id=1))
        assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", "worker_id")


# -- the typed client raises the core's typed errors ------------------------------------------------


def test_typed_client_raises_core_errors_with_the_field(client, stub, live):
    stub.Allocate(alloc("third", [1]))
    stub.Allocate(alloc("fourth", [2]))
    cases = [
        (lambda: client.free(["ghost"]), core_errors.RequestNotFoundError, "request_ids"),
        (lambda: client.block_tables(["ghost"]), core_errors.RequestNotFoundError, "request_id"),
        (lambda: client.allocate("new", [], 3), core_errors.InvalidArgumentError, "token_ids"),
        (lambda: client.allocate("other", [1], 0), core_errors.InvalidArgumentError, "num_new_tokens"),
        (lambda: client.decode(["live"], []), core_errors.InvalidArgumentError, "decode.token_ids"),
        (lambda: client.fork("live", ["other"]), core_errors.RequestExistsError, "child_request_ids"),
        (lambda: client.allocate("live", [], 1), core_errors.FailedPreconditionError, "token_ids"),
        (lambda: client.allocate("fifth", [1], 1), core_errors.ResourceExhaustedError, None),
        (lambda: client.ack_steps(WORKER, 10**9), core_errors.OutOfRangeError, "step_id"),
    ]
    with unchanged(stub):
        for call, kind, field in cases:
            with pytest.raises(kind) as raised:
                call()
            assert type(raised.value) is kind
            if field is not None:
                assert raised.value.field == field, (kind, raised.value.field)
            assert str(raised.value)  # the server's message


# -- NO_SPACE is a result, not an error -----------------------------------------------------------------


def test_no_space_is_a_result_that_changes_nothing_but_takes_a_step_id(stub, client):
    for i in range(3):
        assert stub.Allocate(alloc(f"big-{i}", range(1000 * i, 1000 * i + 48))).status == OK  # 3 blocks each
    before = snapshot(stub)
    admit = stub.Allocate(alloc("late", range(5000, 5040)))  # 3 blocks, 1 free
    assert admit.status == NO_SPACE and admit.step_id == before["stats"]["last_step_id"] + 1
    assert (admit.num_computed_tokens, admit.num_scheduled_tokens, list(admit.groups), list(admit.copies)) == (0, 0, [], [])
    typed = client.allocate("late", range(5000, 5040), 40)
    assert typed.status is AllocateStatus.NO_SPACE and typed.step_id == admit.step_id + 1
    after = snapshot(stub)
    assert after["stats"]["last_step_id"] == typed.step_id and after["tables_step_id"] == typed.step_id
    for state in (before, after):
        state["stats"].pop("last_step_id")
        state.pop("tables_step_id")
    assert after == before

    # A continuation: big-0 sits at a block boundary and the pool has one block left.
    assert stub.Allocate(alloc("small", [7])).status == OK  # takes the last block
    before = snapshot(stub)
    decode = stub.Step(step_request([op_alloc("big-1", [9])], decode=[("big-0", 8)]))
    assert decode.results[0].allocate.status == NO_SPACE and list(decode.decode.statuses) == [NO_SPACE]
    assert list(decode.decode.num_computed_tokens) == [48] and list(decode.decode.changes) == []
    after = snapshot(stub)
    assert after["stats"]["last_step_id"] == decode.step_id == before["stats"]["last_step_id"] + 1
    for state in (before, after):
        state["stats"].pop("last_step_id")
        state.pop("tables_step_id")
    assert after == before
    # The token of a NO_SPACE call was not kept: resent after making room, it is the 49th token.
    stub.Free(pb.FreeRequest(request_ids=["small"]))
    again = stub.Allocate(alloc("big-0", [8]))
    assert (again.status, again.num_computed_tokens, again.num_scheduled_tokens) == (OK, 48, 1)
    assert tables(stub, "big-0")["big-0"][0] == 49
    assert_error(rpc_error(stub.Allocate, alloc("big-0", [], 1)), Code.FAILED_PRECONDITION, "FAILED_PRECONDITION")


# -- streams from a position no longer retained (in-process: the CLI has no retention flags) -------------


def test_streams_from_a_dropped_position_are_out_of_range():
    config = KVCacheConfig(num_blocks=16, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),))
    running = start_server(
        config, ServerOptions(port=0, replica_id="tiny", limits=ServiceLimits(step_retention=2, event_retention=2))
    )
    try:
        channel, stub = connect(running.address)
        with channel:
            for i in range(4):  # four steps, each caching one block: four events
                assert stub.Allocate(alloc(f"r{i}", range(10 * i, 10 * i + 4))).status == OK
            s = stats(stub)
            assert (s.last_step_id, s.last_event_sequence) == (4, 4)
            with unchanged(stub):
                for first in (1, 2):
                    error = stream_error(stub.WatchSteps, pb.WatchStepsRequest(worker_id="late", from_step_id=first))
                    assert_error(error, Code.OUT_OF_RANGE, "OUT_OF_RANGE", "from_step_id", "no longer retained")
                    error = stream_error(stub.WatchEvents, pb.WatchEventsRequest(from_sequence=first))
                    assert_error(error, Code.OUT_OF_RANGE, "OUT_OF_RANGE", "from_sequence", "no longer retained")
                    error = stream_error(stub.WatchEventBatches, pb.WatchEventBatchesRequest(from_sequence=first))
                    assert_error(error, Code.OUT_OF_RANGE, "OUT_OF_RANGE", "from_sequence", "no longer retained")
            # What is retained still streams.
            assert [e.sequence for e in read_events(stub, 3, 2)] == [3, 4]
            assert [e.sequence for e in read_events(stub, 0, 2)] == [3, 4]  # 0: everything still retained
            # Last: a worker that joins empties the cache (one more event).
            assert [d.step_id for d in read_steps(stub, "late", 3, 2)] == [3, 4]
    finally:
        running.stop(0)


def test_watch_steps_from_zero_streams_what_is_retained():
    """from_step_id 0 means 'everything still retained' (as WatchEvents' 0 does), not step 1."""
    config = KVCacheConfig(num_blocks=16, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),))
    running = start_server(config, ServerOptions(port=0, replica_id="tiny", limits=ServiceLimits(step_retention=2)))
    try:
        channel, stub = connect(running.address)
        with channel:
            for i in range(4):
                stub.Allocate(alloc(f"r{i}", range(10 * i, 10 * i + 4)))
            assert [d.step_id for d in read_steps(stub, "fresh", 0, 2)] == [3, 4]
    finally:
        running.stop(0)
