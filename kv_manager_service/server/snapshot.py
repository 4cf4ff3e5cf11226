"""A replica's whole state as a journal snapshot, and a fresh replica restored from one.

The snapshot holds what the journal's records would rebuild: the core
(`core.state`), the registered workers and their acknowledgements, the
memory of keyed Steps (each result as the StepResponse it answers), the tenants' accounting and the event sequence. The
step and event logs are not kept: a restored replica's logs start empty,
numbered on from the snapshot's last step and event, so a worker behind
them resyncs with GetBlockTables and a watcher of events with the mirror's
snapshot, as after any truncation. Worker leases start at the restore, as
after a replay.
"""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING, Iterable

from kv_manager_service.core.hashing import HashExtras
from kv_manager_service.core.state import CoreState, HostTierState, PinExport, RequestExport, restore_state
from kv_manager_service import wire
from kv_manager_service.server.tenancy import TenantUsage
from kv_manager_service.shared.hash_types import BlockHash, LoraRef, MMFeature
from kv_manager_service.shared.ops import KVLossCause
from kvcache.journal.v1 import journal_pb2 as jpb
from kvcache.v1 import kv_manager_pb2 as pb

if TYPE_CHECKING:
    from kv_manager_service.server.replica import Replica


def take_snapshot(replica: Replica) -> jpb.JournalSnapshot:
    """The replica's state between two mutations; the caller holds its lock. Changes nothing."""
    snapshot = jpb.JournalSnapshot(core=core_to_proto(replica.manager.export_state()))
    snapshot.last_event_sequence = replica.events.last_id
    for worker_id, (acked_step_id, incarnation) in replica.workers.acks_and_incarnations().items():
        snapshot.workers.add(worker_id=worker_id, acked_step_id=acked_step_id, incarnation=incarnation)
    for key, fingerprint, result in replica.step_keys.items():
        response = wire.step_response(result).SerializeToString()
        snapshot.step_keys.add(idempotency_key=key, request_sha256=fingerprint, response=response)
    if replica.tenancy is not None:
        for tenant, u in replica.tenancy.usage.items():
            snapshot.tenants.add(
                tenant=tenant,
                num_blocks=u.num_blocks,
                num_requests=u.num_requests,
                prefix_cache_queries=u.prefix_cache_queries,
                prefix_cache_hits=u.prefix_cache_hits,
                num_quota_refusals=u.num_quota_refusals,
            )
        for step_id, tenant in replica.tenancy.copy_owners().items():
            snapshot.copy_owners.add(step_id=step_id, tenant=tenant)
    return snapshot


def restore_snapshot(replica: Replica, snapshot: jpb.JournalSnapshot) -> None:
    """Make the fresh `replica` (nothing replayed yet) hold `snapshot`'s state.

    ValueError when the snapshot's parts disagree (see `core.state.restore_state`).
    """
    if replica.manager.last_step_id or len(replica.workers) or len(replica.step_keys) or replica.events.last_id:
        raise ValueError("a journal's snapshot must come right after its header")
    state = core_from_proto(snapshot.core)
    restore_state(replica.manager, state)
    replica.steps.start_after(state.last_step_id)
    replica.events.start_after(snapshot.last_event_sequence)
    now = time.monotonic()
    for worker in snapshot.workers:
        replica.workers.register(worker.worker_id, worker.acked_step_id, now, worker.incarnation)
    for entry in snapshot.step_keys:
        result = wire.step_result_from(pb.StepResponse.FromString(entry.response))
        replica.step_keys.put(entry.idempotency_key, entry.request_sha256, result)
    if replica.tenancy is not None:
        usage = {
            t.tenant: TenantUsage(
                None, t.num_blocks, t.num_requests, t.prefix_cache_queries, t.prefix_cache_hits, t.num_quota_refusals
            )
            for t in snapshot.tenants
        }
        replica.tenancy.restore(usage, {owner.step_id: owner.tenant for owner in snapshot.copy_owners})


