"""FreeBlockQueue: the intrusive doubly linked list that orders block reuse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_manager_service.core.block_queue import FreeBlockQueue, KVCacheBlock


def make_queue(num_blocks: int) -> tuple[FreeBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    return FreeBlockQueue(blocks), blocks


def ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def is_linked(block: KVCacheBlock) -> bool:
    return block.prev_free is not None and block.next_free is not None


def test_construction_keeps_the_given_order() -> None:
    queue, blocks = make_queue(5)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5
    assert all(is_linked(b) for b in blocks)
    assert ids(FreeBlockQueue([])) == [] and FreeBlockQueue([]).num_free_blocks == 0


def test_popleft_takes_the_head_and_unlinks_it() -> None:
    queue, blocks = make_queue(3)
    assert queue.popleft() is blocks[0]
    assert not is_linked(blocks[0]) and blocks[0].prev_free is None and blocks[0].next_free is None
    assert ids(queue) == [1, 2] and queue.num_free_blocks == 2


def test_popleft_n_takes_blocks_in_order() -> None:
    queue, blocks = make_queue(6)
    assert queue.popleft_n(3) == blocks[:3]
    assert not any(is_linked(b) for b in blocks[:3])
    assert ids(queue) == [3, 4, 5] and queue.num_free_blocks == 3
    assert queue.popleft_n(0) == []
    assert ids(queue) == [3, 4, 5] and queue.num_free_blocks == 3
    assert queue.popleft_n(3) == blocks[3:]
    assert ids(queue) == [] and queue.num_free_blocks == 0


def test_popping_from_an_empty_or_short_queue_fails_without_changes() -> None:
    queue, _ = make_queue(2)
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert ids(queue) == [0, 1] and queue.num_free_blocks == 2
    queue.popleft_n(2)
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)
    assert queue.num_free_blocks == 0


@pytest.mark.parametrize(("position", "expected"), [(0, [1, 2, 3, 4]), (2, [0, 1, 3, 4]), (4, [0, 1, 2, 3])])
def test_remove_takes_a_block_from_anywhere(position: int, expected: list[int]) -> None:
    queue, blocks = make_queue(5)
    queue.remove(blocks[position])
    assert ids(queue) == expected and queue.num_free_blocks == 4
    assert not is_linked(blocks[position])
    # The neighbours are relinked: the queue still pops in order.
    assert [b.block_id for b in queue.popleft_n(4)] == expected


def test_remove_of_a_block_not_in_the_queue_fails() -> None:
    queue, blocks = make_queue(3)
    queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])
    with pytest.raises(ValueError):
        queue.remove(KVCacheBlock(99))
    assert ids(queue) == [1, 2] and queue.num_free_blocks == 2


def test_append_n_and_prepend_n_keep_the_batch_order() -> None:
    queue, blocks = make_queue(6)
    popped = queue.popleft_n(4)  # queue: [4, 5]
    queue.append_n([popped[2], popped[0]])
    assert ids(queue) == [4, 5, 2, 0]
    queue.prepend_n([popped[3], popped[1]])
    assert ids(queue) == [3, 1, 4, 5, 2, 0]
    assert queue.num_free_blocks == 6
    queue.append_n([])
    queue.prepend_n([])
    assert ids(queue) == [3, 1, 4, 5, 2, 0] and queue.num_free_blocks == 6
    assert all(is_linked(b) for b in blocks)


def test_append_and_prepend_into_an_empty_queue() -> None:
    queue, blocks = make_queue(3)
    queue.popleft_n(3)
    queue.prepend_n([blocks[1]])
    queue.append_n([blocks[2]])
    queue.prepend_n([blocks[0]])
    assert ids(queue) == [0, 1, 2] and queue.num_free_blocks == 3


QUEUE_OPS = st.tuples(st.sampled_from(["popleft", "popleft_n", "remove", "append", "prepend"]), st.integers(0, 5))


@settings(deadline=None)
@given(ops=st.lists(QUEUE_OPS, max_size=40))
def test_queue_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    queue, blocks = make_queue(8)
    model = list(blocks)
    out: list[KVCacheBlock] = []  # blocks not in the queue
    for op, arg in ops:
        if op == "popleft" and model:
            assert queue.popleft() is model[0]
            out.append(model.pop(0))
        elif op == "popleft_n" and arg <= len(model):
            assert queue.popleft_n(arg) == model[:arg]
            out.extend(model[:arg])
            del model[:arg]
        elif op == "remove" and model:
            block = model.pop(arg % len(model))
            queue.remove(block)
            out.append(block)
        elif op in ("append", "prepend") and out:
            batch = out[: arg % (len(out) + 1)]
            del out[: len(batch)]
            if op == "append":
                queue.append_n(batch)
                model.extend(batch)
            else:
                queue.prepend_n(batch)
                model[:0] = batch
        assert list(queue) == model
        assert queue.num_free_blocks == len(model)
        assert all(is_linked(b) for b in model) and not any(is_linked(b) for b in out)
