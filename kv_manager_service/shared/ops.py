"""Typed values at the scheduler boundary: the operations and their results."""

from __future__ import annotations

import enum
from typing import NamedTuple, Sequence, Union

from kv_manager_service.shared.hash_types import BlockHash, LoraRef, MMFeature


class AllocateStatus(enum.IntEnum):
    # Values match the wire enum `AllocateStatus` (0 is UNSPECIFIED there).
    OK = 1
    NO_SPACE = 2
    KV_LOST = 3  # the request's KV is gone (see KVLossCause): nothing changed; free it and admit it again


class KVLossCause(enum.IntEnum):
    """Why KV the manager counted as computed is not in the workers' memory (wire enum `KVLossCause`)."""

    WORKER_RESTARTED = 1  # a known worker came back with a new incarnation: empty memory
    WORKER_JOINED = 2  # a worker the manager did not know: empty memory
    STEP_REFUSED = 3  # a worker refused an Execute: its tokens were not computed
    KV_MISSING = 4  # a worker found blocks it never filled before reading them
    NOT_COMPUTED = 5  # a scheduler said so when freeing (FreeOp.num_computed_tokens)


class KVLossCount(NamedTuple):
    """What one cause has invalidated since the start."""

    cause: KVLossCause
    num_uncached_blocks: int  # device blocks that left the prefix cache
    num_uncached_host_blocks: int
    num_lost_requests: int


class Invalidation(NamedTuple):
    """What one invalidation did: blocks that left the prefix cache, and the live requests newly lost."""

    num_uncached_blocks: int
    num_uncached_host_blocks: int
    lost_request_ids: tuple[str, ...]


class MissingKVReport(NamedTuple):
    """A worker's report that it does not hold KV the manager counts as computed (ReportMissingKV)."""

    worker_id: str
    incarnation: int  # as the worker registered; 0: not said
    step_id: int  # the step the worker was about to run
    cause: int  # a KVLossCause as sent: the replica accepts STEP_REFUSED and KV_MISSING only
    device_block_ids: tuple[int, ...]
    host_block_ids: tuple[int, ...]
    request_ids: tuple[str, ...]


class BlockCopy(NamedTuple):
    """Copy the KV of block `src_block_id` into `dst_block_id` before the step runs."""

    src_block_id: int
    dst_block_id: int


class TierCopy(NamedTuple):
    """Copy one block between the device pool and the host tier before the step runs.

    The direction is the list that carries it: an offload copies device ->
    host, an onload host -> device (see `host_tier` for the order a worker
    applies them in).
    """

    device_block_id: int
    host_block_id: int


MAX_RETENTION_PRIORITY = 100


class Retention(NamedTuple):
    """How a request's cached blocks are kept (docs/retention.md); the default keeps them as vLLM does.

    `priority`: 0 (the default) to MAX_RETENTION_PRIORITY. A free cached block
    is evicted only after every evictable block of a lower priority; a block
    takes the highest priority of the requests that cached or hit it, until
    it leaves the cache. `ttl_ms`: 0, or when the request is freed its cached
    blocks are pinned (kept cached, out of the free queue) until the manager
    expires the pin, this long after, within the pool's pin quota.
    """

    priority: int = 0
    ttl_ms: int = 0


class AllocateOp(NamedTuple):
    """Schedule tokens of a request.

    On the first call for `request_id`, `token_ids` is the prompt; on later
    calls it holds only the tokens appended since (usually one sampled token).
    `cache_salt`, `lora`, `mm_features`, `num_encoder_tokens` and `retention`
    belong to the first call; later calls may repeat them but not change them.
    """

    request_id: str
    token_ids: Sequence[int]
    num_new_tokens: int
    num_lookahead_tokens: int = 0
    num_encoder_tokens: int = 0
    cache_salt: str | None = None
    lora: LoraRef | None = None
    mm_features: tuple[MMFeature, ...] = ()
    skip_prefix_cache: bool = False
    retention: Retention | None = None


