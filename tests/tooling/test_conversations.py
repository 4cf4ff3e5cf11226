"""The multi-turn conversation generator: seeded, prefix-extending, timed after each turn's completion."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kv_tooling.conversations import (
    Conversation,
    ConversationOptions,
    add_arguments,
    assumed_completion_ms,
    generate_conversations,
    main,
    run,
    sample_conversations,
    summarize,
    trace_records,
    write_trace,
)
from kv_tooling.workload import TRACE_BLOCK_SIZE, TraceRecord, load_trace

SMALL = ConversationOptions(num_requests=600, seed=7)


def consecutive_turns(conversations: list[Conversation]) -> list[tuple[TraceRecord, TraceRecord]]:
    return [pair for c in conversations for pair in zip(c.turns, c.turns[1:])]


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    first = generate_conversations(SMALL)
    assert len(first) == SMALL.num_requests
    assert generate_conversations(SMALL) == first
    assert generate_conversations(dataclasses.replace(SMALL, seed=8)) != first


def test_a_shorter_trace_is_the_start_of_a_longer_one() -> None:
    longer = generate_conversations(dataclasses.replace(SMALL, num_requests=1500))
    assert generate_conversations(SMALL) == longer[: SMALL.num_requests]


def test_each_turn_extends_the_full_blocks_of_the_turn_before_with_new_ids() -> None:
    conversations = sample_conversations(SMALL)
    records = trace_records(conversations)
    first_seen: dict[int, int] = {}
    for position, record in enumerate(records):
        for hash_id in record.hash_ids:
            first_seen.setdefault(hash_id, position)
    position_of = {id(r): p for p, r in enumerate(records)}
    pairs = consecutive_turns(conversations)
    assert len(pairs) > SMALL.num_requests / 2
    num_partial = 0
    for before, after in pairs:
        num_shared = before.input_length // TRACE_BLOCK_SIZE
        assert after.input_length > before.input_length + before.output_length
        assert after.hash_ids[:num_shared] == before.hash_ids[:num_shared]
        # Past the shared full blocks every id is new, the earlier partial block's id included.
        assert all(first_seen[h] == position_of[id(after)] for h in after.hash_ids[num_shared:])
        if before.input_length % TRACE_BLOCK_SIZE:
            num_partial += 1
            assert before.hash_ids[-1] not in after.hash_ids
    assert num_partial > 0


def test_conversations_with_one_system_prompt_share_its_full_blocks_and_no_others() -> None:
    conversations = sample_conversations(SMALL)
    openings: dict[int | None, set[tuple[int, ...]]] = {}
    for c in conversations:
        num_shared = c.system_prompt_tokens // TRACE_BLOCK_SIZE
        openings.setdefault(c.system_prompt_id, set()).add(c.turns[0].hash_ids[:num_shared])
    assert len(openings) > 2 and None in openings  # several system prompts, and conversations without one
    for system_prompt_id, prefixes in openings.items():
        assert len(prefixes) == 1 or system_prompt_id is None
    # The first block is the system prompt's when it has a full block, else the conversation's own.
    owners: dict[int, set[object]] = {}
    for c in conversations:
        owner = c.system_prompt_id if c.system_prompt_tokens >= TRACE_BLOCK_SIZE else ("own", c.conversation_id)
        owners.setdefault(c.turns[0].hash_ids[0], set()).add(owner)
    assert all(len(o) == 1 for o in owners.values())


@pytest.mark.parametrize("distribution", ["lognormal", "exponential"])
def test_a_turn_arrives_after_the_one_before_completed_and_the_user_thought(distribution: str) -> None:
    options = dataclasses.replace(SMALL, num_requests=6000, think_time_distribution=distribution)
    conversations = sample_conversations(options)
    records = trace_records(conversations)
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(records, records[1:]))
    assert records[0].timestamp_ms >= 0
    # A long think near the end of the trace puts the next turn past it: measure only turns that leave
    # 600 s (a think time that long is rarer than 1 in 500) before the last arrival.
    last_before_ms = records[-1].timestamp_ms - 600_000
    think_s = []
    for before, after in consecutive_turns(conversations):
        completion_ms = assumed_completion_ms(before, options)
        expected_s = before.input_length / 10_000 + before.output_length / 30
        assert completion_ms == pytest.approx(1000 * expected_s, abs=1)
        assert after.timestamp_ms >= before.timestamp_ms + completion_ms
        if before.timestamp_ms <= last_before_ms:
            think_s.append((after.timestamp_ms - before.timestamp_ms - completion_ms) / 1000)
    assert len(think_s) > 2000
    assert statistics.mean(think_s) == pytest.approx(options.mean_think_time_s, rel=0.1)


def test_without_think_time_a_turn_arrives_as_the_one_before_completes() -> None:
    options = dataclasses.replace(SMALL, mean_think_time_s=0)
    for before, after in consecutive_turns(sample_conversations(options)):
        assert after.timestamp_ms == before.timestamp_ms + assumed_completion_ms(before, options)


def test_without_warmup_every_conversation_starts_in_the_trace() -> None:
    warm = sample_conversations(SMALL)
    cold = sample_conversations(dataclasses.replace(SMALL, warmup_s=0))
    assert any(c.first_turn_index > 0 for c in warm)
    assert all(c.first_turn_index == 0 for c in cold)


def test_turn_and_prompt_limits_hold() -> None:
    options = dataclasses.replace(SMALL, max_turns=3, max_prompt_tokens=4096)
    conversations = sample_conversations(options)
    assert max(c.first_turn_index + len(c.turns) for c in conversations) <= 3
    assert max(r.input_length for c in conversations for r in c.turns) <= 4096
    single = sample_conversations(dataclasses.replace(SMALL, mean_turns=1))
    assert all(len(c.turns) == 1 and c.first_turn_index == 0 for c in single)


def test_load_trace_reads_the_written_trace_back_equal(tmp_path: Path) -> None:
    records = generate_conversations(SMALL)
    write_trace(records, tmp_path / "conv.jsonl")
    assert load_trace(tmp_path / "conv.jsonl") == records


@pytest.mark.parametrize(
    "options",
    [
        ConversationOptions(num_system_prompts=0, num_requests=8000),
        ConversationOptions(num_system_prompts=0, num_requests=8000, conversations_per_s=1.5, mean_turns=2.5),
    ],
    ids=["defaults", "shorter-conversations"],
)
def test_the_summary_matches_the_requested_rates(options: ConversationOptions) -> None:
    conversations = sample_conversations(options)
    summary = summarize(trace_records(conversations), len(conversations))
    # Steady state: requests/s = conversations/s x mean turns; the prompt at turn k is the first message
    # plus k-1 outputs and messages, k-1 averaging (about) mean turns - 1 over the requests.
    q = 1 - 1 / options.mean_turns
    mean_turns = (1 - q**options.max_turns) / (1 - q)
    expected_prompt_tokens = options.mean_first_message_tokens + (options.mean_turns - 1) * (
        options.mean_output_tokens + options.mean_message_tokens
    )
    assert summary.num_requests == options.num_requests
    assert summary.requests_per_s == pytest.approx(options.conversations_per_s * mean_turns, rel=0.1)
    assert summary.mean_prompt_tokens == pytest.approx(expected_prompt_tokens, rel=0.15)
    assert summary.prompt_tokens_per_s == pytest.approx(summary.requests_per_s * summary.mean_prompt_tokens)
    assert 0.5 < summary.shared_block_fraction < 1


def test_the_defaults_resemble_the_target_chat_workload() -> None:
    conversations = sample_conversations(ConversationOptions())
    summary = summarize(trace_records(conversations), len(conversations))
    assert 11_000 < summary.mean_prompt_tokens < 15_000
    assert 2.7 < summary.requests_per_s < 3.3
    assert 33_000 < summary.prompt_tokens_per_s < 48_000


def test_summarize_counts_blocks_whose_whole_prefix_came_before() -> None:
    records = [TraceRecord(0, 1024, 1, (0, 1)), TraceRecord(1, 1536, 1, (0, 2, 3)), TraceRecord(2000, 1024, 1, (0, 1))]
    summary = summarize(records, num_conversations=2)
    assert summary.shared_block_fraction == 3 / 7  # 0 | 0 | 0, 1
    assert summary.requests_per_s == 1.5
    assert summary.mean_prompt_tokens == pytest.approx(3584 / 3)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--requests", "0"], "--requests must be >= 1, got 0"),
        (["--requests", "many"], "--requests: invalid int value"),
        (["--conversations-per-s", "0"], "--conversations-per-s must be > 0"),
        (["--mean-turns", "inf"], "--mean-turns must be a finite number"),
        (["--system-prompt-share", "1.5"], "--system-prompt-share must be in [0, 1]"),
        (["--max-prompt-tokens", "100"], "--max-prompt-tokens must be >= 1024"),
        (["--think-time-distribution", "gamma"], "--think-time-distribution: invalid choice"),
        (["--output", "no/such/folder/conv.jsonl"], "--output no/such/folder/conv.jsonl: folder"),
    ],
)
def test_a_bad_flag_exits_2_with_one_line_naming_it(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--output", "conv.jsonl", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err
    assert not (tmp_path / "conv.jsonl").exists()


def test_the_module_runs_and_prints_a_one_line_summary(tmp_path: Path) -> None:
    output = tmp_path / "conv.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "kv_tooling.conversations", "--requests", "300", "--seed", "3", "--output", str(output)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert done.stdout.count("\n") == 1
    assert done.stdout.startswith("300 requests in ") and "requests/s" in done.stdout and "shared" in done.stdout
    assert load_trace(output) == generate_conversations(ConversationOptions(num_requests=300, seed=3))


def test_another_command_line_can_register_it_as_a_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="kv-manager")
    add_arguments(parser.add_subparsers(dest="command").add_parser("conversations"))
    args = parser.parse_args(["conversations", "--requests", "50", "--output", str(tmp_path / "c.jsonl")])
    assert run(args) == 0
    assert "50 requests" in capsys.readouterr().out
    assert len(load_trace(tmp_path / "c.jsonl")) == 50
    args.conversations_per_s = -1.0
    with pytest.raises(ValueError, match="--conversations-per-s"):
        run(args)
