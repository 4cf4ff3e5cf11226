"""Cache validity as a property: random interleavings of a scheduler, a manager's core and simulated workers.

The workers are simulated down to their memory: each device and host slot
holds the token sequence whose KV it really holds (the tokens up to and
including its position, as computed), or None; a new block keeps whatever
its last user left. Each worker follows every step delta with the real
`KVPresence`, and asks it before every forward pass, as the real worker does.

Events: Steps that admit, continue and free requests (chunked prefills,
decodes, shared prefixes so that hits happen, a pool small enough that blocks
are evicted, to the host tier when there is one); Executes on one worker or
another; Executes a worker refuses (bad input); Steps never executed (a
dropped allocation); frees that say what was not computed; worker restarts;
a worker that joins late.

The invariant, checked at every read: whenever a simulated worker executes a
request, every slot it reads below the request's start position holds the
KV of exactly that request's tokens up to that position. And after every
event, the core's and each worker's own invariants hold.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_worker.kv_presence import KVPresence, TokenSpan
from kv_manager_service.core import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    FreeOp,
    GroupKind,
    GroupSpec,
    KVCacheConfig,
    KVCacheManager,
    KVLossCause,
)
from kv_manager_service import wire

BLOCK_SIZE = 4
NUM_BLOCKS = 28
VOCAB = 7
PREFIXES = [[1, 2, 3, 4, 5, 6, 0, 1], [2, 2, 2, 2, 3, 3, 3, 3, 4], [5, 4, 3, 2, 1, 0, 6, 5, 4, 3, 2, 1]]


def next_token(tokens: list[int]) -> int:
    """The simulated model's choice: a function of the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


