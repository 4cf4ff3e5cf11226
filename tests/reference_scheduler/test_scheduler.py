"""The reference scheduler under pressure: chunked prefill and preemption still generate the dense pass's tokens."""

from __future__ import annotations

import random

import pytest
from e2e_support import DenseOracle, start_stack, stop_stack

from reference_scheduler import ReferenceScheduler, SchedulerConfig, SchedulerError

MODEL = "tiny"
# 23 usable blocks of 16 tokens: six 90-token requests (6 blocks each) cannot all run at once.
POOL = {"num_blocks": 24, "groups": [{"kind": "full_attention", "block_size": 16}]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack, processes = start_stack(tmp_path_factory.mktemp("scheduler"), MODEL, "torch", POOL)
    try:
        yield stack
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)


def test_preemption_and_chunked_prefill_keep_every_token_right(stack):
    oracle = DenseOracle(MODEL)
    rng = random.Random(5)
    scheduler = ReferenceScheduler(stack.manager_client, stack.worker_client, SchedulerConfig(token_budget=40, max_num_running=6))
    requests = [
        scheduler.add(f"pressure-{i}", [rng.randrange(256) for _ in range(60)], 30) for i in range(6)
    ]  # fmt: skip
    scheduler.run()

    assert scheduler.num_preemptions > 0  # the pool forced some
    assert max(t.num_tokens for t in scheduler.timings) <= 40  # the budget held
    assert any(t.num_tokens == 40 for t in scheduler.timings)  # prompts were prefilled in chunks
    for request in requests:
        assert len(request.output) == 30
        oracle.check(request)
    assert any(r.num_preemptions for r in requests)
    stats = stack.manager_client.stats()
    assert stats.num_requests == 0 and stats.num_pending_copies == 0


def test_a_request_that_can_never_fit_is_refused_clearly(stack):
    scheduler = ReferenceScheduler(stack.manager_client, stack.worker_client, SchedulerConfig(token_budget=1000))
    scheduler.add("too-big", list(range(400)), 4)  # 25 blocks for its first chunk: more than the pool
    with pytest.raises(SchedulerError, match="does not fit in the idle pool"):
        scheduler.run()
    assert stack.manager_client.stats().num_requests == 0  # nothing was left allocated
