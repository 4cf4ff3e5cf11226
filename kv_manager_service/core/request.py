"""What the manager remembers about one live request."""

from __future__ import annotations

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.hashing import BlockHash, HashExtras
from kv_manager_service.shared.ops import Retention


class RequestState:
    """A live request: its tokens (as hashes), progress and block tables.

    Token ids are not kept: only the chained hashes of the full hash blocks
    and the tail that does not fill a hash block yet.

    Invariants: `num_computed_tokens <= num_tokens`; `block_hashes` has one
    entry per full hash block of the `num_tokens` known tokens (when caching);
    `tables[g][:num_cached_blocks[g]]` are cached or null. `retention` is None
    unless the request asked for a priority or a pin (docs/retention.md).
    """

    __slots__ = (
        "request_id",
        "num_tokens",
        "num_computed_tokens",
        "num_encoder_tokens",
        "extras",
        "block_hashes",
        "tail_token_ids",
        "tables",
        "num_cached_blocks",
        "retention",
    )

    def __init__(
        self,
        request_id: str,
        num_tokens: int,
        num_computed_tokens: int,
        num_encoder_tokens: int,
        extras: HashExtras,
        block_hashes: list[BlockHash],
        tail_token_ids: list[int],
        tables: list[list[KVCacheBlock]],
        num_cached_blocks: list[int],
        retention: Retention | None = None,
    ) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_computed_tokens = num_computed_tokens
        self.num_encoder_tokens = num_encoder_tokens
        self.extras = extras
        self.block_hashes = block_hashes
        self.tail_token_ids = tail_token_ids
        self.tables = tables
        self.num_cached_blocks = num_cached_blocks
        self.retention = retention

    def fork(self, child_id: str) -> "RequestState":
        """A child sharing every block (the caller takes the references)."""
        return RequestState(
            child_id,
            self.num_tokens,
            self.num_computed_tokens,
            self.num_encoder_tokens,
            self.extras,
            list(self.block_hashes),
            list(self.tail_token_ids),
            [list(table) for table in self.tables],
            list(self.num_cached_blocks),
            self.retention,
        )
