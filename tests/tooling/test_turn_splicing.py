"""Turn splicing in the replay: a next turn starts with its previous turn's real tokens, and waits for them."""

from __future__ import annotations

import pytest

from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_tooling.cost_model import StepCostModel
from kv_tooling.replay import ReplayConfig, ReplayResult, replay
from kv_tooling.workload import TokenExpander, TraceRecord

SCALE = 1 / 32  # 16 tokens per trace block: four 4-token KV blocks
# A prefill token 1 ms, a decode step 2 ms whatever its rows, nothing else.
ROUND = StepCostModel(prefill_us_per_token=1000.0, decode_step_ms=2.0, decode_us_per_row=0.0, kv_bytes_per_token=0)
# A: 4 full trace blocks (64 tokens at SCALE) and 256 output tokens (8). Its 7 fed-back outputs fill one
# more KV block after its prompt's 16: 68 tokens of A's are cached when it finishes.
FIRST = TraceRecord(0, 2048, 256, (0, 1, 2, 3))
A_CACHED_TOKENS = 68


def next_turn(timestamp_ms: int, new_ids: tuple[int, ...] = (10, 11), input_length: int = 3072) -> TraceRecord:
    """A record whose ids extend FIRST's and whose prompt has room for FIRST's prompt and output."""
    return TraceRecord(timestamp_ms, input_length, 256, (*FIRST.hash_ids, *new_ids))


def run(records: list[TraceRecord], splice: bool, progress=None) -> ReplayResult:
    manager = KVCacheManager(KVCacheConfig(4000, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),)))
    config = ReplayConfig(
        token_budget=256, max_num_running=16, progress_every_steps=1, arrivals="trace", cost_model=ROUND,
        splice_turns=splice,
    )
    result = replay(manager, records, TokenExpander(scale=SCALE), config, progress)
    assert result.num_completed == len(records) and not manager.requests
    return result


def test_a_spliced_turn_hits_the_blocks_its_previous_turn_generated() -> None:
    records = [FIRST, next_turn(1_000_000)]
    plain, spliced = run(records, splice=False), run(records, splice=True)
    assert plain.num_prefix_hit_tokens == 64 and (plain.num_spliced_turns, plain.num_held_turns) == (0, 0)
    assert spliced.num_prefix_hit_tokens == A_CACHED_TOKENS
    assert (spliced.num_spliced_turns, spliced.num_held_turns) == (1, 0)
    assert spliced.num_prompt_tokens == plain.num_prompt_tokens  # the same lengths, other tokens
    assert spliced.num_prefill_tokens_computed == plain.num_prefill_tokens_computed - (A_CACHED_TOKENS - 64)


def test_a_turn_that_arrives_while_its_predecessor_runs_waits_for_it() -> None:
    result = run([FIRST, next_turn(10)], splice=True)
    assert (result.num_spliced_turns, result.num_held_turns) == (1, 1)
    # A: one 64 ms prefill step, then 7 decode steps of 2 ms: it finishes at 78 ms, and B is released then.
    # B prefills its 96 - 68 uncached tokens (28 ms) and decodes 7 more steps.
    assert result.makespan_s == pytest.approx(0.078 + 0.028 + 7 * 0.002)
    assert result.num_prefix_hit_tokens == A_CACHED_TOKENS
    # Nearest rank of two TTFTs: p50 is B's, counted from its release, not from its trace timestamp.
    assert (result.ttft_ms_p50, result.ttft_ms_p99) == pytest.approx((28.0, 64.0))


def test_a_record_without_room_for_the_previous_output_is_not_a_next_turn() -> None:
    result = run([FIRST, next_turn(1_000_000, new_ids=(10,), input_length=2100)], splice=True)
    assert (result.num_spliced_turns, result.num_held_turns) == (0, 0)
    assert result.num_prefix_hit_tokens == 64


def test_a_turn_is_continued_once() -> None:
    result = run([FIRST, next_turn(1_000_000), next_turn(2_000_000, new_ids=(20, 21))], splice=True)
    assert result.num_spliced_turns == 1
    assert result.num_prefix_hit_tokens == A_CACHED_TOKENS + 64  # the third finds A's prompt blocks only


def test_a_prefix_that_others_brought_first_is_no_turn_and_a_turn_without_a_new_block_still_is() -> None:
    opener = TraceRecord(0, 3000, 256, (0, 1, 2, 3, 4, 5))  # brings every id: a turn
    # Its full blocks 0-3 were all brought by `opener`, and it continues nothing: no turn, so `later`, which
    # has room for it, does not continue it (nor `opener`, whose block 4 it lacks).
    short = TraceRecord(500_000, 2100, 1, (0, 1, 2, 3, 8))
    later = TraceRecord(1_000_000, 3072, 256, (0, 1, 2, 3, 9, 10))
    assert run([opener, short, later], splice=True).num_spliced_turns == 0
    # A next turn that adds no full block has its predecessor's full-block ids; it is a turn all the same,
    # and the turn after it continues it.
    second = next_turn(1_000_000, new_ids=(10,), input_length=2400)
    third = next_turn(2_000_000, new_ids=(20, 21))
    assert run([FIRST, second, third], splice=True).num_spliced_turns == 2


def test_turns_that_arrive_while_the_first_runs_wait_in_order() -> None:
    # The second waits for the first; the third, arriving while the second is held, waits for the second.
    second = next_turn(10)
    third = TraceRecord(20, 4096, 256, (*second.hash_ids, 20, 21))
    waiting = []
    result = run([FIRST, second, third], splice=True, progress=lambda p: waiting.append(p.num_waiting))
    assert (result.num_spliced_turns, result.num_held_turns) == (2, 2)
    assert waiting[:8] == [2] * 8  # while the first runs its 8 steps, the other two wait, released or held
