"""The scheduler's loop over an in-process core: requests that never fit, a shared pool, aborts, a wrong answer."""

from __future__ import annotations

from typing import Sequence

import pytest

from kv_tooling.in_process import InProcessManager
from kv_tooling.replay import SampledTokenWorker
from kv_manager_service.client import AllocateOp, AllocateResult, Op, StepResult
from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from reference_scheduler import ReferenceScheduler, RequestTooLargeError, SchedulerConfig, SchedulerError

BLOCK_SIZE = 4


def core(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),)))


def scheduler(manager: KVCacheManager, **config: object) -> ReferenceScheduler:
    return ReferenceScheduler(InProcessManager(manager), SampledTokenWorker(1000), SchedulerConfig(**config))


def test_a_request_that_outgrows_the_pool_alone_is_too_large_and_freed() -> None:
    manager = core(10)  # 9 usable blocks: 36 tokens
    loop = scheduler(manager, token_budget=8)
    loop.add("long", list(range(30)), 20)
    with pytest.raises(RequestTooLargeError, match="while it ran alone") as raised:
        loop.run()
    assert raised.value.request_id == "long"
    assert manager.stats().num_requests == 0


def test_on_a_shared_pool_a_refused_request_waits_for_the_others() -> None:
    manager = core(10)
    holder = scheduler(manager)
    holder.add("holder", list(range(28)), 2)  # 7 of the 9 blocks
    holder.step()
    waiter = scheduler(manager, shared_pool=True)
    waiter.add("waiter", list(range(100, 120)), 2)  # 5 blocks
    assert waiter.step() == []
    assert waiter.counters.num_refused_admissions == 1 and not waiter.running
    holder.run()
    waiter.run()
    assert waiter.sequences["waiter"].num_output_tokens == 2
    assert manager.stats().num_requests == 0


def test_an_aborted_request_is_freed_by_the_next_step_and_can_be_discarded() -> None:
    manager = core(100)
    loop = scheduler(manager)
    loop.add("kept", list(range(10)), 5)
    loop.add("aborted", list(range(50, 60)), 5)
    loop.step()
    loop.abort("aborted")
    with pytest.raises(ValueError, match="neither waiting nor running"):
        loop.abort("aborted")
    loop.step()
    assert manager.stats().num_requests == 1
    assert loop.discard("aborted").num_output_tokens == 1
    loop.run()
    assert list(loop.sequences) == ["kept"] and manager.stats().num_requests == 0


class OffByOneManager(InProcessManager):
    """Answers every continuing op as if it started one token later than it does."""

    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        result = super().step(ops, auto_key=auto_key)
        continuing = [type(op) is AllocateOp and len(op.token_ids) == 1 for op in ops]
        return result._replace(results=tuple(
            r._replace(num_computed_tokens=r.num_computed_tokens + 1) if shifted and type(r) is AllocateResult else r
            for r, shifted in zip(result.results, continuing)
        ))  # fmt: skip


def test_an_answer_that_disagrees_with_the_scheduler_raises() -> None:
    loop = ReferenceScheduler(OffByOneManager(core(100)), SampledTokenWorker(1000))
    loop.add("r", list(range(10)), 5)
    loop.step()
    with pytest.raises(SchedulerError, match="the scheduler expected 10..11"):
        loop.step()
