"""Cache validity through a real `kv-manager serve --check-invariants`: what a worker's incarnation and
its reports of missing KV do to the prefix cache and to live requests, and what a scheduler then sees.

The workers here are the contract's messages sent by hand (a WatchSteps stream with an incarnation,
ReportMissingKV); tests/gpu_worker/test_cache_validity.py runs the real worker.
"""

from __future__ import annotations

import json
import os
import sys

import grpc
import pytest
from svc_support import (
    alloc,
    assert_error,
    connect,
    op_alloc,
    op_fork,
    op_free,
    pool_config,
    read_steps,
    rpc_error,
    stats,
    step_request,
    wait_for,
    workers,
)

from kv_manager_service.client import AllocateOp, KVLossCause, KVManagerClient
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kvcache.v1 import kv_manager_pb2 as pb
from processes import free_port, launch, stop_all

BLOCK = 16
OK, KV_LOST = pb.ALLOCATE_STATUS_OK, pb.ALLOCATE_STATUS_KV_LOST
Code = grpc.StatusCode


@pytest.fixture
def stub(server_factory):
    server = server_factory.start("--check-invariants", "--worker-timeout-s", "600", config=pool_config(64, BLOCK))
    channel, stub = connect(server.address)
    with channel:
        yield stub


def register(stub, worker_id: str, incarnation: int) -> None:
    """Open a WatchSteps stream as worker `worker_id` of `incarnation`, and close it once the manager has
    registered it: it then sends the last step (or, before any step, lists the worker)."""
    last = stats(stub).last_step_id
    request = pb.WatchStepsRequest(worker_id=worker_id, from_step_id=max(last, 1), incarnation=incarnation)
    stream = stub.WatchSteps(request)
    try:
        if last:
            assert next(stream).step_id == last
        else:
            wait_for(lambda: worker_id in workers(stub), f"worker {worker_id} registered")
    finally:
        stream.cancel()


def lost(stub) -> dict[str, int]:
    """The lost requests an empty Step lists."""
    return {r.request_id: r.cause for r in stub.Step(step_request()).lost_requests}


def cached(stub, token_ids) -> int:
    return stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=token_ids)).num_cached_tokens


def losses(stub) -> dict[int, tuple[int, int, int]]:
    return {
        c.cause: (c.num_uncached_blocks, c.num_uncached_host_blocks, c.num_lost_requests) for c in stats(stub).kv_losses
    }


def test_a_new_incarnation_drops_the_cache_and_loses_every_request_with_kv(stub):
    register(stub, "w", incarnation=1)
    stub.Allocate(alloc("a", range(40)))  # two cached blocks
    register(stub, "w", incarnation=1)  # the same process reconnecting: nothing happens
    assert cached(stub, list(range(40))) == 32 and lost(stub) == {}

    register(stub, "w", incarnation=2)
    assert cached(stub, list(range(40))) == 0
    assert lost(stub) == {"a": pb.KV_LOSS_CAUSE_WORKER_RESTARTED}
    assert losses(stub) == {pb.KV_LOSS_CAUSE_WORKER_RESTARTED: (2, 0, 1)}

    # Every op on a lost request answers KV_LOST and changes nothing; a fork of it is lost too; a free ends it.
    stub.Allocate(alloc("after", range(500, 520)))  # admitted after the restart: not lost
    before = stats(stub).num_free_blocks
    response = stub.Step(step_request([op_alloc("a", [7, 8])], decode=[("after", 9)]))
    assert response.results[0].allocate.status == KV_LOST and stats(stub).num_free_blocks == before
    assert response.decode.statuses == [OK]
    response = stub.Step(step_request([op_fork("a", "a-child")]))
    assert {r.request_id for r in response.lost_requests} == {"a", "a-child"}
    assert stub.Step(step_request(decode=[("a-child", 3)])).decode.statuses == [KV_LOST]
    stub.Step(step_request([op_free("a", "a-child")]))
    assert lost(stub) == {}


def test_a_worker_that_joins_late_drops_the_cache(stub):
    register(stub, "first", incarnation=5)
    stub.Allocate(alloc("a", range(40)))
    register(stub, "second", incarnation=0)  # a worker that does not say: a new id is new memory all the same
    assert cached(stub, list(range(40))) == 0
    assert lost(stub) == {"a": pb.KV_LOSS_CAUSE_WORKER_JOINED}


