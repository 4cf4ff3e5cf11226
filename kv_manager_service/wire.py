"""Translation between `kvcache.v1` messages and the shared value types; nothing else.

Only the servicer, the client and the journal's codec call it: everything else speaks values."""

from __future__ import annotations

from typing import Sequence

from kv_manager_service.shared.config import GroupKind, KVCacheConfig
from kv_manager_service.shared.errors import InvalidArgumentError
from kv_manager_service.shared.hash_types import LoraRef, MMFeature
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kv_manager_service.shared.ops import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
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
    KVLossCause,
    KVLossCount,
    MissingKVReport,
    Op,
    OpResult,
    Retention,
    Stats,
    StepDelta,
    StepResult,
)
from kvcache.v1 import kv_manager_pb2 as pb

GROUP_KINDS = {
    GroupKind.FULL_ATTENTION: pb.GROUP_KIND_FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW: pb.GROUP_KIND_SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL: pb.GROUP_KIND_CHUNKED_LOCAL,
    GroupKind.MAMBA: pb.GROUP_KIND_MAMBA,
    GroupKind.CROSS_ATTENTION: pb.GROUP_KIND_CROSS_ATTENTION,
}


# -- requests -> core ------------------------------------------------------------


def lora(name: str, path: str, field: str = "lora_name") -> LoraRef | None:
    if not name:
        if path:
            raise InvalidArgumentError("lora_path is set but lora_name is empty", field)
        return None
    return LoraRef(name, path)


def mm_features(messages: Sequence[pb.MMFeature]) -> tuple[MMFeature, ...]:
    return tuple(MMFeature(m.identifier, m.offset, m.length) for m in messages)


def allocate_op(message: pb.AllocateRequest) -> AllocateOp:
    return AllocateOp(
        message.request_id,
        list(message.token_ids),
        message.num_new_tokens,
        message.num_lookahead_tokens,
        message.num_encoder_tokens,
        message.cache_salt or None,
        lora(message.lora_name, message.lora_path),
        mm_features(message.mm_features),
        message.skip_prefix_cache,
        retention(message.retention) if message.HasField("retention") else None,
    )


def retention(message: pb.Retention) -> Retention:
    return Retention(message.priority, message.ttl_ms)


def retention_message(value: Retention | None) -> pb.Retention | None:
    """None (the field left unset) for None: a request without retention encodes as it did before it existed."""
    return None if value is None else pb.Retention(priority=value.priority, ttl_ms=value.ttl_ms)


def free_op(message: pb.FreeRequest) -> FreeOp:
    return FreeOp(list(message.request_ids), list(message.num_computed_tokens))


def fork_op(message: pb.ForkRequest) -> ForkOp:
    return ForkOp(message.parent_request_id, list(message.child_request_ids))


def expect_op(message: pb.ExpectRequest) -> ExpectOp:
    return ExpectOp(
        message.request_id,
        list(message.token_ids),
        message.cache_salt or None,
        lora(message.lora_name, message.lora_path),
        mm_features(message.mm_features),
    )


def step_ops(message: pb.StepRequest) -> tuple[list[Op], DecodeBatch | None]:
    """The nested ops of a Step, and its decode batch (None when it has no entries)."""
    ops: list[Op] = []
    for index, op in enumerate(message.ops):
        kind = op.WhichOneof("op")
        if kind == "allocate":
            ops.append(allocate_op(op.allocate))
        elif kind == "free":
            ops.append(free_op(op.free))
        elif kind == "fork":
            ops.append(fork_op(op.fork))
        elif kind == "expect":
            ops.append(expect_op(op.expect))
        else:
            raise InvalidArgumentError(f"ops[{index}] sets none of allocate, free, fork, expect", f"ops[{index}]")
    decode = message.decode
    request_ids = decode.request_ids
    token_ids = decode.token_ids
    if len(request_ids) != len(token_ids):
        raise InvalidArgumentError(
            f"decode has {len(request_ids)} request_ids but {len(token_ids)} token_ids; they must pair up",
            "decode.token_ids",
        )
    return ops, DecodeBatch(list(request_ids), list(token_ids)) if request_ids else None


def missing_kv_report(message: pb.ReportMissingKVRequest) -> MissingKVReport:
    """A worker's report as sent (the replica checks its cause)."""
    return MissingKVReport(
        message.worker_id,
        message.incarnation,
        message.step_id,
        message.cause,
        tuple(message.device_block_ids),
        tuple(message.host_block_ids),
        tuple(message.request_ids),
    )


# -- core -> responses -----------------------------------------------------------


