"""`shared.bounds`: every string and list of every request has a limit, and a field past it is named, not echoed."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2

from kv_manager_service.shared import bounds
from kv_manager_service.shared.bounds import MAX_ID_CHARS, MAX_IDS_PER_LIST, MAX_NAME_CHARS, MAX_PATH_CHARS
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import worker_pb2 as worker_pb

SERVICES = (
    pb.DESCRIPTOR.services_by_name["KVManagerService"],
    worker_pb.DESCRIPTOR.services_by_name["WorkerService"],
)


def reachable_fields():
    """Every field of every message a request of either service can hold, once each."""
    seen, fields = set(), []
    pending = [method.input_type for service in SERVICES for method in service.methods]
    while pending:
        descriptor = pending.pop()
        if descriptor.full_name in seen:
            continue
        seen.add(descriptor.full_name)
        for field in descriptor.fields:
            fields.append(field)
            if field.message_type is not None:
                pending.append(field.message_type)
    return fields


def test_every_string_and_list_of_every_request_has_a_limit_and_every_limit_a_field():
    for service in SERVICES:
        for method in service.methods:
            bounds.plan(method.input_type)  # asserts on a field without a limit
    fields = reachable_fields()
    unbounded = [
        f.full_name
        for f in fields
        if (f.is_repeated or f.type in (f.TYPE_STRING, f.TYPE_BYTES)) and f.full_name not in bounds.LIMITS
    ]
    assert unbounded == []
    stale = set(bounds.LIMITS) - {f.full_name for f in fields}
    assert stale == set(), "limits of fields no request holds"


def test_a_new_string_field_without_a_limit_fails_the_walk():
    file = descriptor_pb2.FileDescriptorProto(name="bounds_probe.proto", package="kvcache.v1", syntax="proto3")
    message = file.message_type.add(name="ProbeRequest")
    message.field.add(name="note", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    probe = message_factory.GetMessageClass(pool.FindMessageTypeByName("kvcache.v1.ProbeRequest"))
    with pytest.raises(AssertionError, match="kvcache.v1.ProbeRequest.note has no limit"):
        bounds.violation(probe(note="x"))


def step_with_ops(*ops: pb.StepOp) -> pb.StepRequest:
    filler = [pb.StepOp(allocate=pb.AllocateRequest(request_id=f"r{i}", token_ids=[1])) for i in range(3)]
    return pb.StepRequest(ops=filler + list(ops))


def allocate_op(request_id: str) -> pb.StepOp:
    return pb.StepOp(allocate=pb.AllocateRequest(request_id=request_id))


def scheduled(*request_ids: str) -> worker_pb.ExecuteRequest:
    return worker_pb.ExecuteRequest(requests=[worker_pb.ScheduledRequest(request_id=r) for r in request_ids])


CASES = [  # (request, the path named, its size, the limit)
    (pb.AllocateRequest(request_id="x" * (1 << 20)), "request_id", 1 << 20, MAX_ID_CHARS),
    (pb.AllocateRequest(request_id="a", lora_path="p" * 2000), "lora_path", 2000, MAX_PATH_CHARS),
    (
        pb.FindCacheHitRequest(mm_features=[pb.MMFeature(identifier="i"), pb.MMFeature(identifier="i" * 600)]),
        "mm_features[1].identifier", 600, MAX_NAME_CHARS,
    ),
    (step_with_ops(allocate_op("x" * 257)), "ops[3].allocate.request_id", 257, MAX_ID_CHARS),
    (
        step_with_ops(pb.StepOp(free=pb.FreeRequest(request_ids=["a", "x" * 300]))),
        "ops[3].free.request_ids[1]", 300, MAX_ID_CHARS,
    ),
    (
        step_with_ops(pb.StepOp(fork=pb.ForkRequest(parent_request_id="p", child_request_ids=["x" * 999]))),
        "ops[3].fork.child_request_ids[0]", 999, MAX_ID_CHARS,
    ),
    (
        pb.StepRequest(decode=pb.DecodeBatch(request_ids=["a", "b", "x" * 257], token_ids=[1, 2, 3])),
        "decode.request_ids[2]", 257, MAX_ID_CHARS,
    ),
    (pb.StepRequest(idempotency_key="k" * 300), "idempotency_key", 300, MAX_ID_CHARS),
    (
        pb.FreeRequest(request_ids=["a"] * (MAX_IDS_PER_LIST + 1)),
        "request_ids", MAX_IDS_PER_LIST + 1, MAX_IDS_PER_LIST,
    ),
    (pb.GetBlockTablesRequest(request_ids=["x" * 16384]), "request_ids[0]", 16384, MAX_ID_CHARS),
    (pb.AckStepsRequest(worker_id="w" * 513), "worker_id", 513, bounds.MAX_WORKER_ID_CHARS),
    (scheduled("a", "x" * 257), "requests[1].request_id", 257, MAX_ID_CHARS),
]  # fmt: skip


@pytest.mark.parametrize("request_, path, size, limit", CASES)
def test_a_field_past_its_limit_is_named_with_its_size_and_limit_but_not_echoed(request_, path, size, limit):
    error = bounds.violation(request_)
    assert error is not None
    assert error.field == path
    unit = "entries" if path == "request_ids" else "characters"
    assert str(error) == f"{path} has {size} {unit}; the limit is {limit}"
    assert "xxxx" not in str(error)


def test_fields_at_their_limits_pass():
    at_limits = pb.AllocateRequest(request_id="x" * MAX_ID_CHARS, lora_path="p" * MAX_PATH_CHARS)
    assert bounds.violation(at_limits) is None
    assert bounds.violation(pb.FreeRequest(request_ids=["x" * MAX_ID_CHARS] * 4)) is None
    decode = pb.DecodeBatch(request_ids=[f"r{i}" for i in range(256)], token_ids=range(256))
    assert bounds.violation(pb.StepRequest(decode=decode, idempotency_key="k" * MAX_ID_CHARS)) is None
    # Lists whose bound is a server setting are checked by the handler, not here.
    assert bounds.violation(pb.StepRequest(ops=[pb.StepOp()] * 70_000)) is None


def test_messages_of_other_packages_are_not_walked():
    assert bounds.violation(health_pb2.HealthCheckRequest(service="s" * 100_000)) is None
