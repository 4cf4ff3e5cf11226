"""Lost KV: the scheduler recomputes a request whose KV the workers do not hold, and its tokens stay the same.

The worker here holds its "KV" the way the manager's block tables place it:
each slot of a block holds the token computed at that position, and the
next token is a function of the whole sequence it reads back. A request
that would read a slot the worker never wrote is refused with
KVMissingError, as a real worker refuses, so a wrong recomputation would
either be refused or change the tokens.
"""

from __future__ import annotations

import zlib
from array import array
from concurrent import futures
from typing import Callable, Sequence

import grpc
import pytest

from kv_tooling.in_process import InProcessManager
from kv_manager_service.client import AllocateResult, AllocateStatus, KVLossCause, Op, StepResult
from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_manager_service.shared.errors import InvalidArgumentError, KVMissingError
from kv_manager_service.shared.status import end_call
from kvcache.v1 import worker_pb2 as pb
from kvcache.v1 import worker_pb2_grpc as pb_grpc
from reference_scheduler import ReferenceScheduler, Scheduled, SchedulerConfig, SchedulerError, WorkerClient
from reference_scheduler.interfaces import ExecuteResult, NextToken

BLOCK_SIZE = 4
VOCAB_SIZE = 1000
NUM_OUTPUT_TOKENS = 8
SHARED = list(range(900, 909))  # two full blocks and one token: later requests hit the first two
PROMPTS = {
    "a": SHARED + [1, 2, 3],
    "b": SHARED + [4, 5, 6, 7, 8, 9],
    "c": SHARED + [10],
    "d": list(range(500, 507)),
}


def core(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),)))


def next_token(sequence: Sequence[int]) -> int:
    return zlib.crc32(array("I", sequence).tobytes()) % VOCAB_SIZE


def greedy(prompt: list[int], num_tokens: int) -> list[int]:
    """The tokens the worker generates after `prompt` when it computes from the right KV."""
    sequence = list(prompt)
    for _ in range(num_tokens):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]


class PagedWorker:
    """A worker without a model whose memory is the manager's blocks: `slots[block_id][i]` is the token computed
    at the i-th position of that block, None if never written. It reads a request's table from the core.

    An Execute writes every scheduled token first (a request may read what another of the same batch writes),
    unless some request would read a slot never written: then it reports those blocks and requests to the
    manager (`invalidate_blocks`, cause KV_MISSING) and raises KVMissingError, having written nothing.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.slots: dict[int, list[int | None]] = {}
        self.calls: list[tuple[int, list[str]]] = []  # (step id, request ids) of every Execute, refused ones too

    def restart(self) -> None:
        self.slots.clear()

    def execute(self, step_id: int, requests: Sequence[Scheduled]) -> ExecuteResult:
        self.calls.append((step_id, [r.request_id for r in requests]))
        tables = {r.request_id: self.manager.block_table(r.request_id).block_ids[0] for r in requests}
        writes: dict[tuple[int, int], int] = {}
        for r in requests:
            blocks = tables[r.request_id]
            for position, token_id in enumerate(r.token_ids, r.start_position):
                writes[blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = token_id
        missing_blocks: set[int] = set()
        missing_ids: list[str] = []
        for r in requests:
            blocks = tables[r.request_id]
            holes = {
                blocks[p // BLOCK_SIZE] for p in range(r.start_position)
                if (blocks[p // BLOCK_SIZE], p % BLOCK_SIZE) not in writes and self._slot(blocks, p) is None
            }  # fmt: skip
            if holes:
                missing_blocks |= holes
                missing_ids.append(r.request_id)
        if missing_ids:
            self.manager.invalidate_blocks(sorted(missing_blocks), [], missing_ids, KVLossCause.KV_MISSING)
            raise KVMissingError(f"blocks {sorted(missing_blocks)} were never filled", missing_ids)
        for (block_id, slot), token_id in writes.items():
            self.slots.setdefault(block_id, [None] * BLOCK_SIZE)[slot] = token_id
        outputs = []
        for r in requests:
            blocks = tables[r.request_id]
            sequence = [self._slot(blocks, p) for p in range(r.start_position + len(r.token_ids))]
            outputs.append(NextToken(r.request_id, next_token(sequence), 0.0))
        return ExecuteResult(step_id, tuple(outputs), 0.0)

    def _slot(self, blocks: Sequence[int], position: int) -> int | None:
        block = self.slots.get(blocks[position // BLOCK_SIZE])
        return None if block is None else block[position % BLOCK_SIZE]


Disturb = Callable[[int, ReferenceScheduler], None]


def run(
    disturb: Disturb | None = None, manager_type: type[InProcessManager] = InProcessManager, **config: object
) -> tuple[ReferenceScheduler, PagedWorker, dict[str, list[int]]]:
    """Run PROMPTS to completion, calling `disturb` after each step (with the number of steps so far; the
    loop's `manager.manager` is the core, its `worker` a PagedWorker). Returns the scheduler, the worker and
    every request's final tokens; checks the core is left empty."""
    manager = core()
    worker = PagedWorker(manager)
    loop = ReferenceScheduler(manager_type(manager), worker, SchedulerConfig(**config))
    for request_id, prompt in PROMPTS.items():
        loop.add(request_id, prompt, NUM_OUTPUT_TOKENS)
    num_steps = 0
    while loop.has_work:
        loop.step()
        num_steps += 1
        if disturb is not None:
            disturb(num_steps, loop)
    loop.flush()
    manager.check_invariants()
    assert manager.stats().num_requests == 0 and manager.lost_requests() == ()
    return loop, worker, {request_id: list(r.tokens) for request_id, r in loop.sequences.items()}


@pytest.fixture(scope="module", params=[1 << 30, 5], ids=["whole", "chunked"])
def undisturbed(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[int]]]:
    loop, _, tokens = run(token_budget=request.param)
    assert loop.counters.num_kv_lost == 0 and loop.counters.num_cached_tokens > 0  # the shared prefix was hit
    assert tokens == {r: prompt + greedy(prompt, NUM_OUTPUT_TOKENS) for r, prompt in PROMPTS.items()}
    return request.param, tokens


