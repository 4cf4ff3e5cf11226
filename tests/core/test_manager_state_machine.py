"""Stateful property tests: random operation sequences against KVCacheManager.

Tiny pools (a handful of blocks, block sizes 2..8) so that NO_SPACE, eviction,
recycling and copy-on-write happen in almost every run. `check_invariants()`
runs after every rule, and the rules assert the scheduler-visible contract:

- a rejected call (a `KVCacheError`) changes nothing, not even the step id;
- a first call that ends in NO_SPACE changes nothing but the step id;
- a continuation that ends in NO_SPACE changes nothing but recycled slots;
- `find_cache_hit` right before a first allocate is exactly the hit it adopts;
- a step never writes a block that another live table holds (copy-on-write);
- incremental hashing equals hashing each request's whole sequence at once;
- replaying the event stream gives exactly the pool's prefix-cache map;
- freeing everything and acknowledging the last step empties the pool;
- a decode batch does exactly what its allocate ops do, one by one: the
  manager's two continuation paths, `_decode` (the common decode entry,
  applied in columns) and `_continue` (every allocate op), agree on every
  result, table, copy and event.
"""

from __future__ import annotations

import dataclasses
from copy import deepcopy
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv_manager_service.core import (
    AllBlocksCleared,
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    BlockRemoved,
    BlockStored,
    CacheHit,
    DecodeBatch,
    EvictionPolicy,
    ExpectOp,
    ExpectResult,
    FailedPreconditionError,
    ForkOp,
    ForkResult,
    FreeOp,
    FreeResult,
    GroupKind,
    GroupSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheError,
    KVCacheManager,
    LoraRef,
    MMFeature,
    OutOfRangeError,
    RequestExistsError,
    RequestNotFoundError,
    ResourceExhaustedError,
)
from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.shared.events import Tier
from kv_manager_service.core.groups import cdiv
from kv_manager_service.core.hashing import BlockHasher, HashExtras

# Prompts are prefixes of a few fixed documents plus a short random suffix,
# over a 4-token alphabet, so that prefix hits (and hash collisions of equal
# blocks in different requests) are common.
_rng = random.Random(20240601)
DOCUMENTS = tuple(tuple(_rng.randrange(4) for _ in range(48)) for _ in range(3))
MAX_MODEL_LEN = 40
MAX_NUM_REQUESTS = 8
LORA = LoraRef("adapter", "/adapters/a")