def allocate_response(result: AllocateResult) -> pb.AllocateResponse:
    response = pb.AllocateResponse(
        status=int(result.status),
        num_computed_tokens=result.num_computed_tokens,
        num_scheduled_tokens=result.num_scheduled_tokens,
        step_id=result.step_id,
    )
    for group in result.groups:
        response.groups.add(
            group_id=group.group_id,
            hit_block_ids=group.hit_block_ids,
            new_block_ids=group.new_block_ids,
            new_block_index=group.new_block_index,
        )
    for copy in result.copies:
        response.copies.add(src_block_id=copy.src_block_id, dst_block_id=copy.dst_block_id)
    return response


def step_result(result: OpResult) -> pb.StepResult:
    if type(result) is AllocateResult:
        return pb.StepResult(allocate=allocate_response(result))
    if type(result) is FreeResult:
        return pb.StepResult(free=pb.FreeResponse(num_freed_blocks=result.num_freed_blocks, step_id=result.step_id))
    if type(result) is ExpectResult:
        return pb.StepResult(
            expect=pb.ExpectResponse(num_expected_tokens=result.num_expected_tokens, step_id=result.step_id)
        )
    assert type(result) is ForkResult, result
    return pb.StepResult(fork=pb.ForkResponse(step_id=result.step_id))


def step_response(result: StepResult) -> pb.StepResponse:
    """One result per nested op, then the decode batch's results in columns."""
    response = pb.StepResponse(step_id=result.step_id)
    response.results.extend([step_result(r) for r in result.results])
    if result.decode is not None:
        decode_results(result.decode, response.decode)
    for request_id, cause in result.lost_requests:
        response.lost_requests.add(request_id=request_id, cause=cause)
    return response


def step_result_from(response: pb.StepResponse) -> StepResult:
    """The StepResult whose `step_response` is `response` again (no delta: workers' business)."""
    decode = None
    if response.HasField("decode"):
        columns = response.decode
        decode = DecodeResults(
            [AllocateStatus(status) for status in columns.statuses],
            list(columns.num_computed_tokens),
            [
                (c.op_index, GroupAllocation(c.group_id, (), tuple(c.new_block_ids), c.new_block_index))
                for c in columns.changes
            ],
            [BlockCopy(c.src_block_id, c.dst_block_id) for c in columns.copies],
        )
    results = tuple(op_result(r) for r in response.results)
    return StepResult(response.step_id, results, None, decode, lost_requests_from(response))


def lost_requests_from(response: pb.StepResponse) -> tuple[tuple[str, KVLossCause], ...]:
    return tuple((lost.request_id, KVLossCause(lost.cause)) for lost in response.lost_requests)


def kv_loss_count(count: KVLossCount) -> pb.KVLossCount:
    return pb.KVLossCount(
        cause=count.cause,
        num_uncached_blocks=count.num_uncached_blocks,
        num_uncached_host_blocks=count.num_uncached_host_blocks,
        num_lost_requests=count.num_lost_requests,
    )


def kv_loss_count_from(message: pb.KVLossCount) -> KVLossCount:
    return KVLossCount(
        KVLossCause(message.cause),
        message.num_uncached_blocks,
        message.num_uncached_host_blocks,
        message.num_lost_requests,
    )


def decode_results(results: DecodeResults, message: pb.DecodeResults) -> None:
    """Fill `message` with a decode batch's columns; only tables that changed are listed."""
    message.statuses.extend(results.statuses)
    message.num_computed_tokens.extend(results.num_computed_tokens)
    add_change = message.changes.add
    for index, group in results.changes:
        # Fields set one by one: add() with keywords costs 1.7x as much (every block-filling decode step
        # lists one change per request).
        change = add_change()
        change.op_index = index
        change.group_id = group.group_id
        change.new_block_index = group.new_block_index
        change.new_block_ids.extend(group.new_block_ids)
    for copy in results.copies:
        message.copies.add(src_block_id=copy.src_block_id, dst_block_id=copy.dst_block_id)