class FreeOp(NamedTuple):
    """Free requests, in order.

    `num_computed_tokens`: empty, or one per request id, how many of its
    tokens really had their KV computed; the blocks past that leave the
    prefix cache first, and the live requests holding them lose their KV.
    """

    request_ids: Sequence[str]
    num_computed_tokens: Sequence[int] = ()


class ForkOp(NamedTuple):
    parent_request_id: str
    child_request_ids: Sequence[str]


class ExpectOp(NamedTuple):
    """A request the scheduler has queued and will admit later, with its prompt (core/expectations.py).

    Until its first allocate (which must repeat the same prompt to hit what
    was kept) or a free of its id, the cached blocks of `token_ids` are
    evicted after the blocks no expected request needs. `cache_salt`, `lora`
    and `mm_features` are those its first allocate will carry.
    """

    request_id: str
    token_ids: Sequence[int]
    cache_salt: str | None = None
    lora: LoraRef | None = None
    mm_features: tuple[MMFeature, ...] = ()


Op = Union[AllocateOp, FreeOp, ForkOp, ExpectOp]


class DecodeBatch(NamedTuple):
    """The common step in columns: each live request appends and schedules the one token it sampled.

    Entry i means exactly `AllocateOp(request_ids[i], [token_ids[i]], 1)`; the
    entries run after the step's other ops, in order. Unlike an allocate op, an
    entry only continues a live request. Its results come in columns too
    (`DecodeResults`), so that the common entry, which writes into a slot its
    tables already hold, builds no object at all.
    """

    request_ids: Sequence[str]
    token_ids: Sequence[int]

    def as_ops(self) -> list[AllocateOp]:
        return [AllocateOp(request_id, [token_id], 1) for request_id, token_id in zip(self.request_ids, self.token_ids)]


class GroupAllocation(NamedTuple):
    """How one group's table changed.

    `hit_block_ids`: the adopted cache hit (first call only), null block (0)
    where the group keeps no block. `new_block_ids`: the table from index
    `new_block_index` on, after this step; normally the appended blocks, but it
    starts earlier when a shared block was replaced by its copy.
    """

    group_id: int
    hit_block_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    new_block_index: int


class AllocateResult(NamedTuple):
    status: AllocateStatus
    num_computed_tokens: int  # where this step's tokens start
    num_scheduled_tokens: int
    groups: tuple[GroupAllocation, ...]
    copies: tuple[BlockCopy, ...]
    step_id: int
    # Host-tier copies this op ordered (always empty without a host tier).
    offloads: tuple[TierCopy, ...] = ()
    onloads: tuple[TierCopy, ...] = ()


class DecodeResults(NamedTuple):
    """A `DecodeBatch`'s results, entry i in position i of each column, as its AllocateResult says them.

    `changes` lists (entry index, GroupAllocation) for each table that changed
    (new blocks, or a shared block replaced by its copy), in entry order;
    `copies` the entries' copy-on-write copies, in entry order.
    """

    statuses: list[AllocateStatus]
    num_computed_tokens: list[int]
    changes: list[tuple[int, GroupAllocation]]
    copies: list[BlockCopy]


class FreeResult(NamedTuple):
    num_freed_blocks: int  # blocks whose ref count reached 0
    step_id: int


class ForkResult(NamedTuple):
    step_id: int


class ExpectResult(NamedTuple):
    num_expected_tokens: int  # the prompt's leading tokens kept as expected, within the room; a hash block's multiple
    step_id: int


OpResult = Union[AllocateResult, FreeResult, ForkResult, ExpectResult]


class CacheHit(NamedTuple):
    """The hit a first allocate would adopt now.

    `num_cached_tokens` counts the whole hit, both tiers. With a host tier,
    `num_host_cached_tokens` of them are in blocks only the host holds (the
    most of any group), and `block_ids` holds -1 at those positions: the
    device block an allocate would load them into is chosen only then.
    """

    num_cached_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per group, as `hit_block_ids`
    num_host_cached_tokens: int = 0