# Runs and steps per run scale with the loaded hypothesis profile (tests/conftest.py). A run is a
# sequence of up to `stateful_step_count` calls, so a machine takes half the profile's example count.
# No explain phase and one bug per report: a failing machine reports in seconds, not minutes.
MACHINE_SETTINGS = settings(
    max_examples=max(1, settings.default.max_examples // 2),
    deadline=None,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    # Rules with preconditions are skipped while no request is live; on a
    # loaded 2-core CI machine that must not read as a failing health check.
    suppress_health_check=(HealthCheck.filter_too_much, HealthCheck.too_slow),
)
# Multi-group configs get more runs: cross-group interactions need rarer states.
MULTI_GROUP_SETTINGS = settings(MACHINE_SETTINGS, max_examples=2 * MACHINE_SETTINGS.max_examples)


def cache_map_entries(manager: KVCacheManager) -> Counter:
    """(group_id, hash) -> number of blocks the pool maps under it."""
    entries: Counter = Counter()
    for group_id, cached in enumerate(manager.pool.cached):
        for block_hash, entry in cached.items():
            entries[(group_id, block_hash)] += 1 if isinstance(entry, KVCacheBlock) else len(entry)
    return entries


def snapshot(manager: KVCacheManager) -> dict[str, Any]:
    """Everything observable (and the internals behind it) that a call may change."""
    return {
        "tables": {rid: manager.block_table(rid) for rid in sorted(manager.requests)},
        "requests": {
            rid: (r.num_tokens, tuple(r.block_hashes), tuple(r.tail_token_ids), tuple(r.num_cached_blocks))
            for rid, r in sorted(manager.requests.items())
        },
        "stats": manager.stats(),
        "pending_copies": manager.pending_copies(),
        "free_queue": [b.block_id for b in manager.pool.free_queue],
        "ref_cnts": [b.ref_cnt for b in manager.pool.blocks[1:]],
        "hashes": [b.block_hash for b in manager.pool.blocks],
        "cache_map": cache_map_entries(manager),
        "events": list(manager.pool.events),
        "last_step_id": manager.last_step_id,
    }


def num_unread_tokens(spec: GroupSpec, num_computed_tokens: int) -> int:
    """Leading tokens that no token from `num_computed_tokens` on reads, per attention kind.

    Written from the attention definitions, independently of the group managers.
    """
    if spec.kind is GroupKind.SLIDING_WINDOW:  # token p reads [p - window + 1, p]
        return max(0, num_computed_tokens - spec.sliding_window + 1)
    if spec.kind is GroupKind.CHUNKED_LOCAL:  # token p reads its own chunk
        return num_computed_tokens // spec.chunk_size * spec.chunk_size
    if spec.kind is GroupKind.MAMBA:  # only the state after the last computed token
        return max(0, num_computed_tokens - 1)
    return 0


class ManagerMachine(RuleBasedStateMachine):
    """Drives one manager; subclasses choose the config family."""

    uses_encoder = False
    max_prompt_len = 30

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.hasher: BlockHasher | None = None
        # The model: every live request's full token sequence and hash inputs.
        self.tokens: dict[str, list[int]] = {}
        self.extras: dict[str, HashExtras] = {}
        self.event_model: Counter = Counter()
        self.host_event_model: Counter = Counter()  # the host tier's hash index, replayed from its events
        self.next_request = 0
        self.prompts: list[tuple[int, ...]] = []
        self.expected: dict[str, AllocateOp] = {}  # expected request id -> the first allocate it was expected with

    def make_config(self, data: st.DataObject) -> KVCacheConfig:
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------

    def new_request_id(self) -> str:
        self.next_request += 1
        return f"r{self.next_request}"

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        """A prefix of a document or of an earlier prompt, plus a short random suffix."""
        sources = DOCUMENTS + tuple(self.prompts[-4:])
        doc = sources[data.draw(st.integers(0, len(sources) - 1), label="source")]
        prefix_len = data.draw(st.integers(0, min(len(doc), self.max_prompt_len)), label="prefix_len")
        suffix = data.draw(st.lists(st.integers(0, 3), max_size=4), label="suffix")
        return (list(doc[:prefix_len]) + suffix) or [0]

    def draw_first_call(self, data: st.DataObject) -> AllocateOp:
        prompt = self.draw_prompt(data)
        num_new = data.draw(st.one_of(st.just(len(prompt)), st.integers(1, len(prompt) + 2)), label="num_new")
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 3]), label="lookahead")
        num_encoder = data.draw(st.integers(0, 12), label="num_encoder") if self.uses_encoder else 0
        salt = data.draw(st.sampled_from([None, None, None, "salt"]), label="salt")
        lora = data.draw(st.sampled_from([None, None, None, LORA]), label="lora")
        mm: tuple[MMFeature, ...] = ()
        if len(prompt) >= 3 and data.draw(st.integers(0, 5), label="with_mm") == 0:
            offset = data.draw(st.integers(0, len(prompt) - 2), label="mm_offset")
            length = data.draw(st.integers(1, len(prompt) - offset), label="mm_length")
            mm = (MMFeature("img", offset, length),)
        skip = data.draw(st.sampled_from([False, False, False, True]), label="skip_prefix_cache")
        return AllocateOp(self.new_request_id(), prompt, num_new, lookahead, num_encoder, salt, lora, mm, skip)

    def first_call_is_valid(self, op: AllocateOp, num_new_requests: int = 1) -> bool:
        return (
            len(op.token_ids) + op.num_lookahead_tokens <= MAX_MODEL_LEN
            and len(self.m.requests) + num_new_requests <= MAX_NUM_REQUESTS
        )

    def record_admitted(self, op: AllocateOp) -> None:
        self.prompts.append(tuple(op.token_ids))
        self.tokens[op.request_id] = list(op.token_ids)
        self.extras[op.request_id] = HashExtras(op.lora, op.cache_salt or None, tuple(op.mm_features))

    def assert_unchanged(self, before: dict[str, Any], **changes: Any) -> None:
        expected = dict(before, **changes)
        after = snapshot(self.m)
        for key in expected:
            assert after[key] == expected[key], f"{key} changed: {expected[key]!r} -> {after[key]!r}"

    def other_table_blocks(self, request_id: str) -> Counter:
        held: Counter = Counter()
        for rid in self.m.requests:
            if rid != request_id:
                for ids in self.m.block_table(rid).block_ids:
                    held.update(b for b in ids if b != 0)
        return held

    def assert_null_slots_are_unread(self, request_id: str, num_computed_tokens: int, exact: bool = True) -> None:
        """A null slot holds only tokens that no token from `num_computed_tokens` on reads.

        With `exact`, also the converse: every such slot is null (recycling
        happened). A cache hit may keep a real block there (a one-token window
        still adopts the block it ends in, as vLLM does).
        """
        m = self.m
        for manager, ids in zip(m.managers, m.block_table(request_id).block_ids):
            bound = num_unread_tokens(manager.spec, num_computed_tokens)
            unread = [(i + 1) * manager.block_size <= bound for i in range(len(ids))]
            null = [block_id == 0 for block_id in ids]
            ok = null == unread if exact else all(u for u, n in zip(unread, null) if n)
            assert ok, (
                f"{request_id} group {manager.group_id} ({manager.spec.kind.value}) at {num_computed_tokens} "
                f"computed tokens: table {ids}"
            )

    def longest_valid_hit(self, op: AllocateOp) -> int:
        """Brute force: the longest prefix every cacheable group can resume from.

        A length L (a multiple of the lcm block size, at most the prompt minus
        one token) is valid for a group when the blocks it will read are in
        its cache map: full attention all of [0, L); a sliding window the
        blocks holding [L - window + 1, L) (at least the last one); chunked
        local those of L's chunk before L; mamba the state block ending at L.
        """
        m = self.m
        if not m.enable_caching:
            return 0
        cached = cache_map_entries(m)
        extras = HashExtras(op.lora, op.cache_salt or None, tuple(op.mm_features))
        chain = self.hasher.hash_blocks(self.hasher.root_hash, op.token_ids, 0, extras)
        k_of = {mgr.group_id: mgr.block_size // m.config.hash_block_size for mgr in m.managers}
        voters = [mgr for mgr in m.managers if mgr.spec.kind is not GroupKind.CROSS_ATTENTION]
        if not voters:
            return 0

        def is_cached(group_id: int, index: int) -> bool:
            return cached[(group_id, chain[(index + 1) * k_of[group_id] - 1])] > 0

        def needed_blocks(spec: GroupSpec, length: int) -> range:
            num_blocks = length // spec.block_size
            if spec.kind is GroupKind.SLIDING_WINDOW:
                return range(max(0, num_blocks - max(1, cdiv(spec.sliding_window - 1, spec.block_size))), num_blocks)
            if spec.kind is GroupKind.CHUNKED_LOCAL:
                return range(length // spec.chunk_size * spec.chunk_size // spec.block_size, num_blocks)
            if spec.kind is GroupKind.MAMBA:
                return range(num_blocks - 1, num_blocks)
            return range(num_blocks)

        lcm = m.config.lcm_block_size
        for length in range((len(op.token_ids) - 1) // lcm * lcm, 0, -lcm):
            if all(all(is_cached(g.group_id, i) for i in needed_blocks(g.spec, length)) for g in voters):
                return length
        return 0

    def check_first_call_result(
        self, op: AllocateOp, result: AllocateResult, hit: CacheHit | None = None, check_fresh: bool = True
    ) -> None:
        m = self.m
        if result.status is AllocateStatus.NO_SPACE:
            assert result == AllocateResult(AllocateStatus.NO_SPACE, 0, 0, (), (), result.step_id)
            return
        assert result.status is AllocateStatus.OK
        if hit is not None:
            assert result.num_computed_tokens == hit.num_cached_tokens
            assert tuple(g.hit_block_ids for g in result.groups) == hit.block_ids
        if op.skip_prefix_cache or not m.enable_caching:
            assert result.num_computed_tokens == 0
            assert all(g.hit_block_ids == () for g in result.groups)
        num_computed = result.num_computed_tokens
        assert 0 <= num_computed <= len(op.token_ids) - 1
        assert result.num_scheduled_tokens == min(op.num_new_tokens, len(op.token_ids) - num_computed)
        assert result.copies == ()
        table = m.block_table(op.request_id)
        assert table.num_computed_tokens == num_computed + result.num_scheduled_tokens
        need_slots = num_computed + result.num_scheduled_tokens + op.num_lookahead_tokens
        others = self.other_table_blocks(op.request_id)
        for manager, group, ids in zip(m.managers, result.groups, table.block_ids):
            assert group.group_id == manager.group_id
            assert group.new_block_index == len(group.hit_block_ids)
            assert group.hit_block_ids + group.new_block_ids == ids
            if manager.spec.kind is GroupKind.CROSS_ATTENTION:
                assert len(ids) == cdiv(op.num_encoder_tokens, manager.block_size)
            else:
                assert len(ids) == cdiv(need_slots, manager.block_size)
            for block_id in group.new_block_ids:
                assert block_id != 0
                if check_fresh:
                    assert others[block_id] == 0, f"fresh block {block_id} is held elsewhere"

    # -- setup ---------------------------------------------------------------------

    @initialize(data=st.data())
    def create_manager(self, data: st.DataObject) -> None:
        config = self.make_config(data)
        if config.enable_prefix_caching:  # every rule's invariants hold under either eviction order
            policy = data.draw(st.sampled_from(EvictionPolicy), label="eviction_policy")
            config = dataclasses.replace(config, eviction_policy=policy)
        self.m = KVCacheManager(config)
        self.hasher = BlockHasher(config.hash_block_size, config.hash_algorithm, config.hash_seed)

    # -- rules ---------------------------------------------------------------------

    @rule(data=st.data())
    def allocate_first_call(self, data: st.DataObject) -> None:
        self.run_first_call(self.draw_first_call(data))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def allocate_first_call_sharing_a_prefix(self, data: st.DataObject) -> None:
        """Most of an earlier prompt again: a prefix hit if its blocks survived."""
        earlier = self.prompts[data.draw(st.integers(0, len(self.prompts) - 1), label="earlier")]
        keep = data.draw(st.integers(len(earlier) // 2, len(earlier)), label="keep")
        suffix = data.draw(st.lists(st.integers(0, 3), max_size=3), label="suffix")
        op = self.draw_first_call(data)
        prompt = list(earlier[:keep]) + suffix or [0]
        num_new = min(op.num_new_tokens, len(prompt))
        self.run_first_call(op._replace(token_ids=prompt, num_new_tokens=num_new, mm_features=()))

    def run_first_call(self, op: AllocateOp) -> None:
        m = self.m
        before = snapshot(m)
        if not self.first_call_is_valid(op):
            with pytest.raises((InvalidArgumentError, ResourceExhaustedError)):
                m.step((op,))
            self.assert_unchanged(before)
            return
        hit = m.find_cache_hit(op.token_ids, op.cache_salt, op.lora, op.mm_features)
        self.assert_unchanged(before)  # find_cache_hit changes nothing
        assert hit.num_cached_tokens == self.longest_valid_hit(op), f"{hit} is not the longest valid hit"
        result = m.step((op,)).results[0]
        assert result.step_id == m.last_step_id == before["last_step_id"] + 1
        self.check_first_call_result(op, result, None if op.skip_prefix_cache else hit)
        event(f"first call: {result.status.name}, hit={result.num_computed_tokens > 0}")
        if result.status is AllocateStatus.NO_SPACE:
            self.assert_unchanged(before, last_step_id=result.step_id)
            with pytest.raises(RequestNotFoundError):
                m.block_table(op.request_id)
        else:
            # A first call does not recycle: its only nulls are those of the adopted hit.
            self.assert_null_slots_are_unread(op.request_id, result.num_computed_tokens, exact=False)
            self.record_admitted(op)
            self.expected.pop(op.request_id, None)  # the admission ends its expectation
        assert (op.request_id in m.expectations) == (op.request_id in self.expected)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def allocate_continuation(self, data: st.DataObject) -> None:
        m = self.m
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="request")
        appended = data.draw(st.lists(st.integers(0, 3), max_size=3), label="appended")
        num_new = data.draw(st.integers(1, 8), label="num_new")
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 2]), label="lookahead")
        num_computed = m.requests[rid].num_computed_tokens
        num_tokens = len(self.tokens[rid]) + len(appended)
        before = snapshot(m)
        if num_tokens == num_computed or num_tokens + lookahead > MAX_MODEL_LEN:
            with pytest.raises((FailedPreconditionError, InvalidArgumentError)) as excinfo:
                m.allocate(rid, appended, num_new, lookahead)
            if num_tokens == num_computed and num_tokens + lookahead <= MAX_MODEL_LEN:
                assert excinfo.type is FailedPreconditionError
            self.assert_unchanged(before)
            return

        old_ids = m.block_table(rid).block_ids
        hashed_before = {b.block_id for b in m.pool.blocks if b.block_hash is not None}
        others = self.other_table_blocks(rid)
        result = m.allocate(rid, appended, num_new, lookahead)
        assert result.step_id == m.last_step_id == before["last_step_id"] + 1
        new_table = m.block_table(rid)

        event(f"continuation: {result.status.name}, copies={len(result.copies) > 0}")
        # Recycling happens first, against the tokens computed before this call.
        self.assert_null_slots_are_unread(rid, num_computed)
        if result.status is AllocateStatus.NO_SPACE:
            assert result == AllocateResult(AllocateStatus.NO_SPACE, num_computed, 0, (), (), result.step_id)
            after = snapshot(m)
            # Only recycling may have happened: slots of recycling groups nulled.
            assert new_table.num_computed_tokens == num_computed
            for manager, old, new in zip(m.managers, old_ids, new_table.block_ids):
                assert len(old) == len(new)
                for a, b in zip(old, new):
                    assert a == b or (b == 0 and manager.recycles), f"group {manager.group_id}: {old} -> {new}"
            for key in ("pending_copies", "events", "hashes", "cache_map"):
                assert after[key] == before[key], f"{key} changed in a NO_SPACE continuation"
            assert after["last_step_id"] == result.step_id
            others_before = {k: v for k, v in before["tables"].items() if k != rid}
            assert {k: v for k, v in after["tables"].items() if k != rid} == others_before
            assert after["requests"] == before["requests"], "a NO_SPACE continuation must not take the tokens"
            s0, s1 = before["stats"], after["stats"]
            assert s1._replace(num_free_blocks=0, usage=0) == s0._replace(num_free_blocks=0, usage=0)
            assert s1.num_free_blocks >= s0.num_free_blocks
            return

        assert result.status is AllocateStatus.OK
        num_scheduled = min(num_new, num_tokens - num_computed)
        assert (result.num_computed_tokens, result.num_scheduled_tokens) == (num_computed, num_scheduled)
        assert new_table.num_computed_tokens == num_computed + num_scheduled
        need_slots = num_computed + num_scheduled + lookahead
        copied = {(c.src_block_id, c.dst_block_id) for c in result.copies}
        assert len(copied) == len(result.copies)
        found_copies = set()
        for manager, group, old, new in zip(m.managers, result.groups, old_ids, new_table.block_ids):
            assert group.group_id == manager.group_id and group.hit_block_ids == ()
            assert group.new_block_ids == new[group.new_block_index :]
            if manager.spec.kind is GroupKind.CROSS_ATTENTION:
                assert new == old, "cross-attention blocks never change after the first call"
                continue
            assert len(new) == max(len(old), cdiv(need_slots, manager.block_size))
            for i, (a, b) in enumerate(zip(old, new)):
                if i < group.new_block_index:
                    assert a == b or (b == 0 and manager.recycles), f"group {manager.group_id}: {old} -> {new}"
                elif a != b and (a, b) in copied:
                    found_copies.add((a, b))
            # Copy-on-write: every block this step writes is private and was not cached.
            for i in range(num_computed // manager.block_size, cdiv(need_slots, manager.block_size)):
                block_id = new[i]
                assert block_id != 0, f"group {manager.group_id} writes the null block at index {i}"
                assert others[block_id] == 0, f"block {block_id} is written while another table holds it"
                if i < len(old) and old[i] == block_id:
                    assert block_id not in hashed_before, f"cached block {block_id} is written in place"
        assert found_copies == copied, f"copies {result.copies} do not match replaced slots"
        pending = m.pending_copies()
        for copy in result.copies:
            assert (result.step_id, copy) in [(p.step_id, p.copy) for p in pending]
        self.tokens[rid].extend(appended)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        m = self.m
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=3, unique=True))
        num_free_before = m.stats().num_free_blocks
        result = m.free(ids)
        assert result.step_id == m.last_step_id
        assert m.stats().num_free_blocks - num_free_before == result.num_freed_blocks
        for rid in ids:
            del self.tokens[rid], self.extras[rid]
            with pytest.raises(RequestNotFoundError):
                m.block_table(rid)

    @rule(data=st.data())
    def expect(self, data: st.DataObject) -> None:
        """A waiting request told ahead: it keeps the prompt's first blocks within the room, and changes no hit,
        table, count or cached hash; only which free blocks go first."""
        m = self.m
        op = self.draw_first_call(data)
        expect = ExpectOp(op.request_id, op.token_ids, op.cache_salt, op.lora, op.mm_features)
        before = snapshot(m)
        if len(op.token_ids) > MAX_MODEL_LEN:
            with pytest.raises(InvalidArgumentError):
                m.step((expect,))
            self.assert_unchanged(before)
            return
        hit = m.find_cache_hit(op.token_ids, op.cache_salt, op.lora, op.mm_features)
        room = m.expectations.max_blocks - m.expectations.num_blocks
        num_blocks = len(op.token_ids) // m.hash_block_size if m.enable_caching else 0
        result = m.step((expect,)).results[0]
        assert result == ExpectResult(min(num_blocks, room) * m.hash_block_size, before["last_step_id"] + 1)
        after = snapshot(m)
        for key in ("tables", "requests", "pending_copies", "ref_cnts", "hashes", "cache_map", "events"):
            assert after[key] == before[key], f"an expect op changed {key}"
        assert sorted(after["free_queue"]) == sorted(before["free_queue"])
        assert m.find_cache_hit(op.token_ids, op.cache_salt, op.lora, op.mm_features) == hit
        self.expected[op.request_id] = op
        event(f"expect: {result.num_expected_tokens} of {len(op.token_ids)} tokens kept")

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def admit_expected(self, data: st.DataObject) -> None:
        self.run_first_call(self.expected[data.draw(st.sampled_from(sorted(self.expected)), label="expected")])

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def withdraw_expected(self, data: st.DataObject) -> None:
        """A free of expected ids (with a live one, maybe) withdraws them and frees nothing of theirs."""
        m = self.m
        ids = data.draw(st.lists(st.sampled_from(sorted(self.expected)), min_size=1, max_size=2, unique=True))
        live = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), max_size=1)) if self.tokens else []
        num_free_before = m.stats().num_free_blocks
        result = m.free(ids + live)
        assert m.stats().num_free_blocks - num_free_before == result.num_freed_blocks
        for rid in ids:
            del self.expected[rid]
            assert rid not in m.expectations
        for rid in live:
            del self.tokens[rid], self.extras[rid]

    @precondition(lambda self: self.expected or self.tokens)
    @rule(data=st.data())
    def rejected_expect(self, data: st.DataObject) -> None:
        """An expect of a live or expected id, or a fork into an expected id, is refused and changes nothing."""
        m = self.m
        before = snapshot(m)
        expected_before = dict(m.expectations.by_request)
        taken = data.draw(st.sampled_from(sorted(self.expected) + sorted(self.tokens)), label="taken")
        if self.tokens and self.expected and data.draw(st.booleans(), label="as_fork_child"):
            parent = data.draw(st.sampled_from(sorted(self.tokens)), label="parent")
            op = ForkOp(parent, [data.draw(st.sampled_from(sorted(self.expected)), label="child")])
        else:
            op = ExpectOp(taken, [1, 2, 3])
        with pytest.raises(RequestExistsError):
            m.step((op,))
        self.assert_unchanged(before)
        assert m.expectations.by_request == expected_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        m = self.m
        parent = data.draw(st.sampled_from(sorted(self.tokens)), label="parent")
        children = [self.new_request_id() for _ in range(data.draw(st.integers(1, 3), label="num_children"))]
        before = snapshot(m)
        if len(m.requests) + len(children) > MAX_NUM_REQUESTS:
            with pytest.raises(ResourceExhaustedError):
                m.fork(parent, children)
            self.assert_unchanged(before)
            return
        result = m.fork(parent, children)
        assert result == ForkResult(before["last_step_id"] + 1)
        parent_table = m.block_table(parent)
        assert parent_table == before["tables"][parent]
        for child in children:
            assert m.block_table(child) == parent_table._replace(request_id=child)
            self.tokens[child] = list(self.tokens[parent])
            self.extras[child] = self.extras[parent]

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        m = self.m
        step_id = data.draw(st.integers(0, m.last_step_id), label="ack_step")
        pending = m.pending_copies()
        last_step_id = m.last_step_id
        assert m.ack(step_id) == sum(1 for p in pending if p.step_id <= step_id)
        assert m.pending_copies() == [p for p in pending if p.step_id > step_id]
        assert m.last_step_id == last_step_id, "ack is not a step"

    @rule(data=st.data())
    def multi_op_step(self, data: st.DataObject) -> None:
        """Two to four valid ops of different requests in one step."""
        m = self.m
        ops: list = []
        used: set[str] = set()
        num_new_requests = 0
        computed_before: dict[str, int] = {}
        for _ in range(data.draw(st.integers(2, 4), label="num_ops")):
            kind = data.draw(st.sampled_from(["first", "continue", "free", "fork"]), label="op_kind")
            unused = sorted(set(self.tokens) - used)
            if kind == "first":
                op = self.draw_first_call(data)
                if not self.first_call_is_valid(op, num_new_requests + 1):
                    continue
                num_new_requests += 1
                ops.append(op)
            elif kind == "continue" and unused:
                rid = data.draw(st.sampled_from(unused), label="request")
                appended = data.draw(st.lists(st.integers(0, 3), max_size=2), label="appended")
                if len(self.tokens[rid]) + len(appended) == m.requests[rid].num_computed_tokens:
                    appended.append(data.draw(st.integers(0, 3)))
                if len(self.tokens[rid]) + len(appended) > MAX_MODEL_LEN:
                    continue
                used.add(rid)
                computed_before[rid] = m.requests[rid].num_computed_tokens
                ops.append(AllocateOp(rid, appended, data.draw(st.integers(1, 8), label="num_new")))
            elif kind == "free" and unused:
                ids = data.draw(st.lists(st.sampled_from(unused), min_size=1, max_size=2, unique=True))
                used.update(ids)
                ops.append(FreeOp(ids))
            elif kind == "fork" and unused:
                parent = data.draw(st.sampled_from(unused), label="parent")
                children = [self.new_request_id() for _ in range(data.draw(st.integers(1, 2)))]
                if len(m.requests) + num_new_requests + len(children) > MAX_NUM_REQUESTS:
                    continue
                num_new_requests += len(children)
                used.add(parent)
                ops.append(ForkOp(parent, children))
        if not ops:
            return
        last_step_id = m.last_step_id
        # Sometimes under a block budget (a tenant's quota room): never more taken, net.
        budget = data.draw(st.one_of(st.none(), st.integers(0, 6)), label="max_new_blocks")
        free_before = m.pool.get_num_free_blocks()
        result = m.step(ops, max_new_blocks=budget)
        if budget is not None:
            assert free_before - m.pool.get_num_free_blocks() <= budget
        assert result.step_id == m.last_step_id == last_step_id + 1
        assert len(result.results) == len(ops)
        for op, op_result in zip(ops, result.results):
            assert op_result.step_id == result.step_id
            if isinstance(op, AllocateOp) and op.request_id in computed_before:
                assert isinstance(op_result, AllocateResult)
                assert op_result.num_computed_tokens == computed_before[op.request_id]
                if op_result.status is AllocateStatus.OK:
                    self.tokens[op.request_id].extend(op.token_ids)
            elif isinstance(op, AllocateOp):
                # Later ops of the step may adopt this op's blocks as hits.
                self.check_first_call_result(op, op_result, check_fresh=False)
                if op_result.status is AllocateStatus.OK:
                    self.record_admitted(op)
            elif isinstance(op, FreeOp):
                assert isinstance(op_result, FreeResult)
                for rid in op.request_ids:
                    del self.tokens[rid], self.extras[rid]
            else:
                assert isinstance(op_result, ForkResult)
                for child in op.child_request_ids:
                    self.tokens[child] = list(self.tokens[op.parent_request_id])
                    self.extras[child] = self.extras[op.parent_request_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def decode_batch(self, data: st.DataObject) -> None:
        """A decode batch (after a nested op, sometimes) against its allocate ops, one by one, on a twin:
        `KVCacheManager._decode` against `KVCacheManager._continue`."""
        m = self.m
        live = sorted(self.tokens)
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True), label="decoded")
        ids = [rid for rid in ids if len(self.tokens[rid]) < MAX_MODEL_LEN]
        if not ids:
            return
        batch = DecodeBatch(ids, [data.draw(st.integers(0, 3), label="token") for _ in ids])
        others = sorted(set(live) - set(ids))
        ops = [FreeOp(others[:1])] if others and data.draw(st.booleans(), label="free first") else []
        budget = data.draw(st.one_of(st.none(), st.integers(0, 4)), label="max_new_blocks")
        twin = deepcopy(m)
        twin_step = KVCacheManager.step.__get__(twin)  # the class's step: a machine may wrap the instance's
        result = m.step(ops, max_new_blocks=budget, decode=batch)
        expected = twin_step([*ops, *batch.as_ops()], max_new_blocks=budget)
        assert snapshot(m) == snapshot(twin)
        assert result.delta == expected.delta
        assert result.results == expected.results[: len(ops)]
        entries = expected.results[len(ops) :]
        decoded = result.decode
        assert decoded.statuses == [r.status for r in entries]
        assert decoded.num_computed_tokens == [r.num_computed_tokens for r in entries]
        assert decoded.changes == [(i, g) for i, r in enumerate(entries) for g in r.groups if g.new_block_ids]
        assert decoded.copies == [c for r in entries for c in r.copies]
        event(f"decode batch: {sum(s is AllocateStatus.OK for s in decoded.statuses)} of {len(ids)} OK")
        for rid in ops[0].request_ids if ops else ():
            del self.tokens[rid], self.extras[rid]
        for rid, token, status in zip(ids, batch.token_ids, decoded.statuses):
            if status is AllocateStatus.OK:
                self.tokens[rid].append(token)

    @rule(data=st.data())
    def rejected_decode_batch(self, data: st.DataObject) -> None:
        """A decode batch with a mistake in one entry raises, located at that entry, and changes nothing."""
        m = self.m
        live = [rid for rid in sorted(self.tokens) if len(self.tokens[rid]) < MAX_MODEL_LEN]
        full = [rid for rid in sorted(self.tokens) if len(self.tokens[rid]) >= MAX_MODEL_LEN]
        good = live[:2]
        cases = [(RequestNotFoundError, "ghost", 1, "request_id")]
        if good:
            cases += [
                (InvalidArgumentError, good[0], 1, "request_id"),  # twice in the batch
                (InvalidArgumentError, "fresh", -1, "token_ids"),
                (InvalidArgumentError, "fresh", 1 << 32, "token_ids"),
            ]
        if full:
            cases.append((InvalidArgumentError, full[0], 1, "token_ids"))  # past max_model_len
        expected, bad_id, bad_token, field = data.draw(st.sampled_from(cases), label="mistake")
        if bad_token != 1:
            bad_id = good[-1]
            good = good[:-1]
        ops = [AllocateOp("fresh-by-op", [1, 2], 2)] if data.draw(st.booleans(), label="with an op") else []
        batch = DecodeBatch([*good, bad_id], [1] * len(good) + [bad_token])
        before = snapshot(m)
        with pytest.raises(KVCacheError) as excinfo:
            m.step(ops, decode=batch)
        assert excinfo.type is expected, f"expected {expected.__name__}, got {excinfo.type.__name__}: {excinfo.value}"
        assert excinfo.value.op_index == len(ops) + len(good)
        assert excinfo.value.op_field == field
        self.assert_unchanged(before)

    @rule(data=st.data())
    def rejected_call(self, data: st.DataObject) -> None:
        """A caller mistake raises its typed error and changes nothing at all."""
        m = self.m
        live = sorted(self.tokens)
        some = live[0] if live else None
        ghost = "ghost"
        cases = [
            (RequestNotFoundError, lambda: m.free([ghost])),
            (InvalidArgumentError, lambda: m.free([])),
            (RequestNotFoundError, lambda: m.fork(ghost, ["child-of-ghost"])),
            (InvalidArgumentError, lambda: m.allocate("fresh", [1, 2], 0)),
            (InvalidArgumentError, lambda: m.allocate("fresh", [], 1)),
            (InvalidArgumentError, lambda: m.allocate("fresh", [1, -1], 2)),
            (InvalidArgumentError, lambda: m.allocate("fresh", [1, 1 << 32], 2)),
            (InvalidArgumentError, lambda: m.allocate("fresh", [1] * (MAX_MODEL_LEN + 1), 1)),
            (OutOfRangeError, lambda: m.ack(m.last_step_id + 1)),
            (InvalidArgumentError, lambda: m.ack(-1)),
            # A valid op followed by an invalid one: the whole step is refused.
            (RequestNotFoundError, lambda: m.step([AllocateOp("fresh", [1, 2, 3], 3), FreeOp([ghost])])),
            (InvalidArgumentError, lambda: m.step([AllocateOp("fresh", [1], 1), AllocateOp("fresh", [2], 1)])),
        ]
        if some is not None:
            cases += [
                (RequestExistsError, lambda: m.fork(some, [some])),
                (RequestExistsError, lambda: m.fork(some, ["c9", some])),
                (InvalidArgumentError, lambda: m.step([AllocateOp("fresh", [1], 1), ForkOp(some, ["fresh"])])),
                (InvalidArgumentError, lambda: m.step([FreeOp([some]), AllocateOp(some, [1], 1)])),
                (InvalidArgumentError, lambda: m.step([ForkOp(some, ["c1", "c1"])])),
                (InvalidArgumentError, lambda: m.allocate(some, [1], 1, cache_salt="another-salt")),
                (InvalidArgumentError, lambda: m.allocate(some, [1], 1, num_lookahead_tokens=-1)),
            ]
        expected, call = data.draw(st.sampled_from(cases), label="mistake")
        before = snapshot(m)
        with pytest.raises(KVCacheError) as excinfo:
            call()
        assert excinfo.type is expected, f"expected {expected.__name__}, got {excinfo.type.__name__}"
        self.assert_unchanged(before)

    @rule(data=st.data())
    def reset_or_drain(self, data: st.DataObject) -> None:
        """Rarer, destructive operations: reset_prefix_cache, or free everything and ack."""
        if data.draw(st.booleans(), label="drain"):
            self.free_everything_and_ack()
        else:
            self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        m = self.m
        before = snapshot(m)
        idle = before["stats"].num_free_blocks == m.config.num_blocks - 1
        assert m.reset_prefix_cache() is idle
        event(f"reset_prefix_cache accepted={idle}")
        if idle:
            assert all(h is None for h in (b.block_hash for b in m.pool.blocks))
            assert not cache_map_entries(m)
            # No real block is left to hit (chunked-local groups may still report
            # earlier chunks as hit through null blocks).
            hit = m.find_cache_hit(list(DOCUMENTS[0][:20]))
            assert all(block_id == 0 for ids in hit.block_ids for block_id in ids)
        else:
            self.assert_unchanged(before)

    def free_everything_and_ack(self) -> None:
        m = self.m
        if self.tokens:
            m.free(sorted(self.tokens))
            self.tokens.clear()
            self.extras.clear()
        m.ack(m.last_step_id)
        stats = m.stats()
        assert stats.num_requests == 0 and stats.num_pending_copies == 0
        assert stats.num_free_blocks == m.config.num_blocks - 1, f"{stats} after freeing everything"
        assert stats.usage == 0.0

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def core_invariants_hold(self) -> None:
        if self.m is None:
            return
        self.m.check_invariants()

    @invariant()
    def model_agrees_with_manager(self) -> None:
        m = self.m
        if m is None:
            return
        assert set(m.requests) == set(self.tokens)
        assert set(m.expectations.by_request) == set(self.expected)
        assert m.stats().num_requests == len(self.tokens)
        for rid, tokens in self.tokens.items():
            request = m.requests[rid]
            assert request.num_tokens == len(tokens)
            if m.enable_caching:
                # Incremental hashing equals hashing the whole sequence at once.
                expected = self.hasher.hash_blocks(self.hasher.root_hash, tokens, 0, self.extras[rid])
                assert request.block_hashes == expected, f"{rid}: hash chain differs from the whole-sequence chain"

    @invariant()
    def events_replay_to_the_cache_map(self) -> None:
        m = self.m
        if m is None:
            return
        for kv_event in m.take_events():
            if isinstance(kv_event, BlockStored):
                model = self.event_model if kv_event.tier is Tier.DEVICE else self.host_event_model
                if kv_event.tier is Tier.DEVICE:
                    assert kv_event.block_size == m.config.groups[kv_event.group_id].block_size
                assert len(kv_event.block_hashes) >= 1
                for block_hash in kv_event.block_hashes:
                    model[(kv_event.group_id, block_hash)] += 1
            elif isinstance(kv_event, BlockRemoved):
                model = self.event_model if kv_event.tier is Tier.DEVICE else self.host_event_model
                for block_hash in kv_event.block_hashes:
                    key = (kv_event.group_id, block_hash)
                    assert model[key] > 0, f"removed {key} from the {kv_event.tier.value} tier, never stored there"
                    model[key] -= 1
            else:
                assert isinstance(kv_event, AllBlocksCleared)
                self.event_model.clear()
                self.host_event_model.clear()
        self.event_model = +self.event_model
        self.host_event_model = +self.host_event_model
        assert self.event_model == cache_map_entries(m)
        host_keys = m.host_tier.cached_block_keys() if m.host_tier is not None else set()
        assert self.host_event_model == Counter(host_keys), "the host tier's events disagree with its index"


