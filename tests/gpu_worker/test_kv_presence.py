"""KVPresence: which blocks hold KV computed here, followed through deltas, and the guard before a read.

Unit tests of each rule on hand-built StepDelta messages, then a stateful
test that drives random deltas and batches as a manager that keeps the
contract would, against a slot-by-slot model of the memory: whatever the
guard lets a request read was written in this process since its block was
last handed out as new.
"""

from __future__ import annotations

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpu_worker.kv_presence import KVPresence, MissingKV, TokenSpan, UnfilledKVError
from kv_manager_service.shared.errors import KVMissingError
from kvcache.v1 import kv_manager_pb2 as pb

BLOCK_SIZE = 4
WINDOW = 6
NUM_BLOCKS = 32
NUM_HOST_BLOCKS = 4


def full_only(num_host_blocks: int = NUM_HOST_BLOCKS) -> KVPresence:
    """One full-attention group of 4-token blocks."""
    return KVPresence(NUM_BLOCKS, [BLOCK_SIZE], [0], num_host_blocks)


def hybrid() -> KVPresence:
    """Group 0 full attention, group 1 a 6-token window; both of 4-token blocks."""
    return KVPresence(NUM_BLOCKS, [BLOCK_SIZE, BLOCK_SIZE], [0, WINDOW])


class Delta:
    """A StepDelta built a field at a time."""

    def __init__(self, step_id: int = 1) -> None:
        self.message = pb.StepDelta(step_id=step_id)

    def add(self, request_id: str, *tables: list[int], hit: int = 0) -> Delta:
        row = self.message.rows_added.add(request_id=request_id, num_hit_tokens=hit)
        for group_id, block_ids in enumerate(tables):
            row.groups.add(group_id=group_id, block_ids=block_ids)
        return self

    def append(self, request_id: str, index: int, block_ids: list[int], group_id: int = 0) -> Delta:
        update = self.message.blocks_appended.add(request_id=request_id, group_id=group_id, new_block_index=index)
        update.block_ids.extend(block_ids)
        return self

    def free(self, *request_ids: str) -> Delta:
        self.message.requests_freed.extend(request_ids)
        return self

    def copy(self, src: int, dst: int) -> Delta:
        self.message.copies.add(src_block_id=src, dst_block_id=dst)
        return self

    def offload(self, device_block_id: int, host_block_id: int) -> Delta:
        self.message.offloads.add(device_block_id=device_block_id, host_block_id=host_block_id)
        return self

    def onload(self, device_block_id: int, host_block_id: int) -> Delta:
        self.message.onloads.add(device_block_id=device_block_id, host_block_id=host_block_id)
        return self


def run(presence: KVPresence, *spans: TokenSpan) -> MissingKV | None:
    """The guard over a batch, and the slots it writes when it passes (as the runner does)."""
    missing = presence.check(spans)
    if missing is None:
        presence.record_written(spans)
    presence.check_invariants()
    return missing


def test_a_new_request_reads_only_what_it_wrote_here():
    presence = full_only()
    presence.apply_step(Delta().add("a", [1, 2]).message)
    assert run(presence, TokenSpan("a", 0, 6)) is None
    assert presence.filled[1:3] == [4, 2]
    assert run(presence, TokenSpan("a", 6, 1)) is None  # where it left off
    assert run(presence, TokenSpan("a", 3, 2)) is None  # a start elsewhere: scanned, and filled
    assert run(presence, TokenSpan("a", 7, 1)) is None
    assert presence.check([TokenSpan("a", 8, 0)]) is None and presence.filled[2] == 4


def test_a_start_past_what_was_computed_here_is_refused():
    presence = full_only()
    presence.apply_step(Delta().add("a", [1, 2]).message)
    run(presence, TokenSpan("a", 0, 5))
    assert run(presence, TokenSpan("a", 7, 1)) == MissingKV((0,), ("a",), (2,))


