"""Bad input against a live server: hypothesis-built requests of every RPC, and raw bytes as requests.

One `kv-manager serve --check-invariants` process for the module (the core's
whole-state check after every mutating call, accepted or refused: a broken
invariant is logged as "bug in ..." and answered INTERNAL). A hybrid pool
(full attention, sliding window, mamba, cross-attention; 320 blocks of 1-2
tokens) with small limits, so that requests hit every refusal:
max_model_len, max_num_requests, --max-tokens-per-call, --max-ops-per-step
and --max-message-bytes. Requests carry no enum field; invalid enum values,
like every other malformed encoding, come with the raw bytes.

Every call must end OK, or with a caller-mistake status carrying the
service's ErrorInfo (gRPC's own message-size RESOURCE_EXHAUSTED aside);
never INTERNAL, UNKNOWN or UNAVAILABLE. A refused call must leave the
observable state (GetStats, last step and event included; every block
table; pending copies) as it was. Each test is bounded by `max_examples`
and by a wall-clock budget, past which its remaining examples do nothing;
the server's state carries over from one example to the next (there is no
shrinking: a failure names the call and the request). To fuzz longer, scale
both: `KVCACHE_FUZZ_SCALE=20 pytest tests/service/test_service_fuzz.py` (the
`thorough` Hypothesis profile scales them by 10).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any, Callable

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig
from kv_manager_service.server.process import ServerOptions, start_server
from kv_manager_service.shared.status import ERROR_DOMAIN, error_info
from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import CALL_TIMEOUT_S, connect, read_steps, register_worker, snapshot

SERVICE = pb.DESCRIPTOR.services_by_name["KVManagerService"]
METHODS = {method.name: method for method in SERVICE.methods}
STREAMS = {name for name, method in METHODS.items() if method.server_streaming}

REQUEST_IDS = ["a", "b", "c", "d", "e", "f", "g", "h"]  # a small pool, so calls meet live requests
WORKER_IDS = ["w1", "w2"]  # the only workers that register, so that copies can still be released
KEYS = ["k1", "k2", "k3"]
MAX_MODEL_LEN = 96
MAX_TOKENS_PER_CALL = 200
MAX_OPS_PER_STEP = 8
MAX_MESSAGE_BYTES = 1024
# Small blocks: a response names many blocks, and can be larger than the request that caused it.
POOL = {
    "num_blocks": 320,
    "groups": [
        {"kind": "full_attention", "block_size": 2},
        {"kind": "sliding_window", "block_size": 1, "sliding_window": 6},
        {"kind": "mamba", "block_size": 2},
        {"kind": "cross_attention", "block_size": 2},
    ],
    "max_model_len": MAX_MODEL_LEN,
    "max_num_requests": 6,
}

CALLER_MISTAKES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
ACK_EVERY_CALLS = 16  # the workers acknowledge every step this often, so copies do not hold the pool
# Multiplies the budgets and max_examples; by default it follows the Hypothesis profile (see tests/conftest.py):
# 1 under `default`, 10 under `thorough`.
SCALE = float(os.environ.get("KVCACHE_FUZZ_SCALE") or settings.default.max_examples / 100)
STREAM_WAIT_S = 0.05  # a watch that has nothing to send yet is cancelled after this long (no assertion on it)


# -- strategies: every request message -------------------------------------------------

request_ids = st.one_of(
    st.sampled_from(REQUEST_IDS), st.sampled_from(REQUEST_IDS), st.sampled_from(["", "z"]), st.text(max_size=4)
)
token_ids = st.one_of(
    st.integers(0, 40), st.integers(0, 40), st.sampled_from([0, 1 << 31, UINT32_MAX]), st.integers(0, UINT32_MAX)
)
# Mostly short lists; some past max_model_len, --max-tokens-per-call or, rarely (gRPC is slow
# to refuse one), --max-message-bytes (built cheaply: one id repeated).
token_lists = st.one_of(
    st.lists(token_ids, max_size=24),
    st.lists(token_ids, max_size=24),
    st.lists(token_ids, max_size=24),
    st.lists(token_ids, max_size=24),
    st.builds(lambda n, t: [t] * n, st.integers(60, 240), st.integers(0, 40)),
    st.builds(lambda n, t: [t] * n, st.integers(60, 300), token_ids),
)
small_counts = st.one_of(st.integers(0, 24), st.just(0), st.just(0))
counts = st.one_of(
    st.integers(0, 30), st.integers(0, 30), st.sampled_from([1 << 31, UINT32_MAX]), st.integers(0, UINT32_MAX)
)
extras = st.sampled_from(["", "", "", "x", "y"])
mm_features = st.lists(
    st.builds(pb.MMFeature, identifier=st.sampled_from(["", "img", "img", "snd"]), offset=counts, length=counts),
    max_size=2,
)
wild_allocate_requests = st.builds(
    pb.AllocateRequest,
    request_id=request_ids,
    token_ids=token_lists,
    num_new_tokens=counts,
    num_lookahead_tokens=small_counts,
    num_encoder_tokens=small_counts,
    cache_salt=extras,
    lora_name=extras,
    lora_path=extras,
    mm_features=st.one_of(st.just([]), st.just([]), mm_features),
    skip_prefix_cache=st.booleans(),
)
# Mostly acceptable: a prompt, or the next few tokens of a live request, from a small vocabulary
# (so prompts share prefixes and hit the cache), sometimes with a lookahead.
plausible_allocate_requests = st.builds(
    pb.AllocateRequest,
    request_id=st.sampled_from(REQUEST_IDS),
    token_ids=st.lists(st.integers(0, 3), max_size=20),
    num_new_tokens=st.integers(1, 24),
    num_lookahead_tokens=st.one_of(st.just(0), st.just(0), st.integers(0, 4)),
)
allocate_requests = st.one_of(plausible_allocate_requests, plausible_allocate_requests, wild_allocate_requests)
pool_id_lists = st.lists(st.sampled_from(REQUEST_IDS), min_size=1, max_size=2, unique=True)
free_requests = st.one_of(
    st.builds(pb.FreeRequest, request_ids=pool_id_lists),
    st.builds(pb.FreeRequest, request_ids=st.lists(request_ids, max_size=3)),
    st.builds(
        pb.FreeRequest, request_ids=pool_id_lists, num_computed_tokens=st.lists(st.integers(0, 20), max_size=3)
    ),
)
fork_requests = st.one_of(
    st.builds(pb.ForkRequest, parent_request_id=st.sampled_from(REQUEST_IDS), child_request_ids=pool_id_lists),
    st.builds(pb.ForkRequest, parent_request_id=request_ids, child_request_ids=st.lists(request_ids, max_size=3)),
)
step_ops = st.one_of(
    st.builds(pb.StepOp, allocate=allocate_requests),
    st.builds(pb.StepOp, allocate=allocate_requests),
    st.builds(pb.StepOp, free=free_requests),
    st.builds(pb.StepOp, fork=fork_requests),
    st.just(pb.StepOp()),  # sets none of allocate, free, fork
)


def _decode_batch(
    pairs: list[tuple[str, int]], extra_request_ids: list[str], extra_token_ids: list[int]
) -> pb.DecodeBatch:
    return pb.DecodeBatch(
        request_ids=[r for r, _ in pairs] + extra_request_ids, token_ids=[t for _, t in pairs] + extra_token_ids
    )


decode_batches = st.one_of(
    st.builds(_decode_batch, st.lists(st.tuples(request_ids, token_ids), max_size=6), st.just([]), st.just([])),
    # mismatched columns
    st.builds(_decode_batch, st.just([]), st.lists(request_ids, max_size=3), st.lists(token_ids, max_size=3)),
)
plausible_decode_batches = st.lists(st.tuples(st.sampled_from(REQUEST_IDS), st.integers(0, 3)), max_size=3).map(
    lambda pairs: _decode_batch(list(dict(pairs).items()), [], [])  # one entry per request
)
step_requests = st.builds(
    pb.StepRequest,
    ops=st.one_of(
        st.lists(step_ops, max_size=2),
        st.lists(step_ops, max_size=2),
        st.lists(step_ops, max_size=MAX_OPS_PER_STEP + 2),
    ),
    decode=st.one_of(st.none(), plausible_decode_batches, plausible_decode_batches, decode_batches),
    idempotency_key=st.one_of(st.just(""), st.just(""), st.sampled_from(KEYS), st.text(min_size=250, max_size=300)),
)
find_cache_hit_requests = st.builds(
    pb.FindCacheHitRequest,
    token_ids=token_lists,
    cache_salt=extras,
    lora_name=extras,
    lora_path=extras,
    mm_features=st.one_of(st.just([]), mm_features),
    cluster=st.booleans(),
)
step_ids = st.one_of(st.integers(0, 400), st.just(UINT64_MAX))
worker_ids = st.sampled_from(["", *WORKER_IDS])

STRATEGIES: dict[str, st.SearchStrategy] = {
    "GetConfig": st.just(pb.GetConfigRequest()),
    "Allocate": allocate_requests,
    "Free": free_requests,
    "Fork": fork_requests,
    "FindCacheHit": find_cache_hit_requests,
    "Step": step_requests,
    "GetBlockTables": st.builds(pb.GetBlockTablesRequest, request_ids=st.lists(request_ids, max_size=3)),
    "WatchSteps": st.builds(
        pb.WatchStepsRequest, worker_id=worker_ids, from_step_id=step_ids, incarnation=st.sampled_from([0, 1, 2])
    ),
    "AckSteps": st.builds(pb.AckStepsRequest, worker_id=worker_ids, step_id=step_ids),
    "ReportMissingKV": st.builds(
        pb.ReportMissingKVRequest,
        worker_id=worker_ids,
        incarnation=st.sampled_from([0, 1, 2]),
        step_id=step_ids,
        device_block_ids=st.lists(st.integers(0, 40), max_size=4),
        host_block_ids=st.lists(st.integers(0, 4), max_size=2),
        request_ids=st.lists(request_ids, max_size=3),
        cause=st.sampled_from(list(pb.KVLossCause.values())),
    ),
    "UnregisterWorker": st.builds(pb.UnregisterWorkerRequest, worker_id=worker_ids),
    "ResetPrefixCache": st.just(pb.ResetPrefixCacheRequest()),
    "GetStats": st.just(pb.GetStatsRequest()),
    "WatchEvents": st.builds(pb.WatchEventsRequest, from_sequence=st.one_of(st.integers(0, 100), st.just(UINT64_MAX))),
    "WatchEventBatches": st.builds(
        pb.WatchEventBatchesRequest,
        from_sequence=st.one_of(st.integers(0, 100), st.just(UINT64_MAX)),
        max_events_per_message=st.one_of(st.integers(0, 4), st.just(2**32 - 1)),
    ),
}
# Mutations more often than reads.
WEIGHTED_METHODS = sorted(METHODS) + ["Step"] * 6 + ["Allocate", "Free", "Fork"] * 4 + ["AckSteps"] * 2


def calls(names: list[str]) -> st.SearchStrategy[tuple[str, Any]]:
    return st.sampled_from(names).flatmap(lambda name: STRATEGIES[name].map(lambda request: (name, request)))


# -- strategies: bytes ----------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire_type: int, payload: Any) -> bytes:
    tag = _varint((number << 3) | wire_type)
    if wire_type == 0:
        return tag + _varint(payload)
    if wire_type == 2:
        declared_length, data = payload
        return tag + _varint(declared_length) + data
    return tag + payload  # fixed64, fixed32, group markers and invalid wire types: raw bytes


def _wire_fields(nested: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    numbers = st.one_of(st.integers(1, 12), st.integers(1, 12), st.sampled_from([0, 19000, (1 << 29) - 1]))
    length_delimited = st.one_of(nested, st.binary(max_size=12), st.text(max_size=8).map(str.encode)).flatmap(
        lambda data: st.tuples(st.sampled_from([len(data), len(data), len(data) + 3, UINT32_MAX]), st.just(data))
    )
    field = st.one_of(
        st.tuples(numbers, st.just(0), st.one_of(st.integers(0, 300), st.sampled_from([UINT32_MAX + 1, UINT64_MAX]))),
        st.tuples(numbers, st.just(2), length_delimited),
        st.tuples(numbers, st.sampled_from([1, 3, 4, 5, 6, 7]), st.binary(max_size=8)),
    )
    return st.lists(field, max_size=6).map(lambda fields: b"".join(_field(*f) for f in fields))


# Protobuf wire format, well-formed or not: unknown fields, wrong wire types, varints past
# uint32, lengths past the end, groups, invalid UTF-8 in strings, nested messages.
wire_messages = st.recursive(st.just(b""), _wire_fields, max_leaves=12)


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, position, value in edits:
        at = position % (len(out) + 1)
        if kind == 0 and out:  # overwrite a byte
            out[at % len(out)] = value
        elif kind == 1:  # insert a byte
            out.insert(at, value)
        elif kind == 2:  # cut the tail
            del out[at:]
        elif kind == 3 and out:  # drop a byte
            del out[at % len(out)]
    return bytes(out)


def request_bytes(name: str) -> st.SearchStrategy[bytes]:
    """Bytes sent as `name`'s request: random, wire-format, and mutations of a valid request."""
    edits = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4)
    mutated = st.builds(_mutate, STRATEGIES[name].map(lambda m: m.SerializeToString()), edits)
    return st.one_of(st.binary(max_size=48), wire_messages, mutated, mutated)