def _common(num_blocks: int, groups: tuple[GroupSpec, ...], **kwargs: Any) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        groups=groups,
        enable_events=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_requests=MAX_NUM_REQUESTS,
        **kwargs,
    )


class FullAttentionMachine(ManagerMachine):
    def make_config(self, data: st.DataObject) -> KVCacheConfig:
        block_size = data.draw(st.integers(2, 8), label="block_size")
        groups = (GroupSpec(GroupKind.FULL_ATTENTION, block_size),)
        return _common(data.draw(st.integers(4, 24), label="num_blocks"), groups)


class CachingDisabledMachine(ManagerMachine):
    def make_config(self, data: st.DataObject) -> KVCacheConfig:
        block_size = data.draw(st.integers(2, 8), label="block_size")
        return _common(
            data.draw(st.integers(4, 24), label="num_blocks"),
            (GroupSpec(GroupKind.FULL_ATTENTION, block_size),),
            enable_prefix_caching=False,
        )


class HybridMachine(ManagerMachine):
    """full_attention(4) + sliding_window(2, window 5) + mamba(4): gcd 2, lcm 4."""

    max_prompt_len = 18

    def make_config(self, data: st.DataObject) -> KVCacheConfig:
        groups = (
            GroupSpec(GroupKind.FULL_ATTENTION, 4),
            GroupSpec(GroupKind.SLIDING_WINDOW, 2, sliding_window=5),
            GroupSpec(GroupKind.MAMBA, 4),
        )
        return _common(data.draw(st.integers(4, 24), label="num_blocks"), groups)


