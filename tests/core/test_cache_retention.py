"""The retention API in the core (docs/retention.md): priorities order evictions, TTL pins keep a
freed request's cached blocks within a hard quota, and an expiry releases exactly the pins it names.

The stateful test drives random admissions (with and without retention),
decodes, frees, forks, acknowledgements, invalidations, resets and clock
ticks, and after every rule checks the core's invariants (pins and priority
segments included) and three properties: a pin whose TTL has passed on the
test's clock never survives the tick; the distinct pinned blocks never exceed
the quota; and an allocation under pressure evicts the free cached blocks in
queue order, which puts every lower priority first.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv_manager_service.core import (
    AllocateOp,
    AllocateStatus,
    DecodeBatch,
    FailedPreconditionError,
    ForkOp,
    FreeOp,
    GroupKind,
    GroupSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheManager,
    KVLossCause,
    Retention,
)
from kv_manager_service.server.pin_clock import PinClock

OK = AllocateStatus.OK
NO_SPACE = AllocateStatus.NO_SPACE
BLOCK = 4


def make_manager(num_blocks: int = 17, max_pinned_blocks: int | None = 8, **kwargs: Any) -> KVCacheManager:
    groups = kwargs.pop("groups", (GroupSpec(GroupKind.FULL_ATTENTION, BLOCK),))
    config = KVCacheConfig(
        num_blocks=num_blocks, groups=groups, retention_max_pinned_blocks=max_pinned_blocks, **kwargs
    )
    return KVCacheManager(config)


def prompt(seed: int, num_blocks: int) -> list[int]:
    """`num_blocks` full blocks of tokens no other seed shares."""
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


def admit(m: KVCacheManager, request_id: str, tokens: list[int], retention: Retention | None = None):
    result = m.allocate(request_id, tokens, len(tokens), retention=retention)
    m.check_invariants()
    return result


def free_queue_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.pool.free_queue]


def cached_ids(m: KVCacheManager, tokens: list[int]) -> tuple[int, ...]:
    """The device blocks a first allocate of `tokens` plus one token would hit."""
    return m.find_cache_hit(tokens + [0]).block_ids[0]


# -- priorities ------------------------------------------------------------------------


def test_a_higher_priority_is_evicted_after_every_lower_one_and_lru_within_a_priority():
    m = make_manager(num_blocks=13)
    admit(m, "low", prompt(1, 2))
    admit(m, "high", prompt(2, 2), Retention(priority=5))
    admit(m, "mid", prompt(3, 2), Retention(priority=2))
    admit(m, "low2", prompt(4, 2))
    low, high, mid, low2 = (m.block_table(r).block_ids[0] for r in ("low", "high", "mid", "low2"))
    m.free(["high", "mid", "low", "low2"])
    m.check_invariants()
    # Tail-first within a request; priority 0 first (in LRU order), then 2, then 5.
    assert free_queue_ids(m)[-8:] == [*low[::-1], *low2[::-1], *mid[::-1], *high[::-1]]
    admit(m, "pressure", prompt(5, 7))  # 7 of the 12 free blocks: 4 unhashed, then the priority-0 ones
    assert cached_ids(m, prompt(1, 2)) == ()
    assert cached_ids(m, prompt(2, 2)) == high and cached_ids(m, prompt(3, 2)) == mid
    admit(m, "more", prompt(6, 2))  # the last of low2, then mid's tail: every priority 0 went first
    assert cached_ids(m, prompt(3, 2)) == mid[:1] and cached_ids(m, prompt(2, 2)) == high


def test_a_block_keeps_the_highest_priority_that_cached_or_hit_it_until_it_is_evicted():
    m = make_manager(num_blocks=9)
    tokens = prompt(1, 2)
    admit(m, "a", tokens)
    admit(m, "b", tokens + [7], Retention(priority=9))  # hits a's two blocks
    blocks = m.block_table("a").block_ids[0]
    assert [m.pool.priorities.get(m.pool.blocks[b], 0) for b in blocks] == [9, 9]
    m.free(["a", "b"])
    admit(m, "c", tokens + [8])  # a priority-0 hit leaves the priority as it is
    m.free(["c"])
    assert [m.pool.priorities[m.pool.blocks[b]] for b in blocks] == [9, 9]
    admit(m, "pressure", prompt(2, 8))  # every free block, so the priority-9 ones too
    assert m.pool.priorities == {} and cached_ids(m, tokens) == ()
    m.check_invariants()


def test_priorities_follow_the_blocks_a_request_caches_as_it_decodes():
    m = make_manager()
    admit(m, "a", prompt(1, 1) + [5], Retention(priority=3))
    for token in range(BLOCK):
        m.step((), decode=DecodeBatch(["a"], [token]))
    m.check_invariants()
    table = [m.pool.blocks[b] for b in m.block_table("a").block_ids[0]]
    assert [m.pool.priorities.get(b, 0) for b in table] == [3, 3, 0]  # the third block is not full


# -- pins ------------------------------------------------------------------------------


def test_a_pin_keeps_a_freed_requests_blocks_cached_through_pressure_until_it_expires():
    m = make_manager(num_blocks=9)
    tokens = prompt(1, 2)
    admit(m, "sys", tokens, Retention(ttl_ms=60_000))
    blocks = m.block_table("sys").block_ids[0]
    m.free(["sys"])
    [(pin_id, ttl_ms)] = m.take_new_pins()
    assert ttl_ms == 60_000 and m.stats().num_pinned_blocks == 2 and m.stats().num_free_blocks == 6
    assert admit(m, "big", prompt(2, 7)).status is NO_SPACE  # the pinned blocks are not evictable
    admit(m, "fits", prompt(3, 6))
    m.free(["fits"])
    assert cached_ids(m, tokens) == blocks
    assert m.expire_pins([pin_id]) == 2
    m.check_invariants()
    assert cached_ids(m, tokens) == blocks and m.stats().num_pins == 0  # still cached, now evictable
    assert admit(m, "big", prompt(2, 8)).status is OK
    assert cached_ids(m, tokens) == ()


def test_expiring_an_unknown_pin_changes_nothing():
    m = make_manager()
    admit(m, "a", prompt(1, 2), Retention(ttl_ms=5))
    m.free(["a"])
    [(pin_id, _)] = m.take_new_pins()
    before = m.export_state()
    with pytest.raises(InvalidArgumentError) as error:
        m.expire_pins([pin_id, pin_id + 1])
    assert error.value.field == "pin_ids"
    assert m.export_state() == before


def test_a_pin_takes_what_room_the_quota_has_left_prefix_first():
    m = make_manager(num_blocks=17, max_pinned_blocks=3)
    admit(m, "a", prompt(1, 2), Retention(ttl_ms=1000))
    admit(m, "b", prompt(2, 3), Retention(ttl_ms=1000))
    b_blocks = m.block_table("b").block_ids[0]
    m.free(["a", "b"])
    m.check_invariants()
    stats = m.stats()
    assert (stats.num_pins, stats.num_pinned_blocks, stats.num_unpinned_blocks) == (2, 3, 2)
    assert [pin.blocks[0].block_id for pin in m.pins.pins.values()][1] == b_blocks[0]
    # A pin of blocks already pinned costs no room.
    admit(m, "a2", prompt(1, 2) + [1], Retention(ttl_ms=1000))
    m.free(["a2"])
    assert (m.stats().num_pins, m.stats().num_pinned_blocks) == (3, 3)


def test_a_prompt_the_quota_could_never_pin_is_refused_naming_the_field_and_the_limit():
    m = make_manager(max_pinned_blocks=2)
    before = m.export_state()
    with pytest.raises(InvalidArgumentError) as error:
        m.step((AllocateOp("a", prompt(1, 3), 12, retention=Retention(ttl_ms=10)),))
    assert error.value.field == "ops[0].retention.ttl_ms"
    assert "retention_max_pinned_blocks is 2" in str(error.value)
    assert m.export_state() == before
    admit(m, "b", prompt(1, 2), Retention(ttl_ms=10))  # two blocks fit


@pytest.mark.parametrize(
    ("retention", "field"),
    [(Retention(priority=101), "retention.priority"), (Retention(priority=-1), "retention.priority"),
     (Retention(ttl_ms=-5), "retention.ttl_ms"), (Retention(ttl_ms=1.5), "retention.ttl_ms")],
)  # fmt: skip
def test_a_retention_out_of_range_is_refused(retention, field):
    m = make_manager()
    with pytest.raises(InvalidArgumentError) as error:
        admit(m, "a", prompt(1, 1), retention)
    assert error.value.op_field == field


def test_pins_off_and_caching_off_refuse_what_they_cannot_keep():
    with pytest.raises(InvalidArgumentError, match="retention_max_pinned_blocks is 0"):
        admit(make_manager(max_pinned_blocks=0), "a", [1], Retention(ttl_ms=10))
    admit(make_manager(max_pinned_blocks=0), "a", [1], Retention(priority=4))
    with pytest.raises(FailedPreconditionError):
        admit(make_manager(enable_prefix_caching=False), "a", [1], Retention(priority=4))


def test_a_continuation_may_repeat_its_retention_but_not_change_it():
    m = make_manager()
    admit(m, "a", prompt(1, 1), Retention(priority=2, ttl_ms=10))
    m.allocate("a", [1], 1, retention=Retention(priority=2, ttl_ms=10))
    with pytest.raises(InvalidArgumentError) as error:
        m.allocate("a", [1], 1, retention=Retention(priority=3, ttl_ms=10))
    assert error.value.op_field == "retention"
    m.check_invariants()


def test_the_default_quota_is_a_tenth_of_the_pool():
    assert KVCacheConfig(num_blocks=1001).max_pinned_blocks == 100
    with pytest.raises(ValueError, match="retention_max_pinned_blocks"):
        KVCacheConfig(num_blocks=11, retention_max_pinned_blocks=11)


def test_emptying_the_cache_releases_every_pin():
    m = make_manager()
    admit(m, "a", prompt(1, 2), Retention(priority=4, ttl_ms=10))
    m.free(["a"])
    assert m.reset_prefix_cache()  # pins hold only cache: a reset releases them
    m.check_invariants()
    assert m.stats().num_pins == 0 and m.pool.priorities == {}
    admit(m, "b", prompt(1, 2), Retention(ttl_ms=10))
    admit(m, "live", prompt(2, 1))
    m.free(["b"])
    assert not m.reset_prefix_cache()  # a live request holds blocks: refused, the pin stays
    assert m.stats().num_pins == 1
    m.invalidate_all(KVLossCause.WORKER_RESTARTED)
    m.check_invariants()
    assert m.stats().num_pins == 0 and m.stats().num_pinned_blocks == 0


def test_a_pinned_block_that_leaves_the_cache_leaves_its_pin():
    m = make_manager()
    admit(m, "a", prompt(1, 2), Retention(ttl_ms=10))
    first, second = m.block_table("a").block_ids[0]
    m.free(["a"])
    m.invalidate_blocks([second], [], [], KVLossCause.KV_MISSING)
    m.check_invariants()
    assert [b.block_id for pin in m.pins.pins.values() for b in pin.blocks] == [first]
    m.invalidate_blocks([first], [], [], KVLossCause.KV_MISSING)
    m.check_invariants()
    assert m.stats().num_pins == 0 and free_queue_ids(m)[:2] == [first, second]


def test_a_state_with_pins_and_priorities_restores_to_a_core_that_behaves_the_same():
    m = make_manager(num_blocks=13)
    admit(m, "p", prompt(1, 2), Retention(priority=3, ttl_ms=50))
    admit(m, "q", prompt(2, 2), Retention(priority=1))
    admit(m, "r", prompt(3, 1))
    m.free(["p", "q", "r"])
    admit(m, "live", prompt(4, 1), Retention(priority=2, ttl_ms=5))
    copy = KVCacheManager.from_state(m.config, m.export_state())
    assert copy.export_state() == m.export_state()
    for manager in (m, copy):
        pins = manager.live_pins()
        manager.free(["live"])
        manager.expire_pins([pins[0][0]])
        admit(manager, "pressure", prompt(5, 9))
    assert copy.export_state() == m.export_state()


# -- with no retention, nothing changes --------------------------------------------------


@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_steps=st.integers(10, 60))
def test_an_all_zero_retention_behaves_exactly_as_none(seed, num_steps):
    """The feature's code path with nothing asked of it (every admission carries Retention(0, 0), and
    the pin calls run between steps) gives the same results, deltas, events and state as no retention."""
    import random

    runs = []
    for with_retention in (False, True):
        rng = random.Random(seed)
        m = make_manager(num_blocks=20, enable_events=True)
        said = []
        live: list[str] = []
        for step in range(num_steps):
            ops = []
            if rng.random() < 0.6 or not live:
                tokens = prompt(rng.randrange(4), 1)[: rng.randrange(1, BLOCK + 1)] + prompt(9, rng.randrange(3))
                ops.append(AllocateOp(f"r{step}", tokens, len(tokens), retention=Retention() if with_retention else None))
            elif rng.random() < 0.5:
                ops.append(FreeOp([live.pop(rng.randrange(len(live)))]))
            else:
                ops.append(ForkOp(live[0], [f"r{step}"]))
            decoding = [r for r in live if m.requests[r].num_tokens < 40 and all(r not in str(op) for op in ops)]
            result = m.step(ops, decode=DecodeBatch(decoding, [step % 5] * len(decoding)) if decoding else None)
            if ops and type(ops[0]) is AllocateOp and result.results[0].status is OK:
                live.append(ops[0].request_id)
            if ops and type(ops[0]) is ForkOp:
                live.append(ops[0].child_request_ids[0])
            if with_retention:
                assert m.take_new_pins() == [] and m.expire_pins([]) == 0
            m.check_invariants()
            said.append((result, m.take_events()))
        runs.append((said, m.export_state()))
    assert runs[0] == runs[1]


# -- the stateful test ----------------------------------------------------------------------

MACHINE_SETTINGS = settings(
    max_examples=max(1, settings.default.max_examples // 2),
    deadline=None,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    suppress_health_check=(HealthCheck.filter_too_much, HealthCheck.too_slow),
)
DOCUMENTS = tuple(tuple((d * 7 + i * 3) % 5 for i in range(32)) for d in range(3))
RETENTIONS = st.sampled_from(
    [Retention(priority=4, ttl_ms=300), Retention(ttl_ms=100), Retention(priority=1), None, Retention(priority=4),
     Retention(ttl_ms=1000), None, Retention(), Retention(priority=1, ttl_ms=50)]
)  # fmt: skip


class RetentionMachine(RuleBasedStateMachine):
    """Random traffic with retention on a tiny pool; the test's PinClock plays the server's clock."""

    @initialize(
        num_blocks=st.integers(8, 16),
        quota=st.sampled_from([6, 4, 8, 2, 0]),
        hybrid=st.booleans(),
        policy=st.sampled_from(["lru", "frequency"]),
    )
    def create(self, num_blocks: int, quota: int, hybrid: bool, policy: str) -> None:
        groups = [GroupSpec(GroupKind.FULL_ATTENTION, 2)]
        if hybrid:
            groups.append(GroupSpec(GroupKind.SLIDING_WINDOW, 2, sliding_window=3))
        self.m = make_manager(
            num_blocks=num_blocks, max_pinned_blocks=min(quota, num_blocks - 1), groups=tuple(groups),
            eviction_policy=policy,
        )  # fmt: skip
        self.clock = PinClock()
        self.now = 0.0
        self.deadlines: dict[int, float] = {}
        self.expired: set[int] = set()
        self.next_id = 0

    def live(self) -> list[str]:
        return list(self.m.requests)

    def step(self, ops: list, decode: DecodeBatch | None = None) -> None:
        """One step; the free cached blocks it evicts are the head of the queue it found."""
        m = self.m
        before = [(b, b.block_hash) for b in m.pool.free_queue if b.block_hash is not None]
        try:
            m.step(ops, decode=decode)
        except (InvalidArgumentError, FailedPreconditionError):
            return
        still_free = [(b, h) for b, h in before if not (b.ref_cnt and b.block_hash == h)]  # not adopted as a hit
        evicted = [b.block_hash != h for b, h in still_free]
        assert evicted == sorted(evicted, reverse=True), "a free cached block was evicted before one ahead of it"
        if any(evicted) and m.pool.priorities:
            event("evicted with priorities")
        if m.stats().num_unpinned_blocks:
            event("a pin was clamped")
        for pin_id, ttl_ms in m.take_new_pins():
            self.deadlines[pin_id] = self.now + ttl_ms / 1e3
            self.clock.start([(pin_id, ttl_ms)], self.now)

    @rule(data=st.data(), retention=RETENTIONS)
    def admit(self, data: st.DataObject, retention: Retention | None) -> None:
        """A first allocate, with or without retention; invalid ones (a prompt past the quota) change nothing."""
        document = DOCUMENTS[data.draw(st.integers(0, 2))]
        tokens = list(document[: 10 - data.draw(st.integers(0, 9))]) + data.draw(st.lists(st.integers(0, 4), max_size=2))
        self.next_id += 1
        self.step([AllocateOp(f"r{self.next_id}", tokens, len(tokens), retention=retention)])

    @rule(data=st.data(), ttl_ms=st.sampled_from([100, 300, 50, 1000]), priority=st.sampled_from([0, 4, 1]))
    def pin_a_prompt(self, data: st.DataObject, ttl_ms: int, priority: int) -> None:
        """A request that pins its prompt as it ends (a system prompt, an agent's context)."""
        self.admit(data, Retention(priority, ttl_ms))
        if f"r{self.next_id}" in self.m.requests:
            self.step([FreeOp([f"r{self.next_id}"])])

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        live = [r for r in self.live() if self.m.requests[r].num_tokens < 24]
        if live:
            chosen = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3))
            self.step([], DecodeBatch(chosen, [1] * len(chosen)) if chosen else None)

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data(), rollback=st.sampled_from([False, False, False, True]))
    def free(self, data: st.DataObject, rollback: bool) -> None:
        request_ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3, unique=True))
        requests = self.m.requests
        computed = [data.draw(st.integers(0, requests[r].num_computed_tokens)) for r in request_ids] if rollback else []
        self.step([FreeOp(request_ids, computed)])

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        self.next_id += 1
        self.step([ForkOp(data.draw(st.sampled_from(self.live())), [f"r{self.next_id}"])])

    @rule()
    def ack(self) -> None:
        self.m.ack(self.m.last_step_id)

    @rule(seconds=st.sampled_from([0.01, 0.06, 0.2, 0.5]))
    def tick(self, seconds: float) -> None:
        """The server's expiry: the clock says which pins are due, and exactly those are released."""
        self.now += seconds
        due = self.clock.due(self.now, self.m.has_pin)
        self.m.expire_pins(due)
        self.expired.update(due)
        if due:
            event("pins expired")
        for pin_id, _ in self.m.live_pins():
            assert self.deadlines[pin_id] > self.now, f"pin {pin_id} outlived its deadline"

    @precondition(lambda self: self.m.pins.pins)
    @rule(data=st.data())
    def invalidate_a_pinned_block(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(b.block_id for b in self.m.pins.counts)))
        self.m.invalidate_blocks([block], [], [], KVLossCause.KV_MISSING)

    @rule(how=st.sampled_from([None] * 6 + ["reset", "worker restarted"]))  # rarely: it empties the cache
    def empty_the_cache(self, how: str | None) -> None:
        if how == "reset":
            self.m.reset_prefix_cache()
        elif how == "worker restarted":
            self.m.invalidate_all(KVLossCause.WORKER_RESTARTED)

    @rule()
    def restore(self) -> None:
        """A snapshot restores pins, priorities and segments exactly."""
        m = self.m
        m.take_events()
        copy = KVCacheManager.from_state(m.config, m.export_state())
        copy.pins.new, m.pins.new = m.pins.new, []
        self.m = copy

    @invariant()
    def consistent(self) -> None:
        m = self.m
        m.check_invariants()
        stats = m.stats()
        assert stats.num_pinned_blocks <= m.config.max_pinned_blocks
        assert not self.expired & {pin_id for pin_id, _ in m.live_pins()}, "an expired pin is live again"


TestRetentionMachine = RetentionMachine.TestCase
TestRetentionMachine.settings = MACHINE_SETTINGS
