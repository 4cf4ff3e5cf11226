"""Splicing a conversation's turns: the next prompt starts with the tokens the previous turn really had.

In the Mooncake format a turn's output reaches the next turn only as new
`hash_ids`, so a replay expands those into tokens that no request generated,
and the blocks a turn generates are never hit. With splicing, a record that
continues an earlier one gets, as its prompt, the earlier record's prompt
and generated tokens as the replay produced them, then its own tokens from
there on. The blocks the earlier turn generated are then what the next turn
hits, as on a real engine.

Which record continues which. The conversation rule (conversations.py) keeps
a turn's *full* 512-token blocks' ids at the start of the next turn's ids.
So record B continues record A when B's ids start with A's full-block ids,
B's prompt has room for A's prompt and output (in trace tokens), and A is a
turn: its full blocks include one that no earlier record had, or it
continues a turn itself. A prefix that many conversations share (a system
prompt) is no conversation's turn, with one exception the format cannot
tell apart: the first record to bring a shared prefix, when all its full
blocks lie inside it (a short first message after a long system prompt),
is taken for a turn, and the next conversation on that prefix with room
for it continues it. The latest such A with the longest ids is taken, and
each A is continued at most once. The rule is meant for multi-turn traces:
on a trace whose unrelated requests share long prefixes (the Mooncake
trace), a request that extends another's new content by more than its
output is taken for its next turn.

Time. A user sends the next turn after reading the previous one's output:
a record whose predecessor is still in flight (waiting, running, or held
itself) is held, and released when that predecessor finishes (its TTFT
counts from then). A record whose spliced prefix would not fit its own
prompt length (possible when `--scale` rounds lengths) keeps its expanded
tokens.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from kv_tooling.workload import TRACE_BLOCK_SIZE, TraceRecord

Key = tuple[int, ...]


def full_block_ids(record: TraceRecord) -> Key:
    """The ids of `record`'s full 512-token blocks: what its next turn's ids start with."""
    return record.hash_ids[: record.input_length // TRACE_BLOCK_SIZE]


class TurnSplicer:
    """Finds each record's predecessor, holds a record until its predecessor finishes, and splices prompts.

    A record goes through `predecessor` once, when the trace releases it, in
    trace order; `hold` or not; `started` once, when it enters the scheduler;
    `finished` once, with its prompt and output tokens.
    """

    def __init__(self, records: Sequence[TraceRecord]) -> None:
        self.records = records
        # Full-block ids of a released, unfinished record (started, or held) -> its index.
        self._in_flight: dict[Key, int] = {}
        self._finished: dict[Key, tuple[int, array]] = {}  # of a finished record no turn continued yet
        self._held: dict[int, list[int]] = {}  # index of a record in flight -> the records waiting for it
        self.num_spliced = 0  # records whose prompt was spliced
        self.num_held = 0  # records released only when their predecessor finished
        self._seen_ids: set[int] = set()  # every id of the records released so far
        # Records a next turn may continue: those whose full blocks brought a new id, and the turns after them.
        self._turns: set[int] = set()

    def predecessor(self, index: int) -> tuple[int, bool] | None:
        """The record that `records[index]` continues, among those released, and whether it is still in
        flight (running, waiting, or held for its own predecessor)."""
        record = self.records[index]
        ids = record.hash_ids
        found = None
        for length in range(len(ids), 0, -1):
            key = ids[:length]
            if (candidate := self._in_flight.get(key)) is not None and self._continues(record, candidate):
                found = candidate, True
                break
            if (entry := self._finished.get(key)) is not None and self._continues(record, entry[0]):
                found = entry[0], False
                break
        seen = self._seen_ids
        if found is not None or any(hash_id not in seen for hash_id in full_block_ids(record)):
            self._turns.add(index)
        seen.update(ids)
        return found

    def hold(self, index: int, predecessor: int) -> None:
        """Release `index` only when `predecessor`, in flight, finishes (`finished` returns it then). A turn
        that arrives meanwhile and continues `index` waits for `index` in turn."""
        self._held.setdefault(predecessor, []).append(index)
        self._mark_in_flight(index)
        self.num_held += 1

    @property
    def num_holding(self) -> int:
        """Records held now, waiting for their predecessor."""
        return sum(map(len, self._held.values()))

    def started(self, index: int, expanded: list[int], predecessor: int | None) -> list[int]:
        """The prompt `records[index]` runs with: `expanded` (its tokens from its ids), spliced after the
        tokens of its finished `predecessor` if any, which no other record continues after it."""
        self._mark_in_flight(index)
        if predecessor is None:
            return expanded
        entry = self._finished.pop(full_block_ids(self.records[predecessor]), None)
        if entry is None or entry[0] != predecessor:
            return expanded
        tokens = entry[1]
        if len(tokens) > len(expanded):
            return expanded
        self.num_spliced += 1
        return [*tokens, *expanded[len(tokens) :]]

    def finished(self, index: int, tokens: Sequence[int]) -> list[int]:
        """Record that `records[index]` finished with `tokens` (prompt and output); the records held for it."""
        key = full_block_ids(self.records[index])
        if self._in_flight.get(key) == index:
            del self._in_flight[key]
        if index in self._turns:
            self._turns.discard(index)
            if key:
                self._finished[key] = (index, array("i", tokens))
        return self._held.pop(index, [])

    def _mark_in_flight(self, index: int) -> None:
        key = full_block_ids(self.records[index])
        if key and index in self._turns:
            self._in_flight[key] = index

    def _continues(self, record: TraceRecord, earlier: int) -> bool:
        """Whether `record`'s prompt has room for the prompt and output of `records[earlier]`."""
        earlier_record = self.records[earlier]
        return record.input_length >= earlier_record.input_length + earlier_record.output_length