class ChunkedLocalMachine(ManagerMachine):
    """chunked_local(block 4, chunk 8) + full_attention(4)."""

    max_prompt_len = 24

    def make_config(self, data: st.DataObject) -> KVCacheConfig:
        groups = (GroupSpec(GroupKind.CHUNKED_LOCAL, 4, chunk_size=8), GroupSpec(GroupKind.FULL_ATTENTION, 4))
        return _common(data.draw(st.integers(4, 24), label="num_blocks"), groups)


class CrossAttentionMachine(ManagerMachine):
    """full_attention + cross_attention, first calls carry num_encoder_tokens."""

    uses_encoder = True
    max_prompt_len = 24

    def make_config(self, data: st.DataObject) -> KVCacheConfig:
        groups = (
            GroupSpec(GroupKind.FULL_ATTENTION, data.draw(st.integers(2, 8), label="block_size")),
            GroupSpec(GroupKind.CROSS_ATTENTION, data.draw(st.integers(2, 8), label="cross_block_size")),
        )
        return _common(data.draw(st.integers(4, 24), label="num_blocks"), groups)


TestFullAttentionMachine = FullAttentionMachine.TestCase
TestFullAttentionMachine.settings = MACHINE_SETTINGS
TestCachingDisabledMachine = CachingDisabledMachine.TestCase
TestCachingDisabledMachine.settings = MACHINE_SETTINGS
TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = MULTI_GROUP_SETTINGS
TestChunkedLocalMachine = ChunkedLocalMachine.TestCase
TestChunkedLocalMachine.settings = MULTI_GROUP_SETTINGS
TestCrossAttentionMachine = CrossAttentionMachine.TestCase
TestCrossAttentionMachine.settings = MACHINE_SETTINGS


