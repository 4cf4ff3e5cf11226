"""SIGTERM under a backlog that outlasts the grace period: the process stops taking work, cancels what is
still queued, writes nothing after the journal closes, and exits 0; every acknowledged Step survives."""

from __future__ import annotations

import threading

import grpc
from processes import check_clean_exit
from svc_support import connect, op_alloc, pool_config, step_request

from kvcache.v1 import kv_manager_pb2 as pb

NUM_CALLERS = 24
OPS_PER_STEP = 3_000


def test_sigterm_under_a_backlog_exits_0_and_keeps_every_acknowledged_step(server_factory, tmp_path):
    journal = tmp_path / "kv.journal"
    args = ("--journal", str(journal), "--max-workers", "2", "--shutdown-grace-s", "0.1", "--replica-id", "busy")
    config = pool_config(1 << 17, block_size=1)
    server = server_factory.start(*args, config=config)
    acknowledged: list[str] = []  # the first request id of every Step that was answered
    refused: list[grpc.StatusCode] = []
    lock = threading.Lock()
    some_answered = threading.Event()

    def caller(index: int, stub) -> None:
        for round_ in range(1_000):
            ids = [f"c{index}-{round_}-{op}" for op in range(OPS_PER_STEP)]
            request = step_request([op_alloc(request_id, [op]) for op, request_id in enumerate(ids)])
            request.idempotency_key = f"c{index}-{round_}"
            try:
                stub.Step(request, timeout=60)
            except grpc.RpcError as error:
                with lock:
                    refused.append(error.code())
                return
            with lock:
                acknowledged.append(ids[0])
                if len(acknowledged) >= 4:
                    some_answered.set()

    stubs = [connect(server.address)[1] for _ in range(NUM_CALLERS)]  # connected before SIGTERM can come
    callers = [threading.Thread(target=caller, args=(index, stub)) for index, stub in enumerate(stubs)]
    for thread in callers:
        thread.start()
    assert some_answered.wait(120), "no Step was answered"
    check_clean_exit(server)  # SIGTERM with Steps queued for both threads: exits 0, logs no error
    for thread in callers:
        thread.join()
    log = server.log()
    assert "Bad file descriptor" not in log and '"CRITICAL"' not in log, log
    transient = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
    assert set(refused) <= transient, refused

    restarted = server_factory.start(*args, config=config)
    _, stub = connect(restarted.address)
    tables = stub.GetBlockTables(pb.GetBlockTablesRequest(request_ids=acknowledged))
    assert [table.request_id for table in tables.tables] == acknowledged
