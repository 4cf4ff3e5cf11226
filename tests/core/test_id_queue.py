"""The host tier's free queue in flat arrays, against a list: same order, same membership, sound links."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv_manager_service.core.id_queue import IdQueue


def test_a_new_queue_holds_every_id_in_order_and_an_empty_one_none() -> None:
    assert list(IdQueue(5)) == [0, 1, 2, 3, 4] and IdQueue(5).num_free == 5
    assert list(IdQueue(1)) == [0]
    empty = IdQueue(3, queued=False)
    assert list(empty) == [] and empty.num_free == 0 and 0 not in empty
    with pytest.raises(ValueError, match="no free ids left"):
        empty.popleft()


def test_of_refuses_an_id_out_of_range_or_twice() -> None:
    assert list(IdQueue.of(4, [2, 0, 3])) == [2, 0, 3]
    with pytest.raises(ValueError, match="outside"):
        IdQueue.of(4, [4])
    with pytest.raises(ValueError, match="twice"):
        IdQueue.of(4, [1, 1])


def test_removing_an_id_not_queued_is_refused() -> None:
    queue = IdQueue(3)
    queue.remove(1)
    with pytest.raises(ValueError, match="not in the queue"):
        queue.remove(1)


class IdQueueMachine(RuleBasedStateMachine):
    """Random pops, removals, appends and prepends; the model is a plain list, head first."""

    @initialize(num_ids=st.integers(1, 12), queued=st.booleans())
    def start(self, num_ids: int, queued: bool) -> None:
        self.queue = IdQueue(num_ids, queued)
        self.model = list(range(num_ids)) if queued else []

    def outside(self) -> list[int]:
        return [i for i in range(self.queue.num_ids) if i not in self.model]

    @rule()
    @precondition(lambda self: self.model)
    def popleft(self) -> None:
        assert self.queue.popleft() == self.model.pop(0)

    @rule(data=st.data())
    @precondition(lambda self: self.model)
    def remove(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.model))
        self.queue.remove(i)
        self.model.remove(i)

    @rule(data=st.data(), at_head=st.booleans())
    @precondition(lambda self: len(self.model) < self.queue.num_ids)
    def insert(self, data: st.DataObject, at_head: bool) -> None:
        i = data.draw(st.sampled_from(self.outside()))
        if at_head:
            self.queue.prepend(i)
            self.model.insert(0, i)
        else:
            self.queue.append(i)
            self.model.append(i)

    @invariant()
    def agrees_with_the_list(self) -> None:
        queue, sentinel = self.queue, self.queue.num_ids
        assert list(queue) == self.model and queue.num_free == len(self.model)
        assert [i for i in range(sentinel) if i in queue] == sorted(self.model)
        chain = [sentinel, *self.model, sentinel]
        for before, i, after in zip(chain, chain[1:], chain[2:]):
            assert queue.prev_of(i) == before and queue.next_of(i) == after


TestIdQueueMachine = IdQueueMachine.TestCase