class HostTierMachine(ManagerMachine):
    """Full attention over a tiny device pool with a tiny host tier behind it.

    Device pools of 6..12 blocks and host tiers of 1..12 make eviction,
    offload, host eviction, onload and pins under unacknowledged copies
    happen in most runs. On top of the base contract: a hit continues from
    the device into the host tier block by block; every host position of a
    hit is adopted as a fresh device block loaded by one onload; each op's
    tier copies are exactly its share of the step's; acks release pins.
    """

    max_prompt_len = 16

    def make_config(self, data: st.DataObject) -> KVCacheConfig:
        block_size = data.draw(st.integers(2, 3), label="block_size")
        return _common(
            data.draw(st.integers(6, 12), label="num_blocks"),
            (GroupSpec(GroupKind.FULL_ATTENTION, block_size),),
            num_host_blocks=data.draw(st.integers(1, 12), label="num_host_blocks"),
        )

    @initialize(data=st.data())
    def create_manager(self, data: st.DataObject) -> None:
        super().create_manager(data)
        step = self.m.step

        def checked_step(ops: Any, max_new_blocks: int | None = None, decode: Any = None) -> Any:
            result = step(ops, max_new_blocks, decode)
            self.check_tier_copies(result)
            return result

        self.m.step = checked_step

    def check_tier_copies(self, result: Any) -> None:
        """Each op's tier copies are its share of the step's; onloads fill the hit's host positions."""
        delta = result.delta
        offloads = [c for r in result.results if isinstance(r, AllocateResult) for c in r.offloads]
        onloads = [c for r in result.results if isinstance(r, AllocateResult) for c in r.onloads]
        # A decode batch's entries report no tier copies of their own: theirs come last in the delta.
        assert tuple(offloads) == delta.offloads[: len(offloads)] and tuple(onloads) == delta.onloads[: len(onloads)]
        if result.decode is None:
            assert len(offloads) == len(delta.offloads) and len(onloads) == len(delta.onloads)
        assert len({c.host_block_id for c in delta.offloads}) == len(delta.offloads), "two offloads into one host block"
        pending = self.m.pending_tier_copies()
        for copy in delta.offloads:
            assert (result.step_id, False, copy) in pending
        for copy in delta.onloads:
            assert (result.step_id, True, copy) in pending
        for op_result in result.results:
            if isinstance(op_result, AllocateResult) and op_result.onloads:
                hit_ids = op_result.groups[0].hit_block_ids
                assert all(c.device_block_id in hit_ids for c in op_result.onloads)
                event("onload")
        if delta.offloads:
            event("offload")

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def revisit_after_pressure(self, data: st.DataObject) -> None:
        """Fill the device pool with a prompt that shares nothing (evicting, so offloading), free it, then ask
        for an earlier prompt again: a hit that continues on the host, if its blocks were kept there."""
        m = self.m
        earlier = self.prompts[data.draw(st.integers(0, len(self.prompts) - 1), label="earlier")]
        if self.tokens and data.draw(st.booleans(), label="free_live_first"):
            m.free(sorted(self.tokens))  # their blocks become evictable
            self.tokens.clear()
            self.extras.clear()
        free_tokens = m.stats().num_free_blocks * m.config.groups[0].block_size
        length = data.draw(st.integers(1, max(1, min(MAX_MODEL_LEN, free_tokens))), label="filler_len")
        filler = AllocateOp(self.new_request_id(), [4 + i % 7 for i in range(length)], length)
        self.run_first_call(filler)
        if filler.request_id in self.tokens:
            m.free([filler.request_id])
            del self.tokens[filler.request_id], self.extras[filler.request_id]
        if data.draw(st.booleans(), label="ack_first"):
            m.ack(m.last_step_id)
        op = AllocateOp(self.new_request_id(), list(earlier), len(earlier))
        if self.first_call_is_valid(op):
            self.run_first_call(op)

    def longest_valid_hit(self, op: AllocateOp) -> int:
        """Brute force across tiers: the longest run of blocks each cached on the device or the host."""
        m = self.m
        cached = cache_map_entries(m)
        host = set(m.host_tier.cached_block_keys())
        extras = HashExtras(op.lora, op.cache_salt or None, tuple(op.mm_features))
        chain = self.hasher.hash_blocks(self.hasher.root_hash, op.token_ids, 0, extras)
        block_size = m.config.groups[0].block_size
        k = block_size // m.config.hash_block_size
        num_hit = 0
        while (num_hit + 1) * block_size <= len(op.token_ids) - 1:
            key = (0, chain[(num_hit + 1) * k - 1])
            if not (cached[key] > 0 or key in host):
                break
            num_hit += 1
        return num_hit * block_size

    def check_first_call_result(
        self, op: AllocateOp, result: AllocateResult, hit: CacheHit | None = None, check_fresh: bool = True
    ) -> None:
        if hit is not None and result.status is AllocateStatus.OK:
            # Host positions (-1) become fresh device blocks, each the destination of one onload, in order.
            hit_ids = result.groups[0].hit_block_ids
            onloaded = [d for h, d in zip(hit.block_ids[0], hit_ids) if h == -1]
            assert onloaded == [c.device_block_id for c in result.onloads]
            assert hit.num_host_cached_tokens == len(onloaded) * self.m.config.groups[0].block_size
            others = self.other_table_blocks(op.request_id)
            assert all(others[block_id] == 0 for block_id in onloaded), "an onload writes a block another table holds"
            hit = hit._replace(block_ids=(hit_ids,))
        super().check_first_call_result(op, result, hit, check_fresh)

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        """The base contract, and: the tier copies of acknowledged steps are released with their pins."""
        m = self.m
        step_id = data.draw(st.integers(0, m.last_step_id), label="ack_step")
        pending = m.pending_copies()
        tier_pending = m.pending_tier_copies()
        assert m.ack(step_id) == sum(1 for p in pending if p.step_id <= step_id)
        assert m.pending_copies() == [p for p in pending if p.step_id > step_id]
        assert m.pending_tier_copies() == [p for p in tier_pending if p.step_id > step_id]
        pins = Counter(p.copy.host_block_id for p in m.pending_tier_copies())
        assert m.host_tier.ref_cnts.tolist() == [pins[b] for b in range(m.host_tier.num_blocks)]
        if any(p.step_id <= step_id for p in tier_pending):
            event("ack released tier copies")

    def reset_prefix_cache(self) -> None:
        m = self.m
        pinned_before = m.host_tier.ref_cnts.tolist()
        super().reset_prefix_cache()
        if m.stats().num_free_blocks == m.config.num_blocks - 1:
            assert m.host_tier.num_cached_blocks == 0, "an accepted reset leaves host hashes"
            assert all(m.host_tier.block_hash(b) is None for b in range(m.host_tier.num_blocks))
            assert m.host_tier.ref_cnts.tolist() == pinned_before, "a reset unpins host blocks"

    def free_everything_and_ack(self) -> None:
        super().free_everything_and_ack()
        tier = self.m.host_tier_stats()
        assert tier.num_pending_tier_copies == 0 and tier.num_free_host_blocks == tier.num_host_blocks


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = MULTI_GROUP_SETTINGS