def test_blocks_past_the_hit_are_new_and_the_hit_keeps_what_it_held():
    presence = full_only()
    presence.apply_step(Delta(1).add("a", [1, 2, 3]).message)
    run(presence, TokenSpan("a", 0, 10))
    # a leaves; b hits its first block and gets 2 and 3 back as new blocks.
    presence.apply_step(Delta(2).free("a").add("b", [1, 2, 3], hit=4).message)
    assert presence.filled[1:4] == [4, 0, 0]
    assert run(presence, TokenSpan("b", 9, 1)) == MissingKV((0,), ("b",), (2, 3))
    assert run(presence, TokenSpan("b", 4, 5)) is None


@pytest.mark.parametrize("num_computed, refused", [(6, False), (5, True)])
def test_a_hit_that_ends_inside_a_block_needs_the_block_filled_that_far(num_computed, refused):
    presence = full_only()
    presence.apply_step(Delta(1).add("a", [1, 2, 3]).message)
    run(presence, TokenSpan("a", 0, num_computed))
    presence.apply_step(Delta(2).add("b", [1, 2, 7], hit=6).message)  # ceil(6 / 4) = 2 blocks kept
    assert presence.filled[2] == num_computed - 4
    missing = run(presence, TokenSpan("b", 6, 2))
    assert (missing == MissingKV((0,), ("b",), (2,))) if refused else missing is None


@pytest.mark.parametrize("parent_executed", [True, False])
def test_a_fork_child_holds_what_its_parent_computed_here(parent_executed):
    """The manager counts the parent's last 2 tokens as computed once they are scheduled."""
    presence = full_only()
    presence.apply_step(Delta(1).add("p", [1, 2]).message)
    run(presence, TokenSpan("p", 0, 6))
    if parent_executed:
        run(presence, TokenSpan("p", 6, 2))
    presence.apply_step(Delta(2).add("c", [1, 2], hit=8).append("p", 2, [3]).message)
    presence.apply_step(Delta(3).append("c", 2, [4]).message)
    missing = run(presence, TokenSpan("c", 8, 1))
    assert missing is None if parent_executed else missing == MissingKV((0,), ("c",), (2,))


def test_an_appended_block_is_new_unless_it_is_the_one_already_there():
    presence = full_only()
    presence.apply_step(Delta(1).add("a", [1, 2]).message)
    run(presence, TokenSpan("a", 0, 8))
    # The update restates block 2 at index 1 and appends 3 (new); blocks 2 keeps its slots.
    presence.apply_step(Delta(2).append("a", 1, [2, 3]).message)
    assert presence.filled[1:4] == [4, 4, 0]
    assert run(presence, TokenSpan("a", 8, 1)) is None


def test_a_copy_on_write_block_holds_what_its_source_held():
    presence = full_only()
    presence.apply_step(Delta(1).add("p", [1, 2]).message)
    run(presence, TokenSpan("p", 0, 6))
    presence.apply_step(Delta(2).add("c", [1, 2], hit=6).message)
    presence.apply_step(Delta(3).append("c", 1, [5]).copy(2, 5).message)
    assert presence.filled[5] == 2
    assert run(presence, TokenSpan("c", 6, 1)) is None


def test_a_replaced_block_without_its_copy_is_found_although_the_request_continues():
    """A table whose held block is replaced loses its fast path: the next Execute scans it."""
    presence = full_only()
    presence.apply_step(Delta(1).add("a", [1, 2]).message)
    run(presence, TokenSpan("a", 0, 6))
    presence.apply_step(Delta(2).append("a", 1, [5]).message)
    assert run(presence, TokenSpan("a", 6, 1)) == MissingKV((0,), ("a",), (5,))