def step_delta(delta: StepDelta) -> pb.StepDelta:
    """A step's delta for workers, as the core built it."""
    message = pb.StepDelta(step_id=delta.step_id)
    for table in delta.rows_added:
        block_table(table, message.rows_added.add())
    add_append = message.blocks_appended.add
    for update in delta.blocks_appended:  # fields one by one, as in decode_results
        appended = add_append()
        appended.request_id = update.request_id
        appended.group_id = update.group_id
        appended.new_block_index = update.new_block_index
        appended.block_ids.extend(update.block_ids)
    if delta.requests_freed:
        message.requests_freed.extend(delta.requests_freed)
    for copy in delta.copies:
        message.copies.add(src_block_id=copy.src_block_id, dst_block_id=copy.dst_block_id)
    # A worker applies offloads, then onloads, then copies (see core/host_tier.py): the lists keep op order.
    for copy in delta.offloads:
        message.offloads.add(device_block_id=copy.device_block_id, host_block_id=copy.host_block_id)
    for copy in delta.onloads:
        message.onloads.add(device_block_id=copy.device_block_id, host_block_id=copy.host_block_id)
    return message


def cache_hit_response(hit: CacheHit) -> pb.FindCacheHitResponse:
    """A hit as FindCacheHit answers it: the null block (0) where the core says -1 (the block is only
    on the host; the device block it would be loaded into is chosen by the Allocate that adopts it)."""
    response = pb.FindCacheHitResponse(
        num_cached_tokens=hit.num_cached_tokens, num_host_cached_tokens=hit.num_host_cached_tokens
    )
    for group_id, block_ids in enumerate(hit.block_ids):
        if hit.num_host_cached_tokens:
            block_ids = [max(block_id, 0) for block_id in block_ids]
        response.groups.add(group_id=group_id, block_ids=block_ids)
    return response


def block_table(table: BlockTable, message: pb.RequestBlockTable) -> pb.RequestBlockTable:
    message.request_id = table.request_id
    message.num_computed_tokens = table.num_computed_tokens
    if table.num_hit_tokens:
        message.num_hit_tokens = table.num_hit_tokens
    for group_id, block_ids in enumerate(table.block_ids):
        message.groups.add(group_id=group_id, block_ids=block_ids)
    return message


def config_response(config: KVCacheConfig, replica_id: str, incarnation: int, max_tokens_per_call: int) -> pb.GetConfigResponse:
    response = pb.GetConfigResponse(
        num_blocks=config.num_blocks,
        hash_algorithm=config.hash_algorithm.value,
        hash_block_size=config.hash_block_size,
        replica_id=replica_id,
        incarnation=incarnation,
        enable_prefix_caching=config.enable_prefix_caching,
        max_model_len=config.max_model_len,
        max_num_requests=config.max_num_requests,
        max_tokens_per_call=max_tokens_per_call,
        num_host_blocks=config.num_host_blocks,
        eviction_policy=config.eviction_policy.value,
        max_expected_blocks=config.expected_blocks_room,
    )
    for group_id, spec in enumerate(config.groups):
        response.groups.add(
            group_id=group_id,
            kind=GROUP_KINDS[spec.kind],
            block_size=spec.block_size,
            sliding_window=spec.sliding_window or 0,
            chunk_size=spec.chunk_size or 0,
        )
    return response


def kv_event(event: KVEvent, sequence: int, replica_id: str, incarnation: int) -> pb.KVEvent:
    """A core event on the wire. A device event leaves `tier` unset, so it is byte for byte what it
    was before the host tier existed; a host event says TIER_HOST."""
    message = pb.KVEvent(sequence=sequence, replica_id=replica_id, incarnation=incarnation)
    if type(event) is BlockStored:
        message.block_stored.block_hashes.extend(event.block_hashes)
        message.block_stored.parent_block_hash = event.parent_block_hash or b""
        message.block_stored.group_id = event.group_id
        message.block_stored.block_size = event.block_size
        if event.tier is Tier.HOST:
            message.block_stored.tier = pb.TIER_HOST
    elif type(event) is BlockRemoved:
        message.block_removed.block_hashes.extend(event.block_hashes)
        message.block_removed.group_id = event.group_id
        if event.tier is Tier.HOST:
            message.block_removed.tier = pb.TIER_HOST
    else:
        assert type(event) is AllBlocksCleared, event
        message.all_blocks_cleared.SetInParent()
    return message


# -- responses -> core (the client's side) ------------------------------------------


def allocate_result(message: pb.AllocateResponse) -> AllocateResult:
    return AllocateResult(
        AllocateStatus(message.status),
        message.num_computed_tokens,
        message.num_scheduled_tokens,
        tuple(
            GroupAllocation(g.group_id, tuple(g.hit_block_ids), tuple(g.new_block_ids), g.new_block_index)
            for g in message.groups
        ),
        tuple(BlockCopy(c.src_block_id, c.dst_block_id) for c in message.copies),
        message.step_id,
    )


