"""The pure core: block pool, prefix cache, hybrid groups, fork and copy-on-write.

It does no I/O and imports nothing from grpc, redis or torch: the edges (the
gRPC server, the Redis mirror) drive it and drain its queues. The values it
takes and returns (ops, results, events, config, errors) live in
`kv_manager_service.shared`, where the client returns them too; they are
re-exported here for code that drives the core in-process.
"""

from kv_manager_service.shared.config import EvictionPolicy, GroupKind, GroupSpec, KVCacheConfig
from kv_manager_service.shared.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    OutOfRangeError,
    RequestExistsError,
    RequestNotFoundError,
    ResourceExhaustedError,
)
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kv_manager_service.core.hashing import BlockHash, BlockHasher, HashAlgorithm, LoraRef, MMFeature
from kv_manager_service.core.manager import KVCacheManager
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
    KVLossCount,
    PendingCopy,
    PendingTierCopy,
    PrefixLookupKeys,
    Retention,
    Stats,
    StepDelta,
    StepResult,
    TierCopy,
)
from kv_manager_service.core.state import CoreState, RequestExport

__all__ = [
    "AllBlocksCleared",
    "AllocateOp",
    "AllocateResult",
    "AllocateStatus",
    "BlockAppend",
    "BlockCopy",
    "BlockHash",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "BlockTable",
    "CacheHit",
    "CoreState",
    "DecodeBatch",
    "DecodeResults",
    "FailedPreconditionError",
    "ExpectOp",
    "ExpectResult",
    "ForkOp",
    "ForkResult",
    "FreeOp",
    "FreeResult",
    "GroupAllocation",
    "GroupKind",
    "GroupSpec",
    "HashAlgorithm",
    "HostTierStats",
    "Invalidation",
    "KVLossCause",
    "KVLossCount",
    "InvalidArgumentError",
    "EvictionPolicy",
    "KVCacheConfig",
    "KVCacheError",
    "KVCacheManager",
    "KVEvent",
    "LoraRef",
    "MMFeature",
    "OutOfRangeError",
    "PendingCopy",
    "PendingTierCopy",
    "PrefixLookupKeys",
    "Retention",
    "RequestExistsError",
    "RequestNotFoundError",
    "RequestExport",
    "ResourceExhaustedError",
    "Stats",
    "StepDelta",
    "StepResult",
    "TierCopy",
]
