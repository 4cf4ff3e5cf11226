"""Eight client threads against one server: allocate / decode / fork / free loops on their own ids.

The pool is small enough that NO_SPACE happens (guaranteed: every thread holds
its first, six-block prompt before any thread goes on, and 8 x 6 > 39). At the
end every request is freed and every step acknowledged, so the pool must be
empty with no pending copies. The subprocess variant checks that through
GetStats; the in-process variant also checks the core's invariants, under the
replica's lock, while the threads run and at the end.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateOp, AllocateStatus, KVCacheConfig
from kv_manager_service.server.process import ServerOptions, start_server
from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import Worker, connect, pool_config, read_steps, register_worker, stats, tables

THREADS = 8
ITERATIONS = 20
BLOCK_SIZE = 4
NUM_BLOCKS = 40  # 39 usable
ACK_WORKER = "concurrency-worker"
SHARED_PREFIXES = [[900_000 + 100 * p + i for i in range(8)] for p in range(3)]  # two blocks each


def client_loop(address: str, thread: int, barrier: threading.Barrier) -> Counter:
    """One scheduler thread; returns what happened, by kind."""
    rng = random.Random(thread)
    seen = Counter()
    next_token = iter(range(thread * 1_000_000, (thread + 1) * 1_000_000))
    live: list[str] = []
    last_step = 0
    with KVManagerClient(address) as client:
        for i in range(ITERATIONS):
            request_id = f"t{thread}-r{i}"
            if i == 0:
                prompt = [next(next_token) for _ in range(6 * BLOCK_SIZE)]  # six blocks, unique
            else:
                prompt = rng.choice(SHARED_PREFIXES) + [next(next_token) for _ in range(rng.randrange(1, 9))]
            admitted = client.allocate(request_id, prompt, len(prompt))
            last_step = max(last_step, admitted.step_id)
            if i == 0:
                barrier.wait(timeout=60)  # all eight hold their first prompt (or were refused) at once
            if admitted.status is AllocateStatus.NO_SPACE:
                seen["no_space"] += 1
                if live:
                    last_step = max(last_step, client.free([live.pop(0)]).step_id)
                continue
            seen["admitted"] += 1
            seen["hit_tokens"] += admitted.num_computed_tokens
            live.append(request_id)
            for _ in range(rng.randrange(1, 6)):
                decoded = client.decode([request_id], [next(next_token)])
                last_step = max(last_step, decoded.step_id)
                seen["copies"] += len(decoded.copies)
                if decoded.statuses[0] is AllocateStatus.NO_SPACE:
                    seen["no_space"] += 1
                    break
            if rng.random() < 0.6:
                child = f"{request_id}-c"
                last_step = max(last_step, client.fork(request_id, [child]).step_id)
                live.append(child)
                step = client.step([AllocateOp(child, [next(next_token)], 1), AllocateOp(request_id, [next(next_token)], 1)])
                last_step = max(last_step, step.step_id)
                for result in step.results:
                    seen["copies"] += len(result.copies)
                    seen["no_space"] += result.status is AllocateStatus.NO_SPACE
            while len(live) > 2:
                last_step = max(last_step, client.free([live.pop(0)]).step_id)
            if i % 3 == 2:
                client.ack_steps(ACK_WORKER, last_step)
        if live:
            client.free(live)
    return seen


def run_threads(address: str) -> Counter:
    channel, stub = connect(address)
    with channel:
        register_worker(stub, ACK_WORKER)
    barrier = threading.Barrier(THREADS)
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(client_loop, address, t, barrier) for t in range(THREADS)]
        results = [f.result(timeout=120) for f in futures]
    return sum(results, Counter())


def finish_and_check_empty(address: str, seen: Counter) -> int:
    """Acknowledge the last step; the pool must be empty. Returns the last step id."""
    channel, stub = connect(address)
    with channel:
        last = stats(stub).last_step_id
        stub.AckSteps(pb.AckStepsRequest(worker_id=ACK_WORKER, step_id=last))
        final = stats(stub)
        assert seen["no_space"] > 0 and seen["admitted"] > 0, seen
        assert seen["copies"] > 0, seen  # forks followed by decodes into shared blocks
        assert final.num_requests == 0 and tables(stub) == {}, final
        assert final.usage == 0.0 and final.num_free_blocks == NUM_BLOCKS - 1, final
        assert final.num_pending_copies == 0, final
        assert final.last_step_id == last
        assert stub.GetBlockTables(pb.GetBlockTablesRequest()).pending_copies == []
        # The step log is contiguous and consistent: replaying it leaves no table behind.
        worker = Worker()
        deltas = read_steps(stub, "late-replayer", 1, last)
        assert [d.step_id for d in deltas] == list(range(1, last + 1))
        for delta in deltas:
            worker.apply(delta)
        assert worker.rows == {}
        assert len(worker.copies) == seen["copies"]
    return last


def test_eight_threads_against_a_server_process(server_factory):
    server = server_factory.start("--replica-id", "busy", config=pool_config(NUM_BLOCKS, BLOCK_SIZE))
    seen = run_threads(server.address)
    finish_and_check_empty(server.address, seen)


def test_eight_threads_in_process_with_invariants_checked_under_the_lock():
    config = KVCacheConfig.from_dict(pool_config(NUM_BLOCKS, BLOCK_SIZE))
    running = start_server(config, ServerOptions(port=0, replica_id="busy-in-process"))
    stop = threading.Event()
    checks = Counter()

    def check_while_running() -> None:
        while not stop.is_set():
            with running.replica.lock:
                running.replica.manager.check_invariants()
            checks["during"] += 1
            stop.wait(0.002)

    checker_pool = ThreadPoolExecutor(1)
    checker = checker_pool.submit(check_while_running)
    try:
        seen = run_threads(running.address)
    finally:
        stop.set()
        checker_pool.shutdown(wait=True)
    try:
        checker.result()  # re-raises an invariant broken mid-run
        assert checks["during"] > 0
        finish_and_check_empty(running.address, seen)
        with running.replica.lock:
            manager = running.replica.manager
            manager.check_invariants()
            assert manager.requests == {} and manager.pending_copies() == []
            assert manager.stats().num_free_blocks == NUM_BLOCKS - 1
    finally:
        running.stop(0)