def byte_calls(names: list[str]) -> st.SearchStrategy[tuple[str, bytes]]:
    return st.sampled_from(names).flatmap(lambda name: request_bytes(name).map(lambda data: (name, data)))


# -- the driver -------------------------------------------------------------------------


class Budget:
    """A wall-clock budget for one test; past it, the remaining examples do nothing."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: float | None = None

    def spent(self) -> bool:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        return now - self.started > self.seconds


class Fuzzer:
    """Sends calls, classifies each outcome, and checks that refused calls changed nothing."""

    def __init__(self, channel: grpc.Channel, stub: Any) -> None:
        self.channel = channel
        self.stub = stub
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self._state: dict[str, Any] | None = None  # the snapshot, while it is known to be current
        self.num_calls = 0
        self.raw = {
            name: (channel.unary_stream if name in STREAMS else channel.unary_unary)(
                f"/{SERVICE.full_name}/{name}", request_serializer=None, response_deserializer=None
            )
            for name in METHODS
        }

    def call(self, name: str, request: Any) -> None:
        """One call of `name` with `request` (a message, or bytes sent as they are)."""
        self.num_calls += 1
        if self.num_calls % ACK_EVERY_CALLS == 0:
            self.ack_everything()
        method = self.raw[name] if isinstance(request, bytes) else getattr(self.stub, name)
        before = self._state or snapshot(self.stub)
        self._state = None
        if name in STREAMS:
            error = self._first_of_stream(method, request)
        else:
            try:
                method(request, timeout=CALL_TIMEOUT_S)
                error = None
            except grpc.RpcError as e:
                error = e
        code = grpc.StatusCode.OK if error is None else error.code()
        self.outcomes[(name, code.name)] += 1
        if error is None or code is grpc.StatusCode.CANCELLED and name in STREAMS:
            return  # accepted (or a watch still waiting for news): the state may change
        described = f"{name}({request!r})"
        assert code in CALLER_MISTAKES, f"{described} ended {code.name}: {error.details()}"
        info = error_info(error)
        if info is None:
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (error.details() or ""), (
                f"{described} ended {code.name} without an ErrorInfo: {error.details()}"
            )
        else:
            assert info.domain == ERROR_DOMAIN and info.reason, (described, info)
        after = snapshot(self.stub)
        assert after == before, (
            f"{described} was refused ({code.name}: {error.details()}) but changed the state:\n"
            f"before {before}\nafter  {after}"
        )
        self._state = after

    def ack_everything(self) -> None:
        """What the workers do: acknowledge every step, which releases the pending copies' blocks."""
        for worker_id in WORKER_IDS:
            register_worker(self.stub, worker_id)  # if it never followed the steps
        last = self.stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S).last_step_id
        for worker_id in WORKER_IDS:
            self.stub.AckSteps(pb.AckStepsRequest(worker_id=worker_id, step_id=last), timeout=CALL_TIMEOUT_S)
        self._state = None

    @staticmethod
    def _first_of_stream(method: Callable, request: Any) -> grpc.RpcError | None:
        """Open a watch and wait for its first item or its error; cancel it after STREAM_WAIT_S of silence."""
        stream = method(request, timeout=CALL_TIMEOUT_S)
        timer = threading.Timer(STREAM_WAIT_S, stream.cancel)
        timer.start()
        try:
            next(stream)
            return None
        except StopIteration:
            return None
        except grpc.RpcError as error:
            return error
        finally:
            timer.cancel()
            stream.cancel()