def test_a_report_of_missing_kv_uncaches_its_blocks_and_loses_their_readers(stub):
    register(stub, "w", incarnation=3)
    stub.Allocate(alloc("filler", range(40)))
    (block0, block1, _) = stub.GetBlockTables(pb.GetBlockTablesRequest(request_ids=["filler"])).tables[0].groups[0].block_ids
    hit = stub.Allocate(alloc("reader", list(range(40)) + [99]))
    assert list(hit.groups[0].hit_block_ids) == [block0, block1]
    other = stub.Allocate(alloc("other", range(1000, 1020)))
    assert other.status == OK

    report = pb.ReportMissingKVRequest(
        worker_id="w", incarnation=3, step_id=stats(stub).last_step_id, device_block_ids=[block1],
        request_ids=["gone-already"], cause=pb.KV_LOSS_CAUSE_KV_MISSING,
    )  # fmt: skip
    response = stub.ReportMissingKV(report)
    assert (response.num_uncached_blocks, response.num_lost_requests) == (1, 2)
    assert cached(stub, list(range(40))) == 16  # block 0 stays: nobody said it is missing
    assert lost(stub) == {"filler": pb.KV_LOSS_CAUSE_KV_MISSING, "reader": pb.KV_LOSS_CAUSE_KV_MISSING}
    # Again: nothing more to do.
    assert stub.ReportMissingKV(report).num_lost_requests == 0
    assert losses(stub) == {pb.KV_LOSS_CAUSE_KV_MISSING: (1, 0, 2)}


@pytest.mark.parametrize(
    "report, code, field",
    [
        (dict(worker_id="stranger"), Code.FAILED_PRECONDITION, "worker_id"),
        (dict(incarnation=4), Code.FAILED_PRECONDITION, "incarnation"),
        (dict(device_block_ids=[64]), Code.INVALID_ARGUMENT, "device_block_ids"),
        (dict(host_block_ids=[0]), Code.INVALID_ARGUMENT, "host_block_ids"),  # no host tier
        (dict(cause=pb.KV_LOSS_CAUSE_WORKER_JOINED), Code.INVALID_ARGUMENT, "cause"),
        (dict(step_id=1000), Code.OUT_OF_RANGE, "step_id"),
    ],
)
def test_a_bad_report_is_refused_and_changes_nothing(stub, report, code, field):
    register(stub, "w", incarnation=3)
    stub.Allocate(alloc("a", range(40)))
    fields = dict(worker_id="w", incarnation=3, step_id=1, device_block_ids=[1], cause=pb.KV_LOSS_CAUSE_KV_MISSING)
    error = rpc_error(stub.ReportMissingKV, pb.ReportMissingKVRequest(**{**fields, **report}))
    assert_error(error, code, code.name, field)  # each of these codes' reason is its own name
    assert cached(stub, list(range(40))) == 32 and lost(stub) == {} and not stats(stub).kv_losses


