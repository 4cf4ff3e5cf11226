"""Token expansion of the Mooncake trace: deterministic, and sharing exactly the trace's prefixes."""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from pathlib import Path

import pytest

from kv_tooling.workload import (
    TRACE_BLOCK_SIZE,
    TokenExpander,
    TraceRecord,
    load_trace,
    prompt_token_ids,
    scaled_length,
)

EXCERPT = Path(__file__).parents[1] / "data" / "mooncake_excerpt.jsonl"


def common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_load_trace_reads_typed_records_in_file_order() -> None:
    records = load_trace(EXCERPT)
    assert len(records) == 30
    assert records[0] == TraceRecord(0, 36640, 4, tuple(range(79, 151)))
    assert all(isinstance(r.hash_ids, tuple) for r in records)
    assert load_trace(EXCERPT, limit=3) == records[:3]


def test_load_trace_rejects_hash_ids_that_do_not_cover_the_prompt(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="needs 3 hash ids"):
        load_trace(path)


def test_block_tokens_are_shake128_words_mod_vocab() -> None:
    # A vector another language can check: SHAKE-128("mooncake:0") starts 36e153e0 966b3704.
    assert TokenExpander(vocab_size=1 << 32).block_token_ids(0)[:2] == (0x36E153E0, 0x966B3704)
    assert TokenExpander().block_token_ids(0)[:4] == (736, 24836, 7332, 26925)
    digest = hashlib.shake_128(b"mooncake:77").digest(4 * TRACE_BLOCK_SIZE)
    expected = tuple(w % 1000 for w in struct.unpack(f">{TRACE_BLOCK_SIZE}I", digest))
    assert TokenExpander(vocab_size=1000).block_token_ids(77) == expected


def test_expansion_is_deterministic_across_expanders() -> None:
    records = load_trace(EXCERPT)
    first, second = TokenExpander(), TokenExpander()
    for record in records[:5]:
        assert first.prompt_token_ids(record) == second.prompt_token_ids(record) == prompt_token_ids(record)
        assert len(first.prompt_token_ids(record)) == record.input_length
        assert all(0 <= t < 32000 for t in first.prompt_token_ids(record))


@pytest.mark.parametrize("scale", [1.0, 1 / 32, 0.3])
def test_prompts_share_exactly_the_trace_prefix(scale: float) -> None:
    records = load_trace(EXCERPT)
    expander = TokenExpander(scale=scale)
    prompts = [expander.prompt_token_ids(r) for r in records]
    num_sharing_pairs = 0
    for (ra, a), (rb, b) in itertools.combinations(zip(records, prompts), 2):
        num_shared_ids = common_prefix_length(list(ra.hash_ids), list(rb.hash_ids))
        expected = min(num_shared_ids * expander.block_size, len(a), len(b))
        assert common_prefix_length(a, b) == expected, (ra, rb)
        num_sharing_pairs += num_shared_ids > 0
    assert num_sharing_pairs >= 5  # the excerpt was picked for its shared prefixes


def test_scale_shrinks_blocks_and_outputs() -> None:
    record = TraceRecord(0, 2 * TRACE_BLOCK_SIZE + 100, 45, (7, 8, 9))
    expander = TokenExpander(scale=1 / 32)
    assert expander.block_size == 16
    tokens = expander.prompt_token_ids(record)
    assert len(tokens) == expander.prompt_length(record) == 16 + 16 + 3  # round(100 / 32)
    assert expander.output_length(record) == 1  # round(45 / 32)
    # A scaled block is the start of the full block.
    assert tokens[:16] == list(TokenExpander().block_token_ids(7)[:16])
    assert TokenExpander(scale=1 / 1024).prompt_length(TraceRecord(0, 3, 1, (1,))) == 1
    assert scaled_length(10, 1.0) == 10 and scaled_length(1, 0.01) == 1


@pytest.mark.parametrize("kwargs", [{"scale": 0.0}, {"scale": 1.5}, {"vocab_size": 0}])
def test_expander_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TokenExpander(**kwargs)
