"""The manager facade: the scheduler-facing semantics of the whole core.

The scheduler does not track computed tokens; the manager does. Every
accepted call takes the next step id, which is what workers follow; a step is
validated whole before anything changes, so an invalid op changes nothing.
Each step returns its results and its `StepDelta`, the workers' input, built
here where each change is made.

The module is longer than most (about 850 lines) because a step's whole
application (admission, continuation with copy-on-write, the columnar decode
batch, free, fork, ack) shares the reference-count and retention bookkeeping
that the invariants in `invariants.py` check together; split apart, each half
would need the other's private state. A continuation's rules (copy-on-write,
the hash chain, growing and caching) are each written once and shared by the
general path and the columnar decode (see "The three rules" below).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from kv_manager_service.core.block_pool import BlockPool
from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.shared.config import KVCacheConfig
from kv_manager_service.core.coordinator import KVCacheCoordinator
from kv_manager_service.core.expectations import Expectations
from kv_manager_service.shared.errors import (
    InvalidArgumentError,
    OutOfRangeError,
)
from kv_manager_service.shared.events import KVEvent
from kv_manager_service.core.groups import make_group_manager
from kv_manager_service.core.groups.cross_attention import CrossAttentionManager
from kv_manager_service.core.host_tier import HostBlock, HostTier
from kv_manager_service.core.hashing import NO_EXTRAS, BlockHash, BlockHasher, HashExtras, LoraRef, MMFeature
from kv_manager_service.shared.ops import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    BlockAppend,
    BlockCopy,
    BlockTable,
    CacheHit,
    DecodeBatch,
    DecodeResults,
    ExpectOp,
    ExpectResult,
    ForkOp,
    ForkResult,
    FreeOp,
    FreeResult,
    GroupAllocation,
    HostTierStats,
    Invalidation,
    KVLossCause,
    Op,
    OpResult,
    PendingCopy,
    PendingTierCopy,
    PrefixLookupKeys,
    Retention,
    Stats,
    StepDelta,
    StepResult,
)
from kv_manager_service.core.invalidation import KVLosses, invalidate_all, invalidate_blocks, uncache_past
from kv_manager_service.core.invariants import check_invariants
from kv_manager_service.core.pins import Pins
from kv_manager_service.core.request import RequestState
from kv_manager_service.core.state import CoreState, export_state, restore_state
from kv_manager_service.core.validation import StepValidator, check_mm_features, check_token_ids


class KVCacheManager:
    """Block tables, prefix caching, fork and copy-on-write over one pool."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.enable_caching = config.enable_prefix_caching
        self.hash_block_size = config.hash_block_size
        self.pool = BlockPool(
            config.num_blocks, len(config.groups), self.enable_caching, config.enable_events, config.eviction_policy
        )
        self.hasher = BlockHasher(self.hash_block_size, config.hash_algorithm, config.hash_seed)
        # The host tier, or None: every tier path is behind this one test, so without it nothing changes.
        self.host_tier = (
            HostTier(config.num_host_blocks, len(config.groups), len(self.hasher.root_hash))
            if config.num_host_blocks
            else None
        )
        self.pool.host_tier = self.host_tier
        self.managers = [
            make_group_manager(group_id, spec, self.pool, self.hash_block_size)
            for group_id, spec in enumerate(config.groups)
        ]
        self.coordinator = KVCacheCoordinator(self.managers, config.lcm_block_size)
        self.requests: dict[str, RequestState] = {}
        # Waiting requests told ahead (expectations.py).
        self.expectations = Expectations(self.pool, config.expected_blocks_room)
        self._validator = StepValidator(self.requests, self.expectations, config)
        self.last_step_id = 0
        # Copies not yet acknowledged, in step order. Each retains both ends:
        # one reference on src and one on dst, counted in `_retained`.
        self._pending_copies: deque[tuple[int, KVCacheBlock, KVCacheBlock]] = deque()
        self._retained: dict[KVCacheBlock, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._recycling = [m for m in self.managers if m.recycles]
        # (group id, block size, is cross-attention) per group, for the hot path.
        self._group_layout = [
            (m.group_id, m.block_size, isinstance(m, CrossAttentionManager)) for m in self.managers
        ]
        self._no_groups: tuple[GroupAllocation, ...] = ()
        # (group id, block size) per group when every group is plain attention, whose tables only grow at
        # the end; None when a group recycles slots or reads an encoder. See `_decode`.
        self._in_place_layout = (
            None
            if self._recycling or any(is_cross for _, _, is_cross in self._group_layout)
            else [(group_id, block_size) for group_id, block_size, _ in self._group_layout]
        )
        # Free blocks the running step must leave in the free queue (its block budget); 0 between steps.
        self._reserve = 0
        # Live requests whose KV the workers do not hold, and why (see invalidation.py); empty almost always.
        self.lost: dict[str, KVLossCause] = {}
        self.kv_losses = KVLosses()
        # Retention pins (pins.py); their blocks' priorities live in the pool (docs/retention.md).
        self.pins = Pins(self.pool, config.max_pinned_blocks)

    # -- the scheduler's calls ---------------------------------------------------

    def allocate(
        self,
        request_id: str,
        new_token_ids: Sequence[int],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_encoder_tokens: int = 0,
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
        mm_features: Sequence[MMFeature] = (),
        skip_prefix_cache: bool = False,
        retention: Retention | None = None,
    ) -> AllocateResult:
        """One allocate op as a step of its own. See `AllocateOp` and `step`."""
        op = AllocateOp(
            request_id,
            new_token_ids,
            num_new_tokens,
            num_lookahead_tokens,
            num_encoder_tokens,
            cache_salt,
            lora,
            tuple(mm_features),
            skip_prefix_cache,
            retention,
        )
        return self.step((op,)).results[0]

    def free(self, request_ids: Sequence[str]) -> FreeResult:
        return self.step((FreeOp(request_ids),)).results[0]

    def fork(self, parent_request_id: str, child_request_ids: Sequence[str]) -> ForkResult:
        return self.step((ForkOp(parent_request_id, child_request_ids),)).results[0]

    def step(
        self, ops: Sequence[Op], max_new_blocks: int | None = None, decode: DecodeBatch | None = None
    ) -> StepResult:
        """Apply `ops` in order as one step, atomically with respect to bad input.

        Every op is validated first (at most one op per request id, fork
        parent and children included); any invalid op raises and nothing
        changes. `NO_SPACE` is a per-op result, not an error.

        `decode`: one more token for each of its live requests, applied after
        `ops` (see `DecodeBatch`); its entries are validated with the ops,
        located at op indices len(ops) + i, and answered in `StepResult.decode`.

        `max_new_blocks` is a budget (a quota's room): the step takes at most
        this many blocks out of the free queue, net of those it puts back. An
        allocate op that would go past it gets `NO_SPACE` and changes nothing,
        exactly as when the pool itself is short.
        """
        self._validator.validate_step(ops, decode)
        self.last_step_id += 1
        step_id = self.last_step_id
        results: list[OpResult] = []
        # The step's delta, gathered where each change is made (see StepDelta).
        rows_added: list[BlockTable] = []
        blocks_appended: list[BlockAppend] = []
        copies: list[BlockCopy] = []
        requests_freed: list[str] = []
        decode_results = None
        ok = AllocateStatus.OK
        host_tier = self.host_tier
        if host_tier is not None:
            host_tier.step_id = step_id
        if max_new_blocks is not None:
            self._reserve = max(0, self.pool.get_num_free_blocks() - max(0, max_new_blocks))
        try:
            for op in ops:
                if type(op) is AllocateOp:
                    if host_tier is not None:
                        num_offloads, num_onloads = len(host_tier.offloads), len(host_tier.onloads)
                    request_id = op.request_id
                    request = self.requests.get(request_id)
                    if request is None:
                        result = self._admit(op, step_id)
                        if result.status is ok:
                            table = self.block_table(request_id)
                            rows_added.append(table._replace(num_hit_tokens=result.num_computed_tokens))
                            if self.expectations.by_request and request_id in self.expectations:
                                self.expectations.end(request_id)  # after its hit left the free queue
                    elif self.lost and request_id in self.lost:
                        result = AllocateResult(
                            AllocateStatus.KV_LOST, request.num_computed_tokens, 0, self._no_groups, (), step_id
                        )
                    else:
                        result = self._continue_into_delta(request, op, step_id, blocks_appended, copies)
                    if host_tier is not None:
                        result = self._with_tier_copies(result, num_offloads, num_onloads)
                    results.append(result)
                elif type(op) is FreeOp:
                    request_ids = op.request_ids
                    if self.expectations.by_request:
                        request_ids = self._withdraw_expected(request_ids)
                    for request_id, num_computed in zip(op.request_ids, op.num_computed_tokens):
                        if request_id in self.requests:
                            uncache_past(self, self.requests[request_id], num_computed)
                    results.append(FreeResult(self._free(request_ids), step_id))
                    requests_freed += request_ids
                elif type(op) is ExpectOp:
                    results.append(self._expect(op, step_id))
                else:
                    self._fork(op.parent_request_id, op.child_request_ids)
                    results.append(ForkResult(step_id))
                    for child_id in op.child_request_ids:
                        table = self.block_table(child_id)
                        rows_added.append(table._replace(num_hit_tokens=table.num_computed_tokens))
            if decode is not None:
                decode_results = self._decode(decode, step_id, blocks_appended, copies)
        finally:
            self._reserve = 0
        delta = StepDelta(step_id, tuple(rows_added), tuple(blocks_appended), tuple(copies), tuple(requests_freed))
        if host_tier is not None:
            offloads, onloads = host_tier.take_step_copies()
            delta = delta._replace(offloads=offloads, onloads=onloads)
        lost = self.lost_requests() if self.lost else ()
        return StepResult(step_id, tuple(results), delta, decode_results, lost)

    def _with_tier_copies(self, result: AllocateResult, num_offloads: int, num_onloads: int) -> AllocateResult:
        """`result` with the tier copies its op queued: those past the given counts of the step's lists."""
        host_tier = self.host_tier
        if len(host_tier.offloads) == num_offloads and len(host_tier.onloads) == num_onloads:
            return result
        return result._replace(
            offloads=tuple(host_tier.offloads[num_offloads:]), onloads=tuple(host_tier.onloads[num_onloads:])
        )

    def ack(self, step_id: int) -> int:
        """The workers finished every step up to `step_id`: release its copies.

        Returns the number of copy-on-write copies released; the host tier's
        copies of those steps are released too and unpin their host blocks
        (see `pending_tier_copies`). Acknowledging an old step again
        is a no-op; a step that was never issued is `OutOfRangeError`.
        """
        if not isinstance(step_id, int) or step_id < 0:
            raise InvalidArgumentError(f"step_id must be an integer >= 0, got {step_id!r}", "step_id")
        if step_id > self.last_step_id:
            raise OutOfRangeError(f"step_id {step_id} was never issued (last is {self.last_step_id})", "step_id")
        num_released = 0
        pending = self._pending_copies
        while pending and pending[0][0] <= step_id:
            _, src, dst = pending.popleft()
            for block in (src, dst):
                count = self._retained[block] - 1
                if count:
                    self._retained[block] = count
                else:
                    del self._retained[block]
            self.pool.free_blocks((src, dst))
            num_released += 1
        if self.host_tier is not None:
            self.host_tier.release(step_id)
        return num_released

    # -- retention pins (pins.py): the server owns their clock ---------------------------

    def expire_pins(self, pin_ids: Sequence[int]) -> int:
        """The server's clock says these pins' TTLs have passed: release them, in order.

        Their blocks stay cached, each back in the free queue (evictable, at
        its priority) once nothing else holds it; returns how many went back.
        Not a step: no step id, no delta, no event. An id that names no live
        pin is InvalidArgumentError, and nothing changes.
        """
        return self.pins.expire(pin_ids)

    def take_new_pins(self) -> list[tuple[int, int]]:
        """(pin id, ttl ms) of each live pin made since the last call, oldest first: the pins whose
        clocks the server starts."""
        return self.pins.take_new() if self.pins.new else []

    def has_pin(self, pin_id: int) -> bool:
        return pin_id in self.pins.pins

    def live_pins(self) -> list[tuple[int, int]]:
        """(pin id, ttl ms) of every live pin, oldest first."""
        return [(pin.pin_id, pin.ttl_ms) for pin in self.pins.pins.values()]

    # -- rollback: KV the workers do not hold (see invalidation.py) -------------------

    def invalidate_blocks(
        self,
        device_block_ids: Sequence[int],
        host_block_ids: Sequence[int],
        request_ids: Sequence[str],
        cause: KVLossCause,
    ) -> Invalidation:
        """A worker does not hold these blocks filled, nor these requests' KV: un-cache, and lose
        every live request that would read them. Bad block ids change nothing (InvalidArgumentError)."""
        return invalidate_blocks(self, device_block_ids, host_block_ids, request_ids, cause)

    def invalidate_all(self, cause: KVLossCause) -> Invalidation:
        """No worker memory holds anything: empty the cache on both tiers; every request with KV is lost."""
        return invalidate_all(self, cause)

    def lost_requests(self) -> tuple[tuple[str, KVLossCause], ...]:
        """The live requests whose KV is lost, and why, oldest first."""
        lost = self.lost
        return tuple((request_id, lost[request_id]) for request_id in self.requests if request_id in lost)

    # -- queries -----------------------------------------------------------------

    def find_cache_hit(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
        mm_features: Sequence[MMFeature] = (),
    ) -> CacheHit:
        """Exactly the hit a first `allocate` of `token_ids` would adopt now, both tiers. Changes nothing."""
        check_token_ids(token_ids, "token_ids")
        check_mm_features(tuple(mm_features), len(token_ids))
        if not self.enable_caching or not token_ids:
            return self._no_hit()
        return self._hit(self._prompt_hashes(token_ids, cache_salt, lora, mm_features), len(token_ids))

    def find_cache_hit_and_lookup_keys(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
        mm_features: Sequence[MMFeature] = (),
    ) -> tuple[CacheHit, PrefixLookupKeys | None]:
        """`find_cache_hit` of `token_ids`, and what to ask other replicas' caches about it; one hashing.

        The lookup keys are the first cacheable group's block hashes, as many
        as a hit may adopt (at least one token is left to compute): None when
        no group is cacheable, as when prefix caching is off.
        """
        check_token_ids(token_ids, "token_ids")
        check_mm_features(tuple(mm_features), len(token_ids))
        if not self.enable_caching or not token_ids:
            return self._no_hit(), None
        hashes = self._prompt_hashes(token_ids, cache_salt, lora, mm_features)
        return self._hit(hashes, len(token_ids)), self._lookup_keys(hashes, len(token_ids))

    def _prompt_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None, lora: LoraRef | None, mm_features: Sequence[MMFeature]
    ) -> list[BlockHash]:
        extras = _extras(cache_salt, lora, tuple(mm_features))
        return self.hasher.hash_blocks(self.hasher.root_hash, token_ids, 0, extras)

    def _no_hit(self) -> CacheHit:
        return CacheHit(0, tuple(() for _ in self.managers))

    def _hit(self, block_hashes: list[BlockHash], num_tokens: int) -> CacheHit:
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(block_hashes, num_tokens - 1)
        if self.host_tier is not None:
            return CacheHit(
                num_hit_tokens,
                tuple(tuple(-1 if type(b) is HostBlock else b.block_id for b in blocks) for blocks in hits),
                self._num_host_tokens(hits),
            )
        return CacheHit(num_hit_tokens, tuple(tuple(b.block_id for b in blocks) for blocks in hits))

    def block_table(self, request_id: str) -> BlockTable:
        request = self._get(request_id, "request_id")
        return BlockTable(
            request_id,
            request.num_computed_tokens,
            tuple(tuple(b.block_id for b in table) for table in request.tables),
        )

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is live (allocated and not freed)."""
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        """The live requests' ids, oldest first."""
        return list(self.requests)

    def cached_block_counts(self) -> Counter[tuple[int, BlockHash]]:
        """How many cached blocks carry each (group id, block hash); free cached blocks included.

        The cache does not de-duplicate (see BlockPool), so a hash may name
        several blocks of one group.
        """
        counts: Counter[tuple[int, BlockHash]] = Counter()
        for group_id, cached in enumerate(self.pool.cached):
            for block_hash, entry in cached.items():
                counts[(group_id, block_hash)] = 1 if type(entry) is KVCacheBlock else len(entry)
        return counts

    def _lookup_keys(self, block_hashes: list[BlockHash], num_tokens: int) -> PrefixLookupKeys | None:
        group = next((m for m in self.managers if m.cacheable), None)
        if group is None:
            return None
        k = group.hashes_per_block
        max_blocks = (num_tokens - 1) // group.block_size
        hashes = block_hashes[k - 1 :: k][:max_blocks]
        return PrefixLookupKeys(group.group_id, group.block_size, self.coordinator.alignment, hashes)

    def pending_copies(self) -> list[PendingCopy]:
        return [PendingCopy(s, BlockCopy(src.block_id, dst.block_id)) for s, src, dst in self._pending_copies]

    def pending_tier_copies(self) -> list[PendingTierCopy]:
        """The host tier's unacknowledged copies in step order; empty without a tier."""
        return self.host_tier.pending_copies() if self.host_tier is not None else []

    def host_tier_stats(self) -> HostTierStats | None:
        """The host tier's usage and traffic; None without a tier."""
        host_tier = self.host_tier
        if host_tier is None:
            return None
        return HostTierStats(
            num_host_blocks=host_tier.num_blocks,
            num_free_host_blocks=host_tier.free_queue.num_free,
            prefix_cache_host_hits=host_tier.num_hit_tokens,
            num_offloaded_blocks=host_tier.num_offloaded_blocks,
            num_onloaded_blocks=host_tier.num_onloaded_blocks,
            num_host_evictions=host_tier.num_evictions,
            num_dropped_offloads=host_tier.num_dropped_offloads,
            num_pending_tier_copies=len(host_tier.pending),
        )

    def stats(self) -> Stats:
        return Stats(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.get_num_free_blocks(),
            usage=self.pool.get_usage(),
            num_requests=len(self.requests),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_evictions=self.pool.num_evictions,
            num_pending_copies=len(self._pending_copies),
            kv_losses=self.kv_losses.counts(),
            num_pins=len(self.pins.pins),
            num_pinned_blocks=len(self.pins.counts),
            num_unpinned_blocks=self.pins.num_unpinned_blocks,
            num_expected_requests=len(self.expectations),
            num_expected_blocks=self.expectations.num_blocks,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the whole prefix cache, both tiers. Refused (False) while any device block is held
        by a request or a pending copy; retention pins are released first, since they hold only cache.

        Host blocks pinned by pending copies stay pinned until acknowledged.
        """
        if self.pins.pins and not self.requests and not self._pending_copies:
            self.pins.release_all()
        if not self.pool.reset_prefix_cache():
            return False
        if self.host_tier is not None:
            self.host_tier.reset()
        return True

    def take_events(self) -> list[KVEvent]:
        """Drain the queued cache events, oldest first."""
        return self.pool.take_events()

    def _get(self, request_id: str, field: str) -> RequestState:
        return self._validator.get(request_id, field)

    # -- application: input already validated ------------------------------------

    def _admit(self, op: AllocateOp, step_id: int) -> AllocateResult:
        """First allocate: look up the prefix cache, adopt the hit, allocate the rest.

            |<-- hit (adopted) -->|<-- scheduled -->|<- lookahead ->|
            0                 computed                           need_slots
        """
        token_ids = op.token_ids
        num_tokens = len(token_ids)
        extras = _extras(op.cache_salt, op.lora, op.mm_features)
        managers = self.managers
        if self.enable_caching:
            block_hashes = self.hasher.hash_blocks(self.hasher.root_hash, token_ids, 0, extras)
        else:
            block_hashes = []
        if self.enable_caching and not op.skip_prefix_cache:
            hits, num_computed = self.coordinator.find_longest_cache_hit(block_hashes, num_tokens - 1)
        else:
            hits, num_computed = [[] for _ in managers], 0
        num_scheduled = min(op.num_new_tokens, num_tokens - num_computed)
        need_slots = num_computed + num_scheduled + op.num_lookahead_tokens

        num_needed = 0
        for manager, hit in zip(managers, hits):
            num_needed += max(0, manager.num_required_blocks(need_slots, op.num_encoder_tokens) - len(hit))
            # A hit block still in the free queue leaves it when adopted; a host hit needs a device block.
            num_needed += sum(
                1 for block in hit if type(block) is HostBlock or (block.ref_cnt == 0 and not block.is_null)
            )
        if num_needed > self.pool.get_num_free_blocks() - self._reserve:
            return AllocateResult(AllocateStatus.NO_SPACE, 0, 0, self._no_groups, (), step_id)

        # Take every group's hit before popping any new block: a popped block
        # could otherwise be another group's hit, still in the free queue.
        if self.host_tier is None:
            for hit in hits:
                self.pool.touch(hit)
        else:
            hits = self._adopt_hits_across_tiers(hits, block_hashes)
        tables = []
        groups = []
        for manager, hit in zip(managers, hits):
            num_new = max(0, manager.num_required_blocks(need_slots, op.num_encoder_tokens) - len(hit))
            new_blocks = self.pool.get_new_blocks(num_new) if num_new else []
            tables.append(hit + new_blocks)
            groups.append(
                GroupAllocation(
                    manager.group_id,
                    tuple(b.block_id for b in hit),
                    tuple(b.block_id for b in new_blocks),
                    len(hit),
                )
            )
        num_cached_blocks = [
            manager.cache_blocks(table, block_hashes, len(hit), num_computed + num_scheduled)
            for manager, table, hit in zip(managers, tables, hits)
        ]
        num_hashed = len(block_hashes) * self.hash_block_size
        retention = op.retention
        if retention is not None:
            if retention == _NO_RETENTION or not self.enable_caching:
                retention = None
            elif retention.priority:
                for table in tables:
                    self.pool.raise_priority(table, retention.priority)
        self.requests[op.request_id] = RequestState(
            op.request_id,
            num_tokens,
            num_computed + num_scheduled,
            op.num_encoder_tokens,
            extras,
            block_hashes,
            list(token_ids[num_hashed:]) if self.enable_caching else [],
            tables,
            num_cached_blocks,
            retention,
        )
        if self.enable_caching and not op.skip_prefix_cache:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_computed
        return AllocateResult(AllocateStatus.OK, num_computed, num_scheduled, tuple(groups), (), step_id)

    def _adopt_hits_across_tiers(
        self, hits: list[list[KVCacheBlock]], block_hashes: list[BlockHash]
    ) -> list[list[KVCacheBlock]]:
        """Take a hit that may hold host blocks; returns it with a device block at every position.

        Device hits are touched and host hits pinned first, all groups at
        once: the device blocks popped next may evict (and so offload, and so
        evict host blocks), and neither kind of hit may be the victim. Each
        host hit then gets a fresh device block, entered into the device
        cache under the same hash, and an onload copy host -> device for this
        step. Its tokens count as computed: the worker loads them before the
        forward pass. The caller has checked that the device blocks are there.
        """
        host_tier = self.host_tier
        pool = self.pool
        for hit in hits:
            pool.touch([block for block in hit if type(block) is not HostBlock])
            for block in hit:
                if type(block) is HostBlock:
                    host_tier.pin_for_onload(block)
        num_host_tokens = self._num_host_tokens(hits)
        if not num_host_tokens:
            return hits
        device_hits = []
        for manager, hit in zip(self.managers, hits):
            k = manager.hashes_per_block
            table = []
            for index, block in enumerate(hit):
                if type(block) is HostBlock:
                    device_block = pool.get_new_blocks(1)[0]
                    host_tier.record_onload(block, device_block)
                    parent = block_hashes[index * k - 1] if index else None
                    pool.cache_full_blocks(
                        manager.group_id, [device_block], [block.block_hash], parent, manager.block_size
                    )
                    block = device_block
                table.append(block)
            device_hits.append(table)
        host_tier.num_hit_tokens += num_host_tokens
        return device_hits

    def _num_host_tokens(self, hits: list[list[KVCacheBlock]]) -> int:
        """Tokens of a hit held only by the host tier: the most of any group."""
        return max(
            (sum(1 for b in hit if type(b) is HostBlock) * m.block_size for m, hit in zip(self.managers, hits)),
            default=0,
        )

    def _continue(self, request: RequestState, op: AllocateOp, step_id: int) -> AllocateResult:
        """A later allocate: append the new tokens, recycle, copy-on-write, allocate.

        Blocks the request will never read again are recycled first, even if
        the call then ends in NO_SPACE (they are gone either way).

            |<-- computed -->|<-- scheduled -->|<- lookahead ->|
            0            num_computed                     need_slots
                             ^ writes start here: a block from here on that
                               another live table holds is copied first
        """
        tables = request.tables
        num_computed = request.num_computed_tokens
        for manager in self._recycling:
            manager.remove_skipped_blocks(tables[manager.group_id], num_computed)
        token_ids = op.token_ids
        num_tokens = request.num_tokens + len(token_ids)
        num_scheduled = num_tokens - num_computed
        if op.num_new_tokens < num_scheduled:
            num_scheduled = op.num_new_tokens
        need_slots = num_computed + num_scheduled + op.num_lookahead_tokens

        # Blocks that this step writes and another live table also holds; a
        # reference held only by a pending copy does not count.
        shared: list[tuple[int, int]] = []
        num_needed = 0
        for group_id, block_size, is_cross in self._group_layout:
            table = tables[group_id]
            if is_cross:
                num_needed += max(0, -(-request.num_encoder_tokens // block_size) - len(table))
                continue
            required = -(-need_slots // block_size)
            for index in range(num_computed // block_size, min(len(table), required)):
                block = table[index]
                if block.ref_cnt > 1 and self._is_shared(block):  # ref_cnt > 1: the rule's cheap half, first
                    shared.append((group_id, index))
            if required > len(table):
                num_needed += required - len(table)
        if num_needed + len(shared) > self.pool.free_queue.num_free_blocks - self._reserve:
            return AllocateResult(AllocateStatus.NO_SPACE, num_computed, 0, self._no_groups, (), step_id)

        request.num_tokens = num_tokens
        if token_ids and self.enable_caching:
            self._append_to_tail(request, token_ids)

        num_committed = num_computed + num_scheduled
        if not shared and not num_needed:
            # The common decode step: every slot it writes is in the table already and held by it
            # alone, so no table changes; the same result as the general path below, sooner.
            self._grow_and_commit(request, num_committed)
            groups = tuple([GroupAllocation(m.group_id, (), (), len(tables[m.group_id])) for m in self.managers])
            return AllocateResult(AllocateStatus.OK, num_computed, num_scheduled, groups, (), step_id)

        copies = []
        first_changed = [len(table) for table in tables]
        for group_id, index in shared:
            table = tables[group_id]
            src = table[index]
            dst = self.pool.get_new_blocks(1)[0]
            table[index] = dst
            if index * self.managers[group_id].block_size < num_computed:
                # The table's reference on src becomes the copy's retention;
                # dst gets one more, so both outlive the request until acked.
                retained = self._retained
                retained[src] = retained.get(src, 0) + 1
                retained[dst] = retained.get(dst, 0) + 1
                dst.ref_cnt += 1
                self._pending_copies.append((step_id, src, dst))
                copies.append(BlockCopy(src.block_id, dst.block_id))
            else:
                self.pool.free_blocks((src,))  # nothing computed in it: no copy needed
            if index < first_changed[group_id]:
                first_changed[group_id] = index

        num_new_blocks = [
            max(0, m.num_required_blocks(need_slots, request.num_encoder_tokens) - len(tables[m.group_id]))
            for m in self.managers
        ]
        self._grow_and_commit(request, num_committed, num_new_blocks)
        groups = []
        for group_id, table in enumerate(tables):
            start = first_changed[group_id]
            changed = table[start:]
            groups.append(GroupAllocation(group_id, (), tuple([b.block_id for b in changed]) if changed else (), start))
        return AllocateResult(AllocateStatus.OK, num_computed, num_scheduled, tuple(groups), tuple(copies), step_id)

    # The three rules every continuation shares, written once: which written block must be copied
    # first (`_is_shared`), how new tokens extend the hash chain (`_append_to_tail`, which `_decode`
    # inlines for speed), and how tables grow and the blocks the computed tokens fill are cached
    # (`_grow_and_commit`). `_continue` is the general path; `_decode` applies the common decode entry
    # (one token, plain attention) with the same rules, without building an op or a result. The
    # state-machine test checks that the two agree (`decode_batch`).

    def _is_shared(self, block: KVCacheBlock) -> bool:
        """Whether writing into `block` needs copy-on-write: another live table holds it too (a reference
        held only by a pending copy does not count)."""
        return block.ref_cnt - self._retained.get(block, 0) > 1

    def _append_to_tail(self, request: RequestState, token_ids: Sequence[int]) -> None:
        """Append tokens the request now knows to its unhashed tail; hash every hash block the tail fills."""
        tail = request.tail_token_ids
        tail += token_ids
        if len(tail) >= self.hash_block_size:
            self._hash_tail(request)

    def _grow_and_commit(
        self, request: RequestState, num_committed: int, num_new_blocks: Sequence[int] | None = None
    ) -> None:
        """Append `num_new_blocks[g]` fresh blocks to each group's table (None: none), and count the
        request's first `num_committed` tokens as computed, caching the blocks they fill.

        Group by group, each group's new blocks before its caching, so the
        evictions' and the cache's events come in one order on every path.
        """
        num_cached_blocks = request.num_cached_blocks
        tables = request.tables
        grows = num_new_blocks is not None
        for manager in self.managers:
            group_id = manager.group_id
            if grows and num_new_blocks[group_id]:
                tables[group_id] += self.pool.get_new_blocks(num_new_blocks[group_id])
            if num_cached_blocks[group_id] < num_committed // manager.block_size:
                num_cached = num_cached_blocks[group_id]
                num_cached_blocks[group_id] = manager.cache_blocks(
                    tables[group_id], request.block_hashes, num_cached, num_committed
                )
                if request.retention is not None and request.retention.priority:
                    self.pool.raise_priority(
                        tables[group_id][num_cached : num_cached_blocks[group_id]], request.retention.priority
                    )
        request.num_computed_tokens = num_committed

    def _continue_into_delta(
        self,
        request: RequestState,
        op: AllocateOp,
        step_id: int,
        blocks_appended: list[BlockAppend],
        copies: list[BlockCopy],
    ) -> AllocateResult:
        """`_continue`, adding the tables it changed and the copies it ordered to the step's delta."""
        result = self._continue(request, op, step_id)
        for group in result.groups:
            if group.new_block_ids:
                blocks_appended.append(
                    BlockAppend(op.request_id, group.group_id, group.new_block_index, group.new_block_ids)
                )
        if result.copies:
            copies += result.copies
        return result

    def _decode(
        self, batch: DecodeBatch, step_id: int, blocks_appended: list[BlockAppend], copies: list[BlockCopy]
    ) -> DecodeResults:
        """Each entry of `batch` as `_continue` applies its allocate op, the results in columns.

        With plain attention groups, an entry writes its one new token either
        into a slot a table holds already, and alone, or into a new block at
        the end of the table. Almost every entry of a decode step is such a
        one, and they are applied here, as `_continue` would, without
        building an op or a result (the in-place ones, most of them, build
        nothing at all). The rest (a block another table shares, which must
        be copied first; no room; a group that recycles slots or reads an
        encoder) go through `_continue` itself.
        """
        ok = AllocateStatus.OK
        statuses: list[AllocateStatus] = []
        num_computed_tokens: list[int] = []
        changes: list[tuple[int, GroupAllocation]] = []
        decode_copies: list[BlockCopy] = []
        requests = self.requests
        free_queue = self.pool.free_queue
        in_place_layout = self._in_place_layout
        hashes_tokens = self.enable_caching
        hash_block_size = self.hash_block_size
        lost = self.lost
        for index, (request_id, token_id) in enumerate(zip(batch.request_ids, batch.token_ids)):
            request = requests[request_id]
            num_computed = request.num_computed_tokens
            if lost and request_id in lost:
                statuses.append(AllocateStatus.KV_LOST)
                num_computed_tokens.append(num_computed)
                continue
            num_new = None if in_place_layout is None else self._blocks_to_grow(request.tables, num_computed)
            if num_new is not None and (not num_new or sum(num_new) <= free_queue.num_free_blocks - self._reserve):
                request.num_tokens += 1
                if hashes_tokens:  # `_append_to_tail`, inlined: a call per entry costs ~5% of a decode Step
                    tail = request.tail_token_ids
                    tail.append(token_id)
                    if len(tail) >= hash_block_size:
                        self._hash_tail(request)
                if not num_new:
                    self._grow_and_commit(request, num_computed + 1)
                    statuses.append(ok)
                    num_computed_tokens.append(num_computed)
                    continue
                self._grow_and_commit(request, num_computed + 1, num_new)
                for group_id, count in enumerate(num_new):
                    if count:
                        table = request.tables[group_id]
                        group = GroupAllocation(group_id, (), (table[-1].block_id,), len(table) - 1)
                        changes.append((index, group))
                        blocks_appended.append(
                            BlockAppend(request_id, group_id, group.new_block_index, group.new_block_ids)
                        )
                statuses.append(ok)
                num_computed_tokens.append(num_computed)
                continue
            op = AllocateOp(request_id, [token_id], 1)
            result = self._continue_into_delta(request, op, step_id, blocks_appended, copies)
            statuses.append(result.status)
            num_computed_tokens.append(result.num_computed_tokens)
            changes += [(index, group) for group in result.groups if group.new_block_ids]
            decode_copies += result.copies
        return DecodeResults(statuses, num_computed_tokens, changes, decode_copies)

    def _blocks_to_grow(self, tables: list[list[KVCacheBlock]], position: int) -> list[int] | tuple[()] | None:
        """How many blocks (0 or 1) each group's table needs for the token at `position`: () when every
        table holds its slot already (the common case).

        For plain attention groups only (`_in_place_layout`). None when the
        slot is shared (`_is_shared`: writing it needs copy-on-write, which
        `_continue` does), or when a table is short by more than a block.
        """
        num_new: list[int] | tuple[()] = ()
        for group_id, block_size in self._in_place_layout:
            table = tables[group_id]
            slot = position // block_size
            if slot < len(table):
                block = table[slot]
                if block.ref_cnt > 1 and self._is_shared(block):  # ref_cnt > 1: the rule's cheap half, first
                    return None
            elif slot == len(table):
                if not num_new:
                    num_new = [0] * len(tables)
                num_new[group_id] = 1
            else:
                return None
        return num_new

    def _hash_tail(self, request: RequestState) -> None:
        """Extend the request's hash chain over the hash blocks its tail now fills."""
        tail = request.tail_token_ids
        block_hashes = request.block_hashes
        parent = block_hashes[-1] if block_hashes else self.hasher.root_hash
        start = len(block_hashes) * self.hash_block_size
        new_hashes = self.hasher.hash_blocks(parent, tail, start, request.extras)
        block_hashes += new_hashes
        del tail[: len(new_hashes) * self.hash_block_size]

    def _free(self, request_ids: Sequence[str]) -> int:
        """Free requests in order; each group's table last-to-first as one batch. A request with a
        retention TTL first pins its cached blocks (pins.py), so they never reach the free queue."""
        num_freed = 0
        lost = self.lost
        for request_id in request_ids:
            request = self.requests.pop(request_id)
            if lost:
                lost.pop(request_id, None)
            if request.retention is not None and request.retention.ttl_ms:
                self.pins.pin(request, self.managers)
            for table in request.tables:
                num_freed += self.pool.free_blocks(reversed(table))
        return num_freed

    def _expect(self, op: ExpectOp, step_id: int) -> ExpectResult:
        hashes = []
        if self.enable_caching:
            hashes = self._prompt_hashes(op.token_ids, op.cache_salt, op.lora, op.mm_features)
        num_kept = self.expectations.expect(op.request_id, hashes)
        return ExpectResult(num_kept * self.hash_block_size, step_id)

    def _withdraw_expected(self, request_ids: Sequence[str]) -> list[str]:
        """End the expectations among `request_ids`; returns the others, the live requests to free."""
        expectations = self.expectations
        live = []
        for request_id in request_ids:
            if request_id in expectations:
                expectations.end(request_id)
            else:
                live.append(request_id)
        return live

    def _fork(self, parent_request_id: str, child_request_ids: Sequence[str]) -> None:
        parent = self.requests[parent_request_id]
        for child_id in child_request_ids:
            child = parent.fork(child_id)
            for table in child.tables:
                for block in table:
                    if not block.is_null:
                        block.ref_cnt += 1
            self.requests[child_id] = child
            if parent_request_id in self.lost:
                self.lost[child_id] = self.lost[parent_request_id]  # it shares the missing KV

    # -- snapshots -----------------------------------------------------------------

    def export_state(self) -> CoreState:
        """The whole state as plain data, both tiers, for a snapshot (see state.py). Changes nothing."""
        return export_state(self)

    @classmethod
    def from_state(cls, config: KVCacheConfig, state: CoreState) -> "KVCacheManager":
        """A core that behaves on every later op exactly as the one `state` was exported from.

        ValueError when the state's parts disagree (see `restore_state`).
        """
        manager = cls(config)
        restore_state(manager, state)
        return manager

    # -- invariants ----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError, with the counts that disagree, if the state is corrupt.

        See `invariants.check_invariants`; O(pool + tables), for tests.
        """
        check_invariants(self)


_NO_RETENTION = Retention()


def _extras(cache_salt: str | None, lora: LoraRef | None, mm_features: tuple[MMFeature, ...]) -> HashExtras:
    if not cache_salt and lora is None and not mm_features:
        return NO_EXTRAS
    return HashExtras(lora, cache_salt or None, mm_features)
