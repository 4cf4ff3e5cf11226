"""A short soak: three trace-driven schedulers against one server process for a few seconds.

The schedulers (`kv_tooling.soak`, the load of `bench/soak_bench.py`,
here in threads) admit Mooncake prompts, decode them in columnar Steps, fork,
abort and free, and preempt on NO_SPACE; the pool (255 usable blocks) is far
smaller than three full batches (3 x 16 requests of ~12 blocks), so NO_SPACE
and preemption happen. Every call must succeed with OK or NO_SPACE results
that agree with the scheduler's view. Afterwards no request is live, no copy
is pending, and every block is free again (cached-but-evictable blocks count
as free); the server exits 0 on SIGTERM with no traceback in its log. With
`--check-invariants`, the server also checks the core's invariants after
every mutation and would answer INTERNAL on a violation, failing the
scheduler that sent it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from processes import check_clean_exit
from svc_support import pool_config

from kv_manager_service.client import KVManagerClient
from kv_tooling.soak import LatencyBucket, SoakConfig, SoakCounters, run_soak, settle, trace_requests

NUM_SCHEDULERS = 3
NUM_BLOCKS = 256  # 255 usable
BLOCK_SIZE = 16
DURATION_S = 6.0
SCALE = 1 / 64  # 8 tokens per trace block: prompts of ~180 tokens (median)
OUTPUT_SCALE = 1 / 8
MAX_RUNNING = 16
WORKER_ID = "soak-worker"


def run_scheduler_thread(address: str, config: SoakConfig, index: int, start_s: float) -> SoakCounters:
    max_num_tokens = (NUM_BLOCKS - 1) // (4 * NUM_SCHEDULERS) * BLOCK_SIZE  # no request needs over a quarter share
    specs = trace_requests(SCALE, OUTPUT_SCALE, max_num_tokens, index, NUM_SCHEDULERS)
    buckets: list[LatencyBucket] = []
    with KVManagerClient(address) as client:
        client.wait_ready()
        return run_soak(client, config, specs, start_s, buckets.append)


def test_soak_schedulers_leave_the_pool_as_they_found_it(server_factory) -> None:
    server = server_factory.start(
        "--replica-id", "soak", "--log-level", "WARNING", "--check-invariants",
        config=pool_config(NUM_BLOCKS, BLOCK_SIZE),
    )  # fmt: skip
    configs = [
        SoakConfig(f"s{i}", DURATION_S, max_running=MAX_RUNNING, fork_every=10, abort_every=15,
                   worker_id=WORKER_ID, seed=i)
        for i in range(NUM_SCHEDULERS)
    ]  # fmt: skip
    with KVManagerClient(server.address) as client:
        client.wait_ready()
        baseline = settle(client, WORKER_ID)
        assert baseline.violations() == []
        start_s = time.monotonic() + 0.5  # every thread has loaded its share of the trace
        with ThreadPoolExecutor(NUM_SCHEDULERS) as pool:
            futures = [
                pool.submit(run_scheduler_thread, server.address, config, i, start_s)
                for i, config in enumerate(configs)
            ]
            per_scheduler = [future.result() for future in futures]  # raises what a scheduler raised
        end = settle(client, WORKER_ID)

    total = SoakCounters()
    for counters in per_scheduler:
        assert counters.num_request_steps > 0, counters
        total.add(counters)
    # The load did what it is for: contention, preemption, forks with copy-on-write, acks.
    assert total.num_no_space_admit + total.num_no_space_decode > 0, total
    assert total.num_preempted > 0 and total.num_readmitted > 0, total
    assert total.num_forks > 0 and total.num_copies > 0, total
    assert total.num_aborted > 0 and total.num_acks > 0, total
    assert total.num_finished > 0, total
    # Back to the baseline: nothing live, nothing pending, every block free.
    assert end.violations() == [], end
    assert end._replace(last_step_id=0) == baseline._replace(last_step_id=0)
    assert end.last_step_id >= total.num_steps
    check_clean_exit(server)