def test_a_free_that_says_what_was_not_computed_uncaches_it(stub):
    stub.Allocate(alloc("own", range(50)))  # three full blocks and a tail
    stub.Allocate(alloc("hitter", list(range(48)) + [7]))  # hits all three
    error = rpc_error(stub.Free, pb.FreeRequest(request_ids=["own"], num_computed_tokens=[51]))
    assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", "num_computed_tokens", "0..50")
    error = rpc_error(stub.Free, pb.FreeRequest(request_ids=["own", "hitter"], num_computed_tokens=[1]))
    assert_error(error, Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", "num_computed_tokens", "one per request id")

    stub.Free(pb.FreeRequest(request_ids=["own"], num_computed_tokens=[20]))
    assert cached(stub, list(range(50))) == 16
    assert lost(stub) == {"hitter": pb.KV_LOSS_CAUSE_NOT_COMPUTED}
    assert losses(stub) == {pb.KV_LOSS_CAUSE_NOT_COMPUTED: (2, 0, 1)}


def test_a_delta_says_how_much_of_a_new_row_was_a_hit(stub):
    register(stub, "w", incarnation=1)
    stub.Allocate(alloc("a", range(40)))
    stub.Allocate(alloc("b", list(range(40)) + [5]))
    stub.Fork(pb.ForkRequest(parent_request_id="b", child_request_ids=["c"]))
    deltas = read_steps(stub, "w", 1, 3)
    assert [(d.rows_added[0].request_id, d.rows_added[0].num_hit_tokens) for d in deltas] == [
        ("a", 0), ("b", 32), ("c", 41)
    ]  # fmt: skip


@pytest.mark.parametrize("compact", [False, True], ids=["replayed", "from-snapshot"])
def test_a_restarted_manager_keeps_what_was_lost_and_why(tmp_path, compact):
    journal = tmp_path / "replica.journal"
    config = tmp_path / "pool.json"
    config.write_text('{"num_blocks": 64, "groups": [{"kind": "full_attention", "block_size": 16}]}')
    argv = [
        sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", str(free_port()), "--replica-id", "validity",
        "--config", str(config), "--journal", str(journal), "--check-invariants", "--worker-timeout-s", "600",
        *(["--journal-compact-bytes", "1"] if compact else []),
    ]  # fmt: skip
    processes = [launch(argv, MANAGER_READY_PREFIX, tmp_path / "first.log")]
    try:
        channel, stub = connect(processes[0].address)
        with channel:
            register(stub, "w", incarnation=1)
            stub.Allocate(alloc("a", range(40)))
            stub.Allocate(alloc("b", range(100, 140)))
            register(stub, "w", incarnation=2)  # both lost
            stub.Allocate(alloc("c", range(200, 240)))
            stub.Free(pb.FreeRequest(request_ids=["b"]))
            block = stub.GetBlockTables(pb.GetBlockTablesRequest(request_ids=["c"])).tables[0].groups[0].block_ids[1]
            stub.ReportMissingKV(pb.ReportMissingKVRequest(
                worker_id="w", incarnation=2, step_id=stats(stub).last_step_id, device_block_ids=[block],
                cause=pb.KV_LOSS_CAUSE_STEP_REFUSED,
            ))  # fmt: skip
            before = (lost(stub), losses(stub), cached(stub, list(range(200, 240))))
        assert before == (
            {"a": pb.KV_LOSS_CAUSE_WORKER_RESTARTED, "c": pb.KV_LOSS_CAUSE_STEP_REFUSED},
            {pb.KV_LOSS_CAUSE_WORKER_RESTARTED: (4, 0, 2), pb.KV_LOSS_CAUSE_STEP_REFUSED: (1, 0, 1)},
            16,
        )
        processes[0].kill()
        processes.append(launch(argv, MANAGER_READY_PREFIX, tmp_path / "second.log"))
        channel, stub = connect(processes[1].address)
        with channel:
            assert (lost(stub), losses(stub), cached(stub, list(range(200, 240)))) == before
            register(stub, "w", incarnation=2)  # the journal knows this incarnation: nothing is dropped
            assert losses(stub) == before[1]
    finally:
        failures = stop_all(processes)
        assert not failures, "\n\n".join(failures)


def test_a_tenant_hears_only_of_its_own_lost_requests(server_factory, tmp_path):
    tokens = {"alice": "alice-token-Vb3Nm8Qw1Ze5", "bob": "bob-token-Hy6Tp2Lc9Rd4",
              "infra": {"token": "infra-token-Js7Kw1Xa5Gf3", "role": "operator"}}  # fmt: skip
    token_file, secret_file = tmp_path / "tokens.json", tmp_path / "secret"
    token_file.write_text(json.dumps(tokens))
    secret_file.write_text("a-deployment-secret-9d2c4e\n")
    for path in (token_file, secret_file):
        os.chmod(path, 0o600)
    server = server_factory.start(
        "--multi-tenant", "--auth-token-file", str(token_file), "--tenant-secret-file", str(secret_file),
        "--check-invariants", config=pool_config(64, BLOCK),
    )  # fmt: skip
    alice = KVManagerClient(server.address, token=tokens["alice"])
    bob = KVManagerClient(server.address, token=tokens["bob"])
    infra = KVManagerClient(server.address, token=tokens["infra"]["token"])
    try:
        alice.step([AllocateOp("mine", list(range(40)), 40)])
        bob.step([AllocateOp("theirs", list(range(100, 140)), 40)])
        register(infra.stub, "w", incarnation=1)  # a worker joins: both lose their KV
        assert dict(alice.step([]).lost_requests) == {"mine": KVLossCause.WORKER_JOINED}
        assert dict(bob.step([]).lost_requests) == {"theirs": KVLossCause.WORKER_JOINED}
        assert dict(infra.step([]).lost_requests) == {}  # the operator's own namespace holds none
    finally:
        for client in (alice, bob, infra):
            client.close()