class BlockTable(NamedTuple):
    request_id: str
    num_computed_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per group
    # In a delta's rows_added: the leading tokens whose KV the blocks held before
    # the step (a prefix hit, or a fork child's parent's tokens); later blocks are new.
    num_hit_tokens: int = 0


class BlockAppend(NamedTuple):
    """Blocks that replace or extend one group's table of a live request, from `new_block_index` on."""

    request_id: str
    group_id: int
    new_block_index: int
    block_ids: tuple[int, ...]


class StepDelta(NamedTuple):
    """What one step changed in the block tables, and the copies to make before it runs: a worker's input.

    `rows_added` are whole tables of requests that appeared (first allocates,
    fork children); `blocks_appended` change existing requests' tables. A
    request appears in at most one op of a step, so the parts may be applied
    in any order. Each part lists its entries in op order.
    """

    step_id: int
    rows_added: tuple[BlockTable, ...]
    blocks_appended: tuple[BlockAppend, ...]
    copies: tuple[BlockCopy, ...]
    requests_freed: tuple[str, ...]
    # Host-tier copies, in op order; applied before `copies` (see `host_tier`).
    offloads: tuple[TierCopy, ...] = ()
    onloads: tuple[TierCopy, ...] = ()


class StepResult(NamedTuple):
    """One result per op, in order, and the step's delta for workers.

    `delta` is built by the core, which alone knows which ops admitted a
    request; a client that rebuilds a StepResult from a response leaves it None.
    `decode` holds the results of the step's DecodeBatch, if it had one.
    """

    step_id: int
    results: tuple[OpResult, ...]
    delta: StepDelta | None = None
    decode: DecodeResults | None = None
    # Live requests whose KV is lost, oldest first, until they are freed (see KVLossCause).
    lost_requests: tuple[tuple[str, KVLossCause], ...] = ()


class PrefixLookupKeys(NamedTuple):
    """What to ask other replicas' caches about a prompt (see `KVCacheManager.find_cache_hit_and_lookup_keys`).

    A replica holding the first n of `block_hashes` holds n * `block_size`
    tokens, which count as a hit rounded down to a multiple of `alignment`
    tokens, as local hits are.
    """

    group_id: int
    block_size: int
    alignment: int
    block_hashes: list[BlockHash]


class PendingCopy(NamedTuple):
    step_id: int
    copy: BlockCopy


class PendingTierCopy(NamedTuple):
    """A host-tier copy not yet acknowledged; its host block stays pinned until then."""

    step_id: int
    is_onload: bool
    copy: TierCopy


class HostTierStats(NamedTuple):
    num_host_blocks: int
    num_free_host_blocks: int  # cached-but-evictable included
    prefix_cache_host_hits: int  # tokens of admission hits loaded from the host
    num_offloaded_blocks: int
    num_onloaded_blocks: int
    num_host_evictions: int
    num_dropped_offloads: int  # evicted device blocks not kept: every host block was pinned
    num_pending_tier_copies: int


class Stats(NamedTuple):
    num_blocks: int
    num_free_blocks: int  # in the free queue, cached-but-evictable included
    usage: float
    num_requests: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_evictions: int
    num_pending_copies: int
    kv_losses: tuple[KVLossCount, ...] = ()  # by cause, the causes that invalidated anything
    # Retention (docs/retention.md): live pins, the distinct blocks they hold, and the blocks that
    # pins asked for since the start but the quota had no room for.
    num_pins: int = 0
    num_pinned_blocks: int = 0
    num_unpinned_blocks: int = 0
    # Expected requests (core/expectations.py): how many, and the hash blocks their prompts keep.
    num_expected_requests: int = 0
    num_expected_blocks: int = 0