def test_a_full_block_goes_to_the_host_and_back_and_a_partial_one_does_not():
    presence = full_only()
    presence.apply_step(Delta(1).add("a", [1, 2]).message)
    run(presence, TokenSpan("a", 0, 6))
    presence.apply_step(Delta(2).free("a").offload(1, 0).offload(2, 1).message)
    assert list(presence.host_filled) == [1, 0, 0, 0]
    presence.apply_step(Delta(3).add("b", [7, 8, 9], hit=8).onload(7, 0).onload(8, 1).message)
    assert presence.filled[7:10] == [BLOCK_SIZE, 0, 0]
    assert presence.take_missing_host_block_ids() == [1]
    assert presence.take_missing_host_block_ids() == []
    assert run(presence, TokenSpan("b", 8, 1)) == MissingKV((0,), ("b",), (8,))
    assert run(presence, TokenSpan("b", 4, 5)) is None


def test_an_offload_reads_the_block_before_the_step_hands_it_out_again():
    presence = full_only()
    presence.apply_step(Delta(1).add("a", [1]).message)
    run(presence, TokenSpan("a", 0, 4))
    presence.apply_step(Delta(2).free("a").add("b", [1]).offload(1, 2).message)
    assert presence.host_filled[2] == 1 and presence.filled[1] == 0


def test_a_host_block_never_filled_here_stays_unfilled_after_an_onload():
    presence = full_only()  # a fresh worker: the manager's host tier may hold blocks another process filled
    presence.apply_step(Delta(1).add("a", [3, 4], hit=4).onload(3, 2).message)
    assert run(presence, TokenSpan("a", 4, 1)) == MissingKV((0,), ("a",), (3,))
    assert presence.take_missing_host_block_ids() == [2]


def test_a_batch_fills_what_others_of_it_read_in_any_order():
    """b and c hit a's blocks in the step that admits a: each layer stores every K/V before attention."""
    presence = full_only()
    presence.apply_step(Delta().add("a", [1, 2]).add("b", [1, 2, 3], hit=8).add("c", [1, 2, 3, 4], hit=12).message)
    # c reads b's block 3, which b writes; b reads a's blocks, which a writes.
    assert run(presence, TokenSpan("c", 12, 2), TokenSpan("b", 8, 4), TokenSpan("a", 0, 8)) is None
    assert presence.filled[1:5] == [4, 4, 4, 2]


def test_a_refused_request_fills_nothing_for_the_others():
    presence = full_only()
    presence.apply_step(Delta().add("a", [1, 2]).add("b", [1, 2, 3], hit=8).add("x", [9]).message)
    missing = run(presence, TokenSpan("x", 0, 3), TokenSpan("b", 8, 1), TokenSpan("a", 4, 4))
    # a reads block 1, which nobody wrote; b reads it too, and block 2, which only a (refused) writes.
    assert missing == MissingKV((1, 2), ("b", "a"), (1, 2))
    assert presence.filled[1:4] == [0, 0, 0] and presence.filled[9] == 0  # nothing recorded
    assert run(presence, TokenSpan("x", 0, 3)) is None  # the rest, again


@pytest.mark.parametrize("num_written, refused", [(2, False), (1, True)])
def test_a_read_may_be_part_filled_and_part_written_in_the_batch(num_written, refused):
    presence = full_only()
    presence.apply_step(Delta(1).add("a", [1, 2]).message)
    run(presence, TokenSpan("a", 0, 2))
    presence.apply_step(Delta(2).add("b", [1, 5], hit=4).message)
    # b reads slots 0..3 of block 1: a computed 0 and 1 before, and writes 2 (and 3) now.
    missing = run(presence, TokenSpan("b", 4, 1), TokenSpan("a", 2, num_written))
    assert missing == MissingKV((0,), ("b",), (1,)) if refused else missing is None


def test_slots_written_past_a_gap_do_not_count_until_the_gap_is_written():
    presence = full_only()
    presence.apply_step(Delta().add("a", [1, 2]).add("b", [1, 2], hit=2).message)
    presence.record_written([TokenSpan("a", 2, 4)])
    assert presence.filled[1:3] == [0, 2]
    presence.record_written([TokenSpan("b", 2, 2), TokenSpan("a", 0, 2)])  # in either order
    assert presence.filled[1:3] == [4, 2]