def core_to_proto(state: CoreState) -> jpb.CoreSnapshot:
    cached_group_ids, cached_block_hashes, cached_block_ids = zip(*state.cached) if state.cached else ((), (), ())
    return jpb.CoreSnapshot(
        last_step_id=state.last_step_id,
        free_block_ids=state.free_block_ids,
        cached_group_ids=cached_group_ids,
        cached_block_hashes=cached_block_hashes,
        cached_block_ids=cached_block_ids,
        requests=[_request_to_proto(r) for r in state.requests],
        pending_copies=[
            pb.PendingCopy(step_id=step_id, copy=pb.BlockCopy(src_block_id=src, dst_block_id=dst))
            for step_id, src, dst in state.pending_copies
        ],
        prefix_cache_queries=state.prefix_cache_queries,
        prefix_cache_hits=state.prefix_cache_hits,
        num_evictions=state.num_evictions,
        host_tier=_host_tier_to_proto(state.host_tier) if state.host_tier is not None else None,
        kv_losses=[wire.kv_loss_count(count) for count in state.kv_losses],
        priority_block_ids=[block_id for block_id, _ in state.block_priorities],
        priorities=[priority for _, priority in state.block_priorities],
        pins=[
            jpb.PinSnapshot(pin_id=p.pin_id, request_id=p.request_id, ttl_ms=p.ttl_ms, block_ids=p.block_ids)
            for p in state.pins
        ],
        num_pins_made=state.num_pins_made,
        num_unpinned_blocks=state.num_unpinned_blocks,
        frequency_class_block_ids=[block_id for block_id, _ in state.frequency_classes],
        frequency_classes=[frequency_class for _, frequency_class in state.frequency_classes],
        seen_hashes=[block_hash for block_hash, _ in state.seen],
        seen_counts=[count for _, count in state.seen],
        expected=[jpb.ExpectedSnapshot(request_id=rid, block_hashes=kept) for rid, kept in state.expected],
    )


def core_from_proto(message: jpb.CoreSnapshot) -> CoreState:
    if not len(message.cached_group_ids) == len(message.cached_block_hashes) == len(message.cached_block_ids):
        raise ValueError("the snapshot's cached blocks have lists of different lengths")
    if len(message.priority_block_ids) != len(message.priorities):
        raise ValueError("the snapshot's block priorities have lists of different lengths")
    if len(message.frequency_class_block_ids) != len(message.frequency_classes):
        raise ValueError("the snapshot's frequency classes have lists of different lengths")
    if len(message.seen_hashes) != len(message.seen_counts):
        raise ValueError("the snapshot's frequency history has lists of different lengths")
    return CoreState(
        message.last_step_id,
        tuple(message.free_block_ids),
        tuple(zip(message.cached_group_ids, map(BlockHash, message.cached_block_hashes), message.cached_block_ids)),
        tuple(_request_from_proto(r) for r in message.requests),
        tuple((p.step_id, p.copy.src_block_id, p.copy.dst_block_id) for p in message.pending_copies),
        message.prefix_cache_queries,
        message.prefix_cache_hits,
        message.num_evictions,
        _host_tier_from_proto(message.host_tier) if message.HasField("host_tier") else None,
        tuple(wire.kv_loss_count_from(count) for count in message.kv_losses),
        tuple(zip(message.priority_block_ids, message.priorities)),
        tuple(PinExport(p.pin_id, p.request_id, p.ttl_ms, tuple(p.block_ids)) for p in message.pins),
        message.num_pins_made,
        message.num_unpinned_blocks,
        tuple(zip(message.frequency_class_block_ids, message.frequency_classes)),
        tuple(zip(map(BlockHash, message.seen_hashes), message.seen_counts)),
        tuple((e.request_id, tuple(map(BlockHash, e.block_hashes))) for e in message.expected),
    )