@pytest.fixture(scope="module")
def fuzz_server(module_server_factory):
    return module_server_factory.start(
        "--replica-id", "fuzz",
        "--check-invariants",
        "--max-tokens-per-call", str(MAX_TOKENS_PER_CALL),
        "--max-ops-per-step", str(MAX_OPS_PER_STEP),
        "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        "--idempotency-retention", "16",
        "--worker-timeout-s", "3600",  # no expiry releases copies between a call's before and after
        config=POOL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fuzzer(fuzz_server):
    channel, stub = connect(fuzz_server.address)
    yield Fuzzer(channel, stub)
    channel.close()


def test_every_rpc_has_a_strategy():
    assert set(STRATEGIES) == set(METHODS)


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=int(max_examples * SCALE),
        deadline=None,
        phases=(Phase.generate,),  # no shrinking: the server's state carries over between examples
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# About 2/3 of each budget on this project's 2-core machine; the budget cuts a slower run short.
STRUCTURED_BUDGET = Budget(14.0 * SCALE)


@fuzz_settings(max_examples=500)
@given(st.lists(calls(WEIGHTED_METHODS), min_size=1, max_size=8))
def test_generated_requests_never_break_the_server(fuzzer, sequence):
    if STRUCTURED_BUDGET.spent():
        return
    for name, request in sequence:
        fuzzer.call(name, request)


BYTES_BUDGET = Budget(6.0 * SCALE)


@fuzz_settings(max_examples=500)
@given(st.lists(byte_calls(sorted(METHODS)), min_size=1, max_size=4))
def test_random_bytes_as_requests_never_break_the_server(fuzzer, sequence):
    if BYTES_BUDGET.spent():
        return
    for name, data in sequence:
        fuzzer.call(name, data)


@pytest.mark.parametrize(
    "name, data",
    [(name, b"\xff") for name in sorted(METHODS)]  # a truncated varint: no method can parse it
    + [("Step", b"\x1a\x02\xff\xfe"), ("Allocate", b"\x0a\x02\xc3\x28")],  # invalid UTF-8 in a string field
)
def test_unparseable_bytes_are_invalid_argument(fuzzer, name, data):
    """Not gRPC's INTERNAL ("Exception deserializing request!"): the caller's mistake, with an ErrorInfo."""
    before = snapshot(fuzzer.stub)
    method = fuzzer.raw[name]
    with pytest.raises(grpc.RpcError) as raised:
        if name in STREAMS:
            next(method(data, timeout=CALL_TIMEOUT_S))
        else:
            method(data, timeout=CALL_TIMEOUT_S)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    info = error_info(raised.value)
    assert info.domain == ERROR_DOMAIN and info.reason == "INVALID_ARGUMENT" and info.metadata["field"] == "request"
    assert f"not a valid {name} request" in raised.value.details()
    assert snapshot(fuzzer.stub) == before


def test_a_varint_past_uint32_is_truncated_like_any_protobuf_parser_does(fuzzer):
    """num_new_tokens (uint32) sent as a 64-bit varint: protobuf keeps the low 32 bits (here
    0xFFFFFFFF), and the core refuses the count as it would any other."""
    data = b"\x0a\x01q\x12\x01\x05\x18" + _varint(UINT64_MAX)
    assert pb.AllocateRequest.FromString(data).num_new_tokens == UINT32_MAX
    fuzzer.call("Allocate", data)


def test_the_server_survived_with_its_invariants(fuzz_server, fuzzer):
    """Alive, no bug logged, and the final state passes the invariant check (AckSteps is a
    mutation: with --check-invariants it checks the whole core before answering)."""
    assert fuzz_server.process.poll() is None, fuzz_server.log()
    fuzzer.ack_everything()
    log = fuzz_server.log()
    assert "bug in" not in log and "Traceback" not in log, log[-4000:]
    # The Step fuzzer, when it ran in this process (test processes share out a module's tests), reached
    # past the first refusal (nothing here depends on how many examples ran).
    steps = {code: n for (name, code), n in fuzzer.outcomes.items() if name == "Step"}
    if steps:
        print("Step outcomes:", dict(sorted(steps.items())))
        assert steps.get("OK") and sum(n for code, n in steps.items() if code != "OK"), steps


# -- the flag itself ------------------------------------------------------------------------


def test_check_invariants_turns_a_corrupt_core_into_internal(caplog):
    """With the flag, a mutation that leaves (here: finds) the core corrupt is logged as a bug and
    answered INTERNAL; without it the same call succeeds."""
    for check in (True, False):
        running = start_server(KVCacheConfig(num_blocks=8), ServerOptions(check_invariants=check))
        channel, stub = connect(running.address)
        try:
            stub.Allocate(
                pb.AllocateRequest(request_id="a", token_ids=range(8), num_new_tokens=8), timeout=CALL_TIMEOUT_S
            )
            register_worker(stub, "w")
            running.replica.manager.pool.blocks[7].ref_cnt += 1  # a block with a holder it does not have
            caplog.clear()
            if check:
                with pytest.raises(grpc.RpcError) as raised:
                    stub.AckSteps(pb.AckStepsRequest(worker_id="w", step_id=1), timeout=CALL_TIMEOUT_S)
                assert raised.value.code() is grpc.StatusCode.INTERNAL
                assert "bug in AckSteps" in caplog.text and "ref_cnt" in caplog.text
            else:
                stub.AckSteps(pb.AckStepsRequest(worker_id="w", step_id=1), timeout=CALL_TIMEOUT_S)
                assert "bug in" not in caplog.text
        finally:
            channel.close()
            running.stop(0)


# -- what the fuzzer found ------------------------------------------------------------------


def test_a_response_larger_than_max_message_bytes_is_still_sent():
    """The limit bounds requests only. It used to bound responses too: an Allocate whose response
    (one id per 1-token block) outgrew it was applied, then answered RESOURCE_EXHAUSTED, a refusal
    that had changed the state; and a worker could never receive that step's delta."""
    config = KVCacheConfig(num_blocks=400, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 1),))
    running = start_server(config, ServerOptions(max_message_bytes=256))
    channel, stub = connect(running.address)
    try:
        request = pb.AllocateRequest(request_id="a", token_ids=[7] * 200, num_new_tokens=200)
        assert request.ByteSize() < 256
        response = stub.Allocate(request, timeout=CALL_TIMEOUT_S)
        assert response.status == pb.ALLOCATE_STATUS_OK and response.ByteSize() > 256
        assert len(response.groups[0].new_block_ids) == 200
        (delta,) = read_steps(stub, "w", 1, 1)
        assert list(delta.rows_added[0].groups[0].block_ids) == list(response.groups[0].new_block_ids)
    finally:
        channel.close()
        running.stop(0)