def test_the_null_block_and_positions_outside_a_window_are_not_read():
    presence = hybrid()
    presence.apply_step(Delta(1).add("a", [1, 2, 3], [4, 5, 6]).message)
    run(presence, TokenSpan("a", 0, 10))
    # b hits all 10 tokens; the window group holds only the blocks a window of 6 reaches from position 10.
    presence.apply_step(Delta(2).free("a").add("b", [1, 2, 3], [0, 5, 6], hit=10).message)
    presence.filled[4] = 0  # whatever block 4 holds, b never reads it
    assert run(presence, TokenSpan("b", 10, 2)) is None
    # A window group's reads start inside a block: position 12 reads 7..11, blocks 5 (slot 3) and 6 (0..3).
    presence.apply_step(Delta(3).add("c", [9, 10, 11, 12], [13, 14, 15, 16], hit=0).message)
    presence.filled[14] = 0
    assert run(presence, TokenSpan("c", 12, 1)).device_block_ids == (9, 10, 11, 14, 15)


def test_what_a_refused_step_leaves_uncomputed_is_its_blocks_from_its_start_that_are_not_full():
    presence = hybrid()
    presence.apply_step(Delta().add("a", [1, 2, 3], [0, 5, 6]).message)
    run(presence, TokenSpan("a", 0, 6))
    assert presence.unfilled_blocks_from("a", 6) == [2, 3, 5, 6]  # block 5 holds positions 4 and 5 of 4..7
    assert presence.unfilled_blocks_from("a", 0) == [2, 3, 5, 6]  # full blocks and the null block are not
    assert presence.unfilled_blocks_from("a", 8) == [3, 6]


def test_a_failed_forward_pass_leaves_its_slots_unfilled():
    presence = full_only()
    presence.apply_step(Delta().add("a", [1, 2]).message)
    run(presence, TokenSpan("a", 0, 5))
    presence.forget_written([TokenSpan("a", 3, 3)])
    assert presence.filled[1:3] == [3, 0]
    assert run(presence, TokenSpan("a", 5, 1)) == MissingKV((0,), ("a",), (1, 2))
    assert run(presence, TokenSpan("a", 3, 3)) is None


def test_a_request_live_before_this_process_started_holds_nothing_here():
    presence = full_only()
    presence.add_unfilled("old", [[1, 2]])
    assert run(presence, TokenSpan("old", 5, 1)) == MissingKV((0,), ("old",), (1, 2))
    assert run(presence, TokenSpan("old", 0, 6)) is None


def test_the_refusal_is_a_kv_missing_error_naming_every_refused_request():
    missing = MissingKV((2, 5), ("b", "e"), (3, 4))
    error = UnfilledKVError(missing, 7)
    assert isinstance(error, KVMissingError) and error.reason == "KV_MISSING"
    assert error.request_ids == ["b", "e"] and error.field == "requests[2]" and error.missing is missing
    assert "'b', 'e'" in str(error) and "[3, 4]" in str(error) and "step 7" in str(error)


