"""Chained block hashes: deterministic, language-neutral and fast.

A block's hash fingerprints its whole prefix:

    h_i = H([h_{i-1}, [token ids of block i], extra_keys or null])

where `H(x) = digest(canonical CBOR(x))`. With the default `sha256_cbor` the
bytes are identical to vLLM's algorithm of that name. The root parent `h_{-1}`
is `H("vllm-none-hash")`, or `H(seed)` when a seed is configured.

Extra keys, in this order (null when there are none):
  ["lora", name, adapter_path]          on every block of a LoRA request;
  ["mm", identifier, offset - start]    per multimodal item overlapping the block;
  ["cache_salt", salt]                  on the block starting at token 0 only.

The hot path never runs a generic CBOR encoder: the array heads are constants,
token encodings come from a memo table, and only the extra keys (rare) go
through `cbor.encode`.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Callable, NewType, Sequence

from kv_manager_service.core import cbor

BlockHash = NewType("BlockHash", bytes)

ROOT_SEED = "vllm-none-hash"

# Token ids below this are memoised; larger ones are encoded on the fly so a
# hostile stream of huge ids cannot grow the table without bound.
_MEMO_TOKEN_LIMIT = 1 << 18


class _TokenEncodings(dict):
    def __missing__(self, token_id: int) -> bytes:
        encoded = cbor.encode_uint(token_id)
        if token_id < _MEMO_TOKEN_LIMIT:
            self[token_id] = encoded
        return encoded


_TOKEN_CBOR = _TokenEncodings()


class HashAlgorithm(str, enum.Enum):
    SHA256_CBOR = "sha256_cbor"
    XXH3_128 = "xxh3_128"


@dataclass(frozen=True)
class LoraRef:
    name: str
    path: str


@dataclass(frozen=True)
class MMFeature:
    """A multimodal item occupying tokens [offset, offset + length) of the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class HashExtras:
    """Per-request inputs of the extra keys."""

    lora: LoraRef | None = None
    cache_salt: str | None = None
    mm_features: tuple[MMFeature, ...] = ()

    def is_empty(self) -> bool:
        return self.lora is None and not self.cache_salt and not self.mm_features


NO_EXTRAS = HashExtras()


def _xxh3_128_factory(seed: str) -> Callable[[bytes], "hashlib._Hash"]:
    try:
        import xxhash
    except ImportError as e:  # pragma: no cover - xxhash is a declared dependency
        raise RuntimeError("hash algorithm xxh3_128 needs the 'xxhash' package") from e
    secret = int.from_bytes(hashlib.sha256(seed.encode("utf-8")).digest()[:8], "big")

    def new(data: bytes) -> "xxhash.xxh3_128":
        return xxhash.xxh3_128(data, seed=secret)

    return new


class BlockHasher:
    """Hashes token blocks of `block_size` tokens into a chain.

    Stateless apart from its configuration: callers keep the parent hash and
    the unhashed tail of each request, so hashing is incremental.
    """

    def __init__(
        self,
        block_size: int,
        algorithm: HashAlgorithm = HashAlgorithm.SHA256_CBOR,
        seed: str | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"hash block_size must be >= 1, got {block_size}")
        algorithm = HashAlgorithm(algorithm)
        if algorithm is HashAlgorithm.XXH3_128:
            if not seed:
                raise ValueError(
                    "hash algorithm xxh3_128 is not collision-resistant: it needs a "
                    "secret hash seed (--hash-seed) and is refused without one"
                )
            self._new: Callable[[bytes], "hashlib._Hash"] = _xxh3_128_factory(seed)
        else:
            self._new = hashlib.sha256
        self.block_size = block_size
        self.algorithm = algorithm
        self.root_hash = BlockHash(self._new(cbor.encode(seed if seed else ROOT_SEED)).digest())
        # [parent, tokens, extra]: array head, then the parent's byte-string head.
        self._head = b"\x83" + cbor.encode_bytes_head(len(self.root_hash))
        self._tokens_head = cbor.encode_array_head(block_size)

    def hash_block(
        self, parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence | None = None
    ) -> BlockHash:
        """The hash of one block (any length), with explicit extra keys."""
        data = cbor.encode([parent, list(token_ids), None if not extra_keys else list(extra_keys)])
        return BlockHash(self._new(data).digest())

    def hash_blocks(
        self,
        parent: BlockHash,
        token_ids: Sequence[int],
        start_token: int = 0,
        extras: HashExtras = NO_EXTRAS,
    ) -> list[BlockHash]:
        """Hashes of every full block of `token_ids`.

        `token_ids[0]` sits at prompt position `start_token` (a multiple of
        `block_size`) and its block follows the block hashed as `parent`.
        A trailing partial block is not hashed.
        """
        block_size = self.block_size
        num_full = len(token_ids) // block_size
        if num_full == 0:
            return []
        new = self._new
        head = self._head
        tokens_head = self._tokens_head
        join = b"".join
        encoded = list(map(_TOKEN_CBOR.__getitem__, token_ids[: num_full * block_size]))
        hashes: list[BlockHash] = []
        append = hashes.append
        if extras.is_empty():
            for i in range(0, num_full * block_size, block_size):
                parent = new(head + parent + tokens_head + join(encoded[i : i + block_size]) + cbor.NULL).digest()
                append(parent)
        else:
            for i in range(0, num_full * block_size, block_size):
                suffix = cbor.encode(block_extra_keys(extras, start_token + i, block_size))
                parent = new(head + parent + tokens_head + join(encoded[i : i + block_size]) + suffix).digest()
                append(parent)
        return hashes

def block_extra_keys(extras: HashExtras, block_start: int, block_size: int) -> list | None:
    """The extra keys of the block covering tokens [block_start, block_start + block_size)."""
    keys: list = []
    if extras.lora is not None:
        keys.append(["lora", extras.lora.name, extras.lora.path])
    block_end = block_start + block_size
    for mm in extras.mm_features:
        if mm.offset < block_end and mm.offset + mm.length > block_start:
            keys.append(["mm", mm.identifier, mm.offset - block_start])
    if extras.cache_salt and block_start == 0:
        keys.append(["cache_salt", extras.cache_salt])
    return keys or None