def _host_tier_to_proto(state: HostTierState) -> jpb.HostTierSnapshot:
    hashes, num_cached = state.cached_block_hashes, len(state.cached_host_block_ids)
    w = len(hashes) // num_cached if num_cached else 0
    return jpb.HostTierSnapshot(
        free_host_block_ids=state.free_host_block_ids,
        cached_group_ids=state.cached_group_ids,
        # Streamed from the packed hashes: no list of a million bytes objects on the way.
        cached_block_hashes=(hashes[i : i + w] for i in range(0, len(hashes), w or 1)),
        cached_host_block_ids=state.cached_host_block_ids,
        pending=[
            jpb.PendingTierCopySnapshot(
                step_id=step_id,
                is_onload=is_onload,
                copy=pb.TierCopy(device_block_id=device_block_id, host_block_id=host_block_id),
                block_hash=block_hash,
            )
            for step_id, is_onload, device_block_id, host_block_id, block_hash in state.pending
        ],
        num_offloaded_blocks=state.num_offloaded_blocks,
        num_onloaded_blocks=state.num_onloaded_blocks,
        num_evictions=state.num_evictions,
        num_dropped_offloads=state.num_dropped_offloads,
        num_hit_tokens=state.num_hit_tokens,
    )


def _host_tier_from_proto(message: jpb.HostTierSnapshot) -> HostTierState:
    if not len(message.cached_group_ids) == len(message.cached_block_hashes) == len(message.cached_host_block_ids):
        raise ValueError("the snapshot's cached host blocks have lists of different lengths")
    return HostTierState(
        array("q", message.free_host_block_ids),
        array("q", message.cached_group_ids),
        _packed_hashes(message.cached_block_hashes),
        array("q", message.cached_host_block_ids),
        tuple(
            (p.step_id, p.is_onload, p.copy.device_block_id, p.copy.host_block_id, BlockHash(p.block_hash))
            for p in message.pending
        ),
        message.num_offloaded_blocks,
        message.num_onloaded_blocks,
        message.num_evictions,
        message.num_dropped_offloads,
        message.num_hit_tokens,
    )


def _packed_hashes(block_hashes: Iterable[bytes]) -> bytes:
    """`block_hashes` end to end, one at a time (no list of them); ValueError unless all have one length."""
    packed = bytearray()
    lengths = set()
    for block_hash in block_hashes:
        lengths.add(len(block_hash))
        packed += block_hash
    if len(lengths) > 1:
        raise ValueError("the snapshot's cached host block hashes have different lengths")
    return bytes(packed)


def _request_to_proto(r: RequestExport) -> jpb.RequestSnapshot:
    extras = r.extras
    return jpb.RequestSnapshot(
        request_id=r.request_id,
        num_tokens=r.num_tokens,
        num_computed_tokens=r.num_computed_tokens,
        num_encoder_tokens=r.num_encoder_tokens,
        cache_salt=extras.cache_salt or "",
        lora_name=extras.lora.name if extras.lora is not None else "",
        lora_path=extras.lora.path if extras.lora is not None else "",
        mm_features=[
            pb.MMFeature(identifier=f.identifier, offset=f.offset, length=f.length) for f in extras.mm_features
        ],
        block_hashes=r.block_hashes,
        tail_token_ids=r.tail_token_ids,
        tables=[jpb.BlockIds(block_ids=ids) for ids in r.block_ids],
        num_cached_blocks=r.num_cached_blocks,
        lost_cause=r.lost_cause or 0,
        retention=wire.retention_message(r.retention),
    )


def _request_from_proto(m: jpb.RequestSnapshot) -> RequestExport:
    lora = LoraRef(m.lora_name, m.lora_path) if m.lora_name else None
    features = tuple(MMFeature(f.identifier, f.offset, f.length) for f in m.mm_features)
    return RequestExport(
        m.request_id,
        m.num_tokens,
        m.num_computed_tokens,
        m.num_encoder_tokens,
        HashExtras(lora, m.cache_salt or None, features),
        tuple(map(BlockHash, m.block_hashes)),
        tuple(m.tail_token_ids),
        tuple(tuple(t.block_ids) for t in m.tables),
        tuple(m.num_cached_blocks),
        KVLossCause(m.lost_cause) if m.lost_cause else None,
        wire.retention(m.retention) if m.HasField("retention") else None,
    )
