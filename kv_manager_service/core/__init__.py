"""The pure core: block pool, prefix cache, hybrid groups, fork and copy-on-write.

It does no I/O and imports nothing from grpc, redis or torch: the edges (the
gRPC server, the Redis mirror) drive it and drain its queues.
"""

from kv_manager_service.core.config import GroupKind, GroupSpec, KVCacheConfig
from kv_manager_service.rpc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    OutOfRangeError,
    RequestExistsError,
    RequestNotFoundError,
    ResourceExhaustedError,
)
from kv_manager_service.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kv_manager_service.core.hashing import BlockHash, BlockHasher, HashAlgorithm, LoraRef, MMFeature
from kv_manager_service.core.manager import KVCacheManager
from kv_manager_service.core.ops import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    BlockAppend,
    BlockCopy,
    BlockTable,
    CacheHit,
    DecodeBatch,
    DecodeResults,
    ForkOp,
    ForkResult,
    FreeOp,
    FreeResult,
    GroupAllocation,
    HostTierStats,
    PendingCopy,
    PendingTierCopy,
    PrefixLookupKeys,
    Stats,
    StepDelta,
    StepResult,
    TierCopy,
)
from kv_manager_service.core.state import CoreState, RequestSnapshot

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
    "ForkOp",
    "ForkResult",
    "FreeOp",
    "FreeResult",
    "GroupAllocation",
    "GroupKind",
    "GroupSpec",
    "HashAlgorithm",
    "HostTierStats",
    "InvalidArgumentError",
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
    "RequestExistsError",
    "RequestNotFoundError",
    "RequestSnapshot",
    "ResourceExhaustedError",
    "Stats",
    "StepDelta",
    "StepResult",
    "TierCopy",
]
