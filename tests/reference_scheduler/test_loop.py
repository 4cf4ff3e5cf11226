"""The scheduler's loop over an in-process core: requests that never fit, a shared pool, aborts, a wrong answer."""

from __future__ import annotations

from typing import Sequence

import pytest

from kv_tooling.in_process import InProcessManager
from kv_tooling.replay import SampledTokenWorker
from kv_manager_service.client import AllocateOp, AllocateResult, ExpectOp, FreeOp, Op, StepResult
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


def test_the_waiting_requests_are_expected_until_admitted_and_an_abort_withdraws_one() -> None:
    manager = core(100)
    loop = scheduler(manager, max_num_running=1)
    loop.add("first", list(range(10)), 3)
    loop.add("second", list(range(20, 30)), 3)
    loop.add("third", list(range(40, 50)), 3)
    loop.step()  # admits `first`; the two others are told ahead
    assert set(manager.expectations.by_request) == {"second", "third"}
    loop.abort("third")
    loop.run()
    assert not manager.expectations.by_request and not manager.pool.wanted
    assert loop.sequences["second"].num_output_tokens == 3 and manager.stats().num_requests == 0
    manager.check_invariants()


class RecordingManager(InProcessManager):
    """Keeps every step's ops."""

    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(manager)
        self.steps: list[list[Op]] = []

    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        self.steps.append(list(ops))
        return super().step(ops, auto_key=auto_key)


def test_a_preempted_request_is_expected_under_its_new_id_before_its_old_one_is_freed() -> None:
    manager = core(10)  # 9 usable blocks: two 16-token prompts growing to 28 tokens cannot both finish
    recording = RecordingManager(manager)
    loop = ReferenceScheduler(recording, SampledTokenWorker(1000), SchedulerConfig(token_budget=64))
    loop.add("a", list(range(16)), 12)
    loop.add("b", list(range(100, 116)), 12)
    loop.run()
    assert loop.num_preemptions
    victim = next(r for r in loop.sequences.values() if r.num_preemptions)
    (requeued,) = [
        ops for ops in recording.steps if any(type(op) is FreeOp and victim.request_id in op.request_ids for op in ops)
    ]
    kinds = [type(op) for op in requeued]
    assert kinds.index(ExpectOp) < kinds.index(FreeOp), kinds
    assert requeued[kinds.index(ExpectOp)].request_id == f"{victim.request_id}#1"
    assert not manager.expectations.by_request and manager.stats().num_requests == 0
    manager.check_invariants()


def test_without_expect_waiting_the_manager_is_told_nothing() -> None:
    manager = core(100)
    loop = scheduler(manager, max_num_running=1, expect_waiting=False)
    loop.add("first", list(range(10)), 3)
    loop.add("second", list(range(20, 30)), 3)
    loop.step()
    assert not manager.expectations.by_request
    loop.run()