class SimulatedWorker:
    """A worker's memory, slot by slot, and the real guard that follows the same deltas."""

    def __init__(self, num_host_blocks: int) -> None:
        self.presence = KVPresence(NUM_BLOCKS, [BLOCK_SIZE], [0], num_host_blocks)
        self.slots: list[list[tuple[int, ...] | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.host_slots: list[list[tuple[int, ...] | None]] = [[None] * BLOCK_SIZE for _ in range(num_host_blocks)]

    def apply(self, delta) -> None:
        """Tables and moves in the runner's order: offloads, then onloads, then copy-on-write copies."""
        message = wire.step_delta(delta)
        for move in message.offloads:
            self.host_slots[move.host_block_id] = list(self.slots[move.device_block_id])
        for move in message.onloads:
            self.slots[move.device_block_id] = list(self.host_slots[move.host_block_id])
        for copy in message.copies:
            self.slots[copy.dst_block_id] = list(self.slots[copy.src_block_id])
        self.presence.apply_step(message)

    def forward(self, spans: list[TokenSpan], tokens: dict[str, list[int]]) -> None:
        """Read, then write, as one forward pass: every read must hold its own request's KV."""
        for request_id, start, num_tokens in spans:
            table = self.presence.tables[request_id][0]
            for position in range(start):
                block_id = table[position // BLOCK_SIZE]
                held = self.slots[block_id][position % BLOCK_SIZE] if block_id else None
                expected = tuple(tokens[request_id][: position + 1])
                # Same-batch writes: a request of this pass that writes this slot writes exactly this.
                if held != expected and not _written_in(spans, tokens, request_id, block_id, position, table, self):
                    raise AssertionError(
                        f"{request_id} reads position {position} from block {block_id}: it holds {held}, "
                        f"not the KV of {expected}"
                    )
        for request_id, start, num_tokens in spans:
            table = self.presence.tables[request_id][0]
            for position in range(start, start + num_tokens):
                self.slots[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = tuple(tokens[request_id][: position + 1])
        self.presence.record_written(spans)


def _written_in(spans, tokens, reader, block_id, position, table, worker) -> bool:
    slot = position % BLOCK_SIZE
    for request_id, start, num_tokens in spans:
        if request_id == reader:
            continue
        other = worker.presence.tables[request_id][0]
        for p in range(start, start + num_tokens):
            if other[p // BLOCK_SIZE] == block_id and p % BLOCK_SIZE == slot:
                return tuple(tokens[request_id][: p + 1]) == tuple(tokens[reader][: position + 1])
    return False


class CacheValidityMachine(RuleBasedStateMachine):
    @initialize(num_host_blocks=st.sampled_from([0, 12]), seed=st.integers(0, 2**16))
    def start(self, num_host_blocks: int, seed: int) -> None:
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),),
            num_host_blocks=num_host_blocks,
        )
        self.manager = KVCacheManager(config)
        self.num_host_blocks = num_host_blocks
        self.workers = [SimulatedWorker(num_host_blocks)]
        self.rng = random.Random(seed)
        self.tokens: dict[str, list[int]] = {}  # every live request's known tokens
        self.computed: dict[str, int] = {}  # the manager's count of each live request's computed tokens
        self.sent: dict[str, int] = {}  # how many of its tokens the manager knows
        self.lost: set[str] = set()
        self.num_ids = 0
        self.num_reads = 0

    # -- the scheduler --------------------------------------------------------------------

    @rule(data=st.data())
    def step(self, data) -> None:
        """One Step: admissions and continuations, then the Execute (or not) of its scheduled tokens."""
        ops, spans = [], {}
        lost = sorted(r for r in self.lost if r in self.computed)
        if lost:
            counts = [self.computed[r] if data.draw(st.booleans()) else 0 for r in lost]
            ops.append(FreeOp(lost, counts))
        live = [r for r in self.computed if r not in self.lost]
        for request_id in data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3)) if live else []:
            tokens = self.tokens[request_id]
            if self.computed[request_id] == len(tokens):
                tokens.append(next_token(tokens))  # a decode
            count = data.draw(st.integers(1, len(tokens) - self.computed[request_id]))
            ops.append(AllocateOp(request_id, tokens[self.sent[request_id] :], count))
        for _ in range(data.draw(st.integers(0, 2))):
            prompt = PREFIXES[data.draw(st.integers(0, len(PREFIXES) - 1))][: data.draw(st.integers(1, 12))]
            prompt = prompt + [self.rng.randrange(VOCAB) for _ in range(data.draw(st.integers(0, 6)))]
            self.num_ids += 1
            request_id = f"r{self.num_ids}"
            ops.append(AllocateOp(request_id, prompt, data.draw(st.integers(1, len(prompt)))))
            self.tokens[request_id] = list(prompt)
        if not ops:
            return
        result = self.manager.step(ops)
        for op, op_result in zip(ops, result.results):
            if type(op) is FreeOp:
                for request_id in op.request_ids:
                    self._forget(request_id)
                continue
            assert type(op_result) is AllocateResult
            if op_result.status is AllocateStatus.OK:
                spans[op.request_id] = TokenSpan(
                    op.request_id, op_result.num_computed_tokens, op_result.num_scheduled_tokens
                )
                self.computed[op.request_id] = op_result.num_computed_tokens + op_result.num_scheduled_tokens
                self.sent[op.request_id] = len(self.tokens[op.request_id])
            elif op.request_id not in self.computed:  # an admission refused for space: forget it
                del self.tokens[op.request_id]
        self.lost |= {request_id for request_id, _ in result.lost_requests}
        for worker in self.workers:
            worker.apply(result.delta)
        fate = data.draw(st.sampled_from(["execute"] * 6 + ["drop", "refuse"]))
        batch = [span for request_id, span in spans.items() if request_id not in self.lost and span.num_tokens]
        if batch and fate != "drop":
            self._execute(self.workers[data.draw(st.integers(0, len(self.workers) - 1))], batch, fate == "refuse")

    def _forget(self, request_id: str) -> None:
        del self.tokens[request_id], self.computed[request_id], self.sent[request_id]
        self.lost.discard(request_id)

    def _execute(self, worker: SimulatedWorker, batch: list[TokenSpan], refuse: bool) -> None:
        presence = worker.presence
        if refuse:  # the worker refused the Execute after applying its deltas: nothing computed
            blocks = [b for span in batch for b in presence.unfilled_blocks_from(span.request_id, span.start_position)]
            invalidation = self.manager.invalidate_blocks(
                blocks, presence.take_missing_host_block_ids(), [s.request_id for s in batch], KVLossCause.STEP_REFUSED
            )
            self.lost |= set(invalidation.lost_request_ids) | {s.request_id for s in batch}
            return
        while batch:
            missing = presence.check(batch)
            if missing is None:
                break
            invalidation = self.manager.invalidate_blocks(
                missing.device_block_ids, presence.take_missing_host_block_ids(), missing.request_ids,
                KVLossCause.KV_MISSING,
            )  # fmt: skip
            self.lost |= set(invalidation.lost_request_ids) | set(missing.request_ids)
            batch = [span for span in batch if span.request_id not in missing.request_ids]
        if batch:
            worker.forward(batch, self.tokens)
            self.num_reads += len(batch)

    # -- the workers ------------------------------------------------------------------------

    @rule(index=st.integers(0, 1))
    def restart_worker(self, index: int) -> None:
        """A worker process starts again: empty memory; the manager hears its new incarnation."""
        index = min(index, len(self.workers) - 1)
        worker = SimulatedWorker(self.num_host_blocks)
        for request_id in self.manager.request_ids():  # its start-up snapshot of the tables
            worker.presence.add_unfilled(request_id, self.manager.block_table(request_id).block_ids)
        self.workers[index] = worker
        self.lost |= set(self.manager.invalidate_all(KVLossCause.WORKER_RESTARTED).lost_request_ids)

    @precondition(lambda self: len(self.workers) == 1)
    @rule()
    def join_late(self) -> None:
        worker = SimulatedWorker(self.num_host_blocks)
        for request_id in self.manager.request_ids():
            worker.presence.add_unfilled(request_id, self.manager.block_table(request_id).block_ids)
        self.workers.append(worker)
        self.lost |= set(self.manager.invalidate_all(KVLossCause.WORKER_JOINED).lost_request_ids)

    @rule(data=st.data())
    def free(self, data) -> None:
        """A scheduler frees requests; one that ran its own model may say how much it really computed."""
        live = list(self.computed)
        if not live:
            return
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=3))
        counts = [data.draw(st.integers(0, self.computed[r])) for r in chosen] if data.draw(st.booleans()) else []
        result = self.manager.step([FreeOp(chosen, counts)])
        for request_id in chosen:
            self._forget(request_id)
        self.lost |= {request_id for request_id, _ in result.lost_requests}
        for worker in self.workers:
            worker.apply(result.delta)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def state_is_consistent(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        for worker in self.workers:
            worker.presence.check_invariants()
        assert set(dict(self.manager.lost_requests())) == self.lost & set(self.computed), (
            self.manager.lost_requests(), self.lost
        )


TestCacheValidity = CacheValidityMachine.TestCase