@pytest.mark.parametrize("after_step", [1, 3, 6])
def test_requests_of_a_restarted_worker_are_recomputed_to_the_same_tokens(undisturbed, after_step: int) -> None:
    token_budget, expected = undisturbed
    running_then: list[str] = []

    def restart(num_steps: int, loop: ReferenceScheduler) -> None:
        if num_steps == after_step:
            running_then.extend(r.request_id for r in loop.running)
            invalidation = loop.manager.manager.invalidate_all(KVLossCause.WORKER_RESTARTED)
            assert sorted(invalidation.lost_request_ids) == sorted(r.manager_id for r in loop.running)
            loop.worker.restart()

    loop, _, tokens = run(restart, token_budget=token_budget)

    assert running_then and tokens == expected
    assert loop.counters.num_kv_lost == len(running_then) and loop.num_preemptions == 0
    assert loop.timings[after_step].num_kv_lost == len(running_then)
    assert sorted(r for r, request in loop.sequences.items() if request.num_preemptions) == sorted(running_then)


def test_a_request_the_worker_finds_kv_missing_for_is_recomputed_and_the_rest_of_its_batch_runs(undisturbed) -> None:
    token_budget, expected = undisturbed
    forgotten: list[int] = []

    def forget_a_block_of_d(num_steps: int, loop: ReferenceScheduler) -> None:
        if not forgotten and any(r.request_id == "d" and r.num_output_tokens >= 2 for r in loop.running):
            block_id = loop.manager.manager.block_table("d").block_ids[0][0]
            del loop.worker.slots[block_id]  # as if the worker never filled it
            forgotten.append(block_id)

    loop, worker, tokens = run(forget_a_block_of_d, token_budget=token_budget)

    assert forgotten and tokens == expected
    assert loop.counters.num_kv_lost == 1 and loop.sequences["d"].num_preemptions == 1
    refused = [i for i, (step_id, _) in enumerate(worker.calls) if i and worker.calls[i - 1][0] == step_id]
    assert len(refused) == 1
    (step_id, first), (_, retry) = worker.calls[refused[0] - 1 : refused[0] + 1]
    assert "d" in first and len(first) > 1 and retry == [r for r in first if r != "d"]
    assert loop.timings[-1].step_id > step_id  # the loop went on


