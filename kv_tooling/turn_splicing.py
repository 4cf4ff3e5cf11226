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
and B's prompt has room for A's prompt and output (in trace tokens). The
latest such A with the longest ids is taken, and each A is continued at most
once. The rule is meant for multi-turn traces: on a trace whose unrelated
requests share long prefixes (the Mooncake trace), a request that extends
another's prompt by more than its output is taken for its next turn.

Time. A user sends the next turn after reading the previous one's output:
a record whose predecessor is still running is held, and released when that
predecessor finishes (its TTFT counts from then). A record whose spliced
prefix would not fit its own prompt length keeps its expanded tokens.
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

    A record goes through `predecessor` once, when the trace releases it;
    `started` once, when it enters the scheduler; `finished` once, with its
    prompt and output tokens.
    """

    def __init__(self, records: Sequence[TraceRecord]) -> None:
        self.records = records
        self._running: dict[Key, int] = {}  # full-block ids of a started, unfinished record -> its index
        self._finished: dict[Key, tuple[int, array]] = {}  # of a finished record no turn continued yet
        self._held: dict[int, list[int]] = {}  # index of a running record -> the records waiting for it
        self.num_spliced = 0  # records whose prompt was spliced
        self.num_held = 0  # records released only when their predecessor finished
        self.num_unfitting = 0  # records whose predecessor's tokens did not fit their prompt

    def predecessor(self, index: int) -> tuple[int, bool] | None:
        """The record that `records[index]` continues, among those started, and whether it still runs."""
        record = self.records[index]
        ids = record.hash_ids
        for length in range(len(ids), 0, -1):
            key = ids[:length]
            if (candidate := self._running.get(key)) is not None and self._continues(record, candidate):
                return candidate, True
            if (entry := self._finished.get(key)) is not None and self._continues(record, entry[0]):
                return entry[0], False
        return None

    def hold(self, index: int, predecessor: int) -> None:
        """Release `index` only when the running `predecessor` finishes (`finished` returns it then)."""
        self._held.setdefault(predecessor, []).append(index)
        self.num_held += 1

    def started(self, index: int, expanded: list[int], predecessor: int | None) -> list[int]:
        """The prompt `records[index]` runs with: `expanded` (its tokens from its ids), spliced after the
        tokens of its finished `predecessor` if any, which no other record continues after it."""
        key = full_block_ids(self.records[index])
        if key:
            self._running[key] = index
        if predecessor is None:
            return expanded
        entry = self._finished.pop(full_block_ids(self.records[predecessor]), None)
        if entry is None or entry[0] != predecessor:
            return expanded
        tokens = entry[1]
        if len(tokens) > len(expanded):
            self.num_unfitting += 1
            return expanded
        self.num_spliced += 1
        return [*tokens, *expanded[len(tokens) :]]

    def finished(self, index: int, tokens: Sequence[int]) -> list[int]:
        """Record that `records[index]` finished with `tokens` (prompt and output); the records held for it."""
        key = full_block_ids(self.records[index])
        if self._running.get(key) == index:
            del self._running[key]
        if key:
            self._finished[key] = (index, array("i", tokens))
        return self._held.pop(index, [])

    def _continues(self, record: TraceRecord, earlier: int) -> bool:
        """Whether `record`'s prompt has room for the prompt and output of `records[earlier]`."""
        earlier_record = self.records[earlier]
        return record.input_length >= earlier_record.input_length + earlier_record.output_length