def op_result(message: pb.StepResult) -> OpResult:
    kind = message.WhichOneof("result")
    if kind == "allocate":
        return allocate_result(message.allocate)
    if kind == "free":
        return FreeResult(message.free.num_freed_blocks, message.free.step_id)
    if kind == "expect":
        return ExpectResult(message.expect.num_expected_tokens, message.expect.step_id)
    return ForkResult(message.fork.step_id)


def mm_feature_messages(features: Sequence[MMFeature]) -> list[pb.MMFeature]:
    return [pb.MMFeature(identifier=m.identifier, offset=m.offset, length=m.length) for m in features]


def allocate_request(op: AllocateOp) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        request_id=op.request_id,
        token_ids=op.token_ids,
        num_new_tokens=op.num_new_tokens,
        num_lookahead_tokens=op.num_lookahead_tokens,
        num_encoder_tokens=op.num_encoder_tokens,
        cache_salt=op.cache_salt or "",
        lora_name=op.lora.name if op.lora else "",
        lora_path=op.lora.path if op.lora else "",
        mm_features=mm_feature_messages(op.mm_features),
        skip_prefix_cache=op.skip_prefix_cache,
        retention=retention_message(op.retention),
    )


def step_op(op: Op) -> pb.StepOp:
    if type(op) is AllocateOp:
        return pb.StepOp(allocate=allocate_request(op))
    if type(op) is FreeOp:
        return pb.StepOp(free=pb.FreeRequest(request_ids=op.request_ids, num_computed_tokens=op.num_computed_tokens))
    if type(op) is ExpectOp:
        return pb.StepOp(
            expect=pb.ExpectRequest(
                request_id=op.request_id,
                token_ids=op.token_ids,
                cache_salt=op.cache_salt or "",
                lora_name=op.lora.name if op.lora else "",
                lora_path=op.lora.path if op.lora else "",
                mm_features=mm_feature_messages(op.mm_features),
            )
        )
    assert type(op) is ForkOp, op
    return pb.StepOp(fork=pb.ForkRequest(parent_request_id=op.parent_request_id, child_request_ids=op.child_request_ids))


def step_message(ops: Sequence[Op], decode: DecodeBatch | None, idempotency_key: str = "") -> pb.StepRequest:
    """The StepRequest whose `step_ops` are `ops` and `decode` again, exactly."""
    message = pb.StepRequest(ops=[step_op(op) for op in ops], idempotency_key=idempotency_key)
    if decode is not None:
        message.decode.request_ids.extend(decode.request_ids)
        message.decode.token_ids.extend(decode.token_ids)
    return message


def cache_hit_from(message: pb.FindCacheHitResponse) -> CacheHit:
    """The core's CacheHit again: -1 where the wire says 0 at a host-only position. A host tier
    serves full-attention groups only, whose device hits never include the null block, so with
    host tokens a 0 can only be such a position."""
    groups = tuple(tuple(g.block_ids) for g in message.groups)
    if message.num_host_cached_tokens:
        groups = tuple(tuple(b if b else -1 for b in block_ids) for block_ids in groups)
    return CacheHit(message.num_cached_tokens, groups, message.num_host_cached_tokens)


def block_table_from(message: pb.RequestBlockTable) -> BlockTable:
    return BlockTable(message.request_id, message.num_computed_tokens, tuple(tuple(g.block_ids) for g in message.groups))


def stats_response(stats: Stats, host_tier: HostTierStats | None = None) -> pb.GetStatsResponse:
    """GetStats' pool figures; with a host tier, its fields 19-25 too (the dropped-offload count is
    a metric only)."""
    fields = stats._asdict()
    kv_losses = [kv_loss_count(count) for count in fields.pop("kv_losses")]
    response = pb.GetStatsResponse(**fields, kv_losses=kv_losses)
    if host_tier is not None:
        response.num_host_blocks = host_tier.num_host_blocks
        response.num_free_host_blocks = host_tier.num_free_host_blocks
        response.prefix_cache_host_hits = host_tier.prefix_cache_host_hits
        response.num_offloaded_blocks = host_tier.num_offloaded_blocks
        response.num_onloaded_blocks = host_tier.num_onloaded_blocks
        response.num_host_evictions = host_tier.num_host_evictions
        response.num_pending_tier_copies = host_tier.num_pending_tier_copies
    return response


def stats_from(message: pb.GetStatsResponse) -> Stats:
    # The wire message holds every Stats field under the same name.
    stats = Stats(*(getattr(message, name) for name in Stats._fields))
    return stats._replace(kv_losses=tuple(kv_loss_count_from(count) for count in message.kv_losses))