class LateLossManager(InProcessManager):
    """Applies each step; in the one after `lose` is set, loses those requests (as a worker's report of KV it
    does not hold would) before the answer goes out: their ops are OK, and `lost_requests` lists them."""

    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(manager)
        self.lose: list[str] = []
        self.lost_step_ids: list[int] = []

    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        result = super().step(ops, auto_key=auto_key)
        if self.lose:
            self.manager.invalidate_blocks([], [], self.lose, KVLossCause.STEP_REFUSED)
            self.lose = []
            self.lost_step_ids.append(result.step_id)
            result = result._replace(lost_requests=self.manager.lost_requests())
        return result


def test_a_request_lost_after_its_op_was_accepted_is_not_executed_and_its_uncomputed_blocks_are_not_hit(
    undisturbed,
) -> None:
    """Request "d" is lost in the step that fills its third block: the scheduler must not execute that step's
    token of "d", and must free "d" saying so, or "e", which shares those 12 tokens, would hit a block never
    filled (and the worker would refuse it)."""
    token_budget, expected = undisturbed
    lost_at: list[int] = []

    def lose_d_then_add_e(num_steps: int, loop: ReferenceScheduler) -> None:
        d = loop.sequences["d"]
        if not lost_at and d.running and len(d.tokens) == 3 * BLOCK_SIZE == d.num_computed_tokens + 1:
            loop.manager.lose = ["d"]
            lost_at.append(num_steps + 1)
        elif lost_at and num_steps == lost_at[0]:
            assert not d.running and d.num_preemptions == 1
            loop.add("e", d.tokens + [7, 7, 7], 2)

    loop, worker, tokens = run(lose_d_then_add_e, LateLossManager, token_budget=token_budget)

    e = tokens.pop("e")
    assert tokens == expected and loop.counters.num_kv_lost == 1
    assert e[-2:] == greedy(e[:-2], 2)
    step_ids = [step_id for step_id, _ in worker.calls]
    assert len(step_ids) == len(set(step_ids))  # the worker never refused
    (lost_step_id,) = loop.manager.lost_step_ids
    assert all("d" not in ids for step_id, ids in worker.calls if step_id == lost_step_id)


class LostAdmissionManager(InProcessManager):
    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        result = super().step(ops, auto_key=auto_key)
        return result._replace(results=tuple(
            r._replace(status=AllocateStatus.KV_LOST) if type(r) is AllocateResult else r for r in result.results
        ))  # fmt: skip


def test_kv_lost_for_an_admission_is_a_disagreement() -> None:
    loop = ReferenceScheduler(LostAdmissionManager(core()), PagedWorker(core()))
    loop.add("r", [1, 2, 3], 2)
    with pytest.raises(SchedulerError, match="admitting 'r': the manager answered KV_LOST"):
        loop.step()


class StrangerWorker:
    def execute(self, step_id: int, requests: Sequence[Scheduled]) -> ExecuteResult:
        raise KVMissingError("not yours", ["someone-else"])


def test_a_kv_missing_refusal_that_names_no_request_of_the_batch_is_a_disagreement() -> None:
    loop = ReferenceScheduler(InProcessManager(core()), StrangerWorker())
    loop.add("r", [1, 2, 3], 2)
    with pytest.raises(SchedulerError, match="for requests it does not hold"):
        loop.step()


class RefusingWorker(pb_grpc.WorkerServiceServicer):
    """Refuses every Execute: KV_MISSING for the requests whose id starts with "missing", else INVALID_ARGUMENT."""

    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> pb.ExecuteResponse:
        missing = [r.request_id for r in request.requests if r.request_id.startswith("missing")]
        if missing:
            end_call(context, KVMissingError(f"no KV for {missing}", missing))
        end_call(context, InvalidArgumentError("bad batch", "requests"))


@pytest.fixture
def refusing_worker():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_WorkerServiceServicer_to_server(RefusingWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with WorkerClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            yield client
    finally:
        server.stop(None)


def test_the_worker_client_raises_kv_missing_with_the_request_ids(refusing_worker: WorkerClient) -> None:
    batch = [Scheduled("missing-1", [1], 0), Scheduled("ok", [2], 0), Scheduled("missing-2#1", [3], 4)]
    with pytest.raises(KVMissingError) as raised:
        refusing_worker.execute(7, batch)
    assert raised.value.request_ids == ["missing-1", "missing-2#1"]
    with pytest.raises(grpc.RpcError) as other:
        refusing_worker.execute(7, [Scheduled("ok", [2], 0)])
    assert other.value.code() == grpc.StatusCode.INVALID_ARGUMENT
