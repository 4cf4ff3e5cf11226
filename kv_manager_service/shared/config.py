"""The validated configuration of one KV-cache pool."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping

from kv_manager_service.shared.hash_types import HashAlgorithm


class GroupKind(str, enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    CROSS_ATTENTION = "cross_attention"


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: the layers that share an attention kind and block size."""

    kind: GroupKind
    block_size: int = 16
    sliding_window: int | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GroupKind(self.kind))
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
                raise ValueError(f"sliding_window must be an integer >= 1 for a sliding_window group, got {self.sliding_window!r}")
        if self.kind is GroupKind.CHUNKED_LOCAL:
            if not isinstance(self.chunk_size, int) or self.chunk_size < 1 or self.chunk_size % self.block_size:
                raise ValueError(
                    f"chunk_size must be a positive multiple of block_size ({self.block_size}) "
                    f"for a chunked_local group, got {self.chunk_size!r}"
                )

    @property
    def cacheable(self) -> bool:
        """Whether the group's blocks can enter the prefix cache."""
        return self.kind is not GroupKind.CROSS_ATTENTION


DEFAULT_GROUPS = (GroupSpec(GroupKind.FULL_ATTENTION, 16),)


class EvictionPolicy(str, enum.Enum):
    """Which free cached device block is reused first (core/block_pool.py has the orders).

    lru: the least recently used, vLLM's order. frequency: the one whose hash
    was seen (computed or hit) least often, in a history that outlives
    eviction, least recently used among equals.
    """

    LRU = "lru"
    FREQUENCY = "frequency"


EXPECTED_BLOCKS_PER_BLOCK = 16
"""The default room of expected prompts, per pool block: a queue deep enough to want more than the pool holds
is where their order pays (BENCHMARKS.md)."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Everything the core needs to know about one pool; checked on construction.

    `max_model_len` caps a request's tokens (lookahead included);
    `max_num_requests` caps live requests. `enable_events` makes the pool
    queue cache events for a consumer that drains them with `take_events()`.
    `num_host_blocks` > 0 puts a host-memory tier of that many blocks behind
    the pool (see `host_tier`); 0, the default, means none. Only full-attention
    groups use the tier, so any other group kind is refused with it.
    `retention_max_pinned_blocks` caps the distinct blocks that retention
    pins hold at once (docs/retention.md); None, the default, is a tenth of
    the pool (`max_pinned_blocks`), and 0 turns pins off.
    `max_expected_blocks` caps the hash blocks that expected requests'
    prompts keep at once (core/expectations.py); None, the default, is
    EXPECTED_BLOCKS_PER_BLOCK per pool block (`expected_blocks_room`).
    """

    num_blocks: int
    groups: tuple[GroupSpec, ...] = DEFAULT_GROUPS
    enable_prefix_caching: bool = True
    hash_algorithm: HashAlgorithm = HashAlgorithm.SHA256_CBOR
    hash_seed: str | None = None
    enable_events: bool = False
    max_model_len: int = 1 << 20
    max_num_requests: int = 1 << 16
    num_host_blocks: int = 0
    retention_max_pinned_blocks: int | None = None
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    max_expected_blocks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the null block), got {self.num_blocks!r}")
        groups = tuple(g if isinstance(g, GroupSpec) else GroupSpec(**g) for g in self.groups)
        if not groups:
            raise ValueError("groups must list at least one KV-cache group")
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "hash_algorithm", HashAlgorithm(self.hash_algorithm))
        if self.eviction_policy not in {p.value for p in EvictionPolicy}:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(p.value for p in EvictionPolicy)}, "
                f"got {self.eviction_policy!r}"
            )
        object.__setattr__(self, "eviction_policy", EvictionPolicy(self.eviction_policy))
        if self.hash_algorithm is HashAlgorithm.XXH3_128 and not self.hash_seed:
            raise ValueError("hash_algorithm xxh3_128 needs a secret hash_seed")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_requests < 1:
            raise ValueError(f"max_num_requests must be >= 1, got {self.max_num_requests}")
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an integer >= 0, got {self.num_host_blocks!r}")
        if self.num_host_blocks:
            others = [
                f"groups[{i}] ({g.kind.value})" for i, g in enumerate(groups) if g.kind is not GroupKind.FULL_ATTENTION
            ]
            if others:
                raise ValueError(
                    f"num_host_blocks {self.num_host_blocks} needs full_attention groups only; "
                    f"{', '.join(others)} cannot use the host tier"
                )
            if not self.enable_prefix_caching:
                raise ValueError(
                    f"num_host_blocks {self.num_host_blocks} needs enable_prefix_caching (the tier caches prefixes)"
                )

        limit = self.retention_max_pinned_blocks
        if limit is not None and (type(limit) is not int or not 0 <= limit <= self.num_blocks - 1):
            raise ValueError(
                f"retention_max_pinned_blocks must be an integer in 0..{self.num_blocks - 1} (the pool's blocks), "
                f"got {limit!r}"
            )

        room = self.max_expected_blocks
        if room is not None and (type(room) is not int or room < 0):
            raise ValueError(f"max_expected_blocks must be an integer >= 0, got {room!r}")

    @property
    def expected_blocks_room(self) -> int:
        """The hash blocks expected prompts may keep: `max_expected_blocks`, by default EXPECTED_BLOCKS_PER_BLOCK
        per pool block."""
        if self.max_expected_blocks is None:
            return EXPECTED_BLOCKS_PER_BLOCK * self.num_blocks
        return self.max_expected_blocks

    @property
    def max_pinned_blocks(self) -> int:
        """The pin quota: `retention_max_pinned_blocks`, by default a tenth of the pool's blocks."""
        if self.retention_max_pinned_blocks is None:
            return (self.num_blocks - 1) // 10
        return self.retention_max_pinned_blocks

    @property
    def hash_block_size(self) -> int:
        """Tokens per hash: the gcd of the cacheable groups' block sizes."""
        sizes = [g.block_size for g in self.groups if g.cacheable] or [g.block_size for g in self.groups]
        return math.gcd(*sizes)

    @property
    def lcm_block_size(self) -> int:
        """Cache hits are reported on multiples of this: the lcm of the cacheable block sizes."""
        sizes = [g.block_size for g in self.groups if g.cacheable] or [self.hash_block_size]
        return math.lcm(*sizes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVCacheConfig":
        """Build from a parsed YAML/JSON mapping; unknown keys are an error."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys are {sorted(known)}")
        values = dict(data)
        if "groups" in values:
            groups = []
            for i, g in enumerate(values["groups"]):
                try:
                    groups.append(g if isinstance(g, GroupSpec) else GroupSpec(**g))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"groups[{i}]: {e}") from e
            values["groups"] = tuple(groups)
        return cls(**values)