class FollowingAManager(RuleBasedStateMachine):
    """Random deltas as a manager that keeps the contract sends them, and random batches.

    `slots[b]` is the model: the slots of block b written in this process
    since b was last handed out as new (copies and onloads carry them).
    Whatever the guard lets a request read must be in it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.presence = KVPresence(NUM_BLOCKS, [BLOCK_SIZE, BLOCK_SIZE], [0, WINDOW], NUM_HOST_BLOCKS)
        self.step_id = 0
        self.tables: dict[str, list[list[int]]] = {}
        self.scheduled: dict[str, int] = {}  # tokens the manager counts as computed
        self.ref_cnt = [0] * NUM_BLOCKS
        self.slots: list[set[int]] = [set() for _ in range(NUM_BLOCKS)]
        self.host_slots: list[set[int]] = [set() for _ in range(NUM_HOST_BLOCKS)]
        self.next_id = 0

    def _free_blocks(self) -> list[int]:
        return [b for b in range(1, NUM_BLOCKS) if self.ref_cnt[b] == 0]

    def _delta(self) -> Delta:
        self.step_id += 1
        return Delta(self.step_id)

    def _take(self, count: int) -> list[int] | None:
        """`count` free blocks handed out (their slots hold nothing now), or None when fewer are free."""
        blocks = self._free_blocks()[:count]
        if len(blocks) < count:
            return None
        for block_id in blocks:
            self.ref_cnt[block_id] += 1
            self.slots[block_id] = set()
        return blocks

    @rule(num_blocks=st.integers(1, 3), host=st.integers(-1, NUM_HOST_BLOCKS - 1))
    def admit(self, num_blocks, host):
        """A new request with new blocks, or one whose first block comes back from the host."""
        request_id = f"r{self.next_id}"
        self.next_id += 1
        if len(self._free_blocks()) < 2 * num_blocks:
            return
        delta, hit = self._delta(), 0
        if host < 0:
            tables = [self._take(num_blocks), self._take(num_blocks)]
        else:  # the window group keeps no block for the hit
            tables = [self._take(num_blocks), [0] + self._take(num_blocks - 1)]
            delta.onload(tables[0][0], host)
            self.slots[tables[0][0]] = set(self.host_slots[host])
            hit = BLOCK_SIZE
        self.presence.apply_step(delta.add(request_id, *tables, hit=hit).message)
        self.tables[request_id], self.scheduled[request_id] = tables, hit

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), num_new=st.integers(1, 2))
    def admit_with_a_hit(self, data, num_new):
        """A new request sharing the first full blocks of a live one, as far as its tokens were scheduled."""
        source = data.draw(st.sampled_from(sorted(self.tables)))
        num_shared = min(self.scheduled[source] // BLOCK_SIZE, *(len(table) for table in self.tables[source]))
        if num_shared == 0 or len(self._free_blocks()) < 2 * num_new:
            return
        tables = [table[:num_shared] + self._take(num_new) for table in self.tables[source]]
        for table in tables:
            for block_id in table[:num_shared]:
                self.ref_cnt[block_id] += block_id != 0
        request_id = f"r{self.next_id}"
        self.next_id += 1
        hit = num_shared * BLOCK_SIZE
        self.presence.apply_step(self._delta().add(request_id, *tables, hit=hit).message)
        self.tables[request_id], self.scheduled[request_id] = tables, hit

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child = f"r{self.next_id}"
        self.next_id += 1
        tables = [list(table) for table in self.tables[parent]]
        for table in tables:
            for block_id in table:
                self.ref_cnt[block_id] += block_id != 0
        self.presence.apply_step(self._delta().add(child, *tables, hit=self.scheduled[parent]).message)
        self.tables[child], self.scheduled[child] = tables, self.scheduled[parent]

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), group_id=st.integers(0, 1))
    def append(self, data, group_id):
        request_id = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[request_id][group_id]
        if len(table) >= 6:
            return
        block_ids = self._take(1)
        if block_ids is None:
            return
        self.presence.apply_step(self._delta().append(request_id, len(table), block_ids, group_id).message)
        table.extend(block_ids)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), group_id=st.integers(0, 1))
    def copy_on_write(self, data, group_id):
        """A shared block replaced by a copy in one request's table."""
        request_id = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[request_id][group_id]
        index = data.draw(st.integers(0, len(table) - 1))
        src = table[index]
        if src == 0 or self.ref_cnt[src] < 2 or not self._free_blocks():
            return
        (dst,) = self._take(1)
        self.slots[dst] = set(self.slots[src])
        self.ref_cnt[src] -= 1
        delta = self._delta().append(request_id, index, [dst] + table[index + 1 :], group_id).copy(src, dst)
        self.presence.apply_step(delta.message)
        table[index] = dst

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), num_tokens=st.integers(1, 6))
    def schedule_and_drop(self, data, num_tokens):
        """A step the scheduler never executes: the manager counts its tokens as computed."""
        request_id = data.draw(st.sampled_from(sorted(self.tables)))
        capacity = min(len(table) for table in self.tables[request_id]) * BLOCK_SIZE
        self.scheduled[request_id] = min(capacity, self.scheduled[request_id] + num_tokens)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.tables)))
        for table in self.tables.pop(request_id):
            for block_id in table:
                self.ref_cnt[block_id] -= block_id != 0
        del self.scheduled[request_id]
        self.presence.apply_step(self._delta().free(request_id).message)

    @rule(data=st.data(), host=st.integers(0, NUM_HOST_BLOCKS - 1))
    def offload(self, data, host):
        """An evicted (free) block goes to the host."""
        free = self._free_blocks()
        if not free:
            return
        device = data.draw(st.sampled_from(free))
        self.host_slots[host] = set(range(BLOCK_SIZE)) if self.slots[device] == set(range(BLOCK_SIZE)) else set()
        self.presence.apply_step(self._delta().offload(device, host).message)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def execute(self, data):
        """A batch of distinct requests, each from where the worker left it, or where the manager is, or anywhere."""
        request_ids = data.draw(st.lists(st.sampled_from(sorted(self.tables)), min_size=1, max_size=3, unique=True))
        spans = []
        for request_id in request_ids:
            capacity = min(len(table) for table in self.tables[request_id]) * BLOCK_SIZE
            here = self.presence.num_computed_here.get(request_id, 0)
            anywhere = data.draw(st.integers(0, capacity - 1))
            start = min(data.draw(st.sampled_from([here, self.scheduled[request_id], anywhere])), capacity - 1)
            spans.append(TokenSpan(request_id, start, data.draw(st.integers(1, capacity - start))))
        missing = self.presence.check(spans)
        event("refused" if missing is not None else "passed")
        passed = [span for index, span in enumerate(spans) if missing is None or index not in missing.request_indices]
        written = self._writes(passed)
        for span in passed:
            for block_id, slot in self._reads(span):
                assert slot in self.slots[block_id] or (block_id, slot) in written, (span, block_id, slot)
        if missing is None:
            self.presence.record_written(spans)
            for block_id, slot in written:
                self.slots[block_id].add(slot)
            for span in spans:
                end = span.start_position + span.num_tokens
                self.scheduled[span.request_id] = max(self.scheduled[span.request_id], end)
        else:
            assert missing.device_block_ids and missing.request_ids

    def _reads(self, span: TokenSpan) -> list[tuple[int, int]]:
        reads = []
        for table, window in zip(self.tables[span.request_id], (0, WINDOW)):
            first = max(0, span.start_position - window + 1) if window else 0
            for position in range(first, span.start_position):
                block_id = table[position // BLOCK_SIZE]
                if block_id != 0:
                    reads.append((block_id, position % BLOCK_SIZE))
        return reads

    def _writes(self, spans: list[TokenSpan]) -> set[tuple[int, int]]:
        return {
            (table[position // BLOCK_SIZE], position % BLOCK_SIZE)
            for span in spans
            for table in self.tables[span.request_id]
            for position in range(span.start_position, span.start_position + span.num_tokens)
            if table[position // BLOCK_SIZE] != 0
        }

    @invariant()
    def holds_its_invariants(self):
        self.presence.check_invariants()
        assert self.presence.tables == self.tables
        for block_id in range(1, NUM_BLOCKS):
            assert set(range(self.presence.filled[block_id])) <= self.slots[block_id], block_id


TestFollowingAManager = FollowingAManager.TestCase
