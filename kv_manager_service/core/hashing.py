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
through `cbor.encode`. Two optional C extensions speed it up, each with a
pure-Python twin that gives the same bytes: `encode_blocks` (token blocks to
CBOR) and `hash_chain` (the whole sha256_cbor chain without extra keys).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

from kv_manager_service.core import cbor
from kv_manager_service.shared.hash_types import BlockHash, HashAlgorithm, LoraRef, MMFeature


ROOT_SEED = "vllm-none-hash"

class _TokenEncodings:
    """Canonical CBOR of each token id, memoised in a list indexed by the id.

    Used by the pure-Python encoder only. Ids past the table are encoded on
    the fly, so a hostile stream of huge ids cannot grow it. Ids must be >= 0.
    """

    SIZE = 1 << 18

    def __init__(self) -> None:
        self._table: list[bytes | None] = [None] * self.SIZE

    def encode_all(self, token_ids: Sequence[int]) -> list[bytes]:
        table = self._table
        try:
            encoded = list(map(table.__getitem__, token_ids))
        except IndexError:
            return [cbor.encode_uint(t) if t >= self.SIZE else table[t] or self._fill(t) for t in token_ids]
        if None in encoded:
            for token_id in set(token_ids):
                if table[token_id] is None:
                    self._fill(token_id)
            encoded = list(map(table.__getitem__, token_ids))
        return encoded

    def _fill(self, token_id: int) -> bytes:
        encoded = self._table[token_id] = cbor.encode_uint(token_id)
        return encoded


_TOKEN_CBOR = _TokenEncodings()


def encode_blocks_py(token_ids: Sequence[int], block_size: int, num_blocks: int, head: bytes, tail: bytes) -> list[bytes]:
    """Per block: `head` + the CBOR of each of its token ids + `tail`."""
    encoded = _TOKEN_CBOR.encode_all(token_ids[: num_blocks * block_size])
    join = b"".join
    return [head + join(encoded[i : i + block_size]) + tail for i in range(0, num_blocks * block_size, block_size)]


try:
    # The same function in C (setup.py builds it when a compiler is there):
    # it reads the ints directly instead of touching one memoised bytes
    # object per token, which misses the CPU caches once a whole vocabulary
    # is memoised.
    from kv_manager_service.core._token_cbor import encode_blocks
except ImportError:  # pragma: no cover - exercised by the twin's own tests
    encode_blocks = encode_blocks_py


def hash_chain_py(
    parent: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int, head: bytes, tokens_head: bytes,
    tail: bytes,
) -> list[bytes]:
    """The sha256_cbor chain of `num_blocks` full blocks: each digest is the next block's parent.

    Block i hashes `head + parent + tokens_head + CBOR(its tokens) + tail`.
    """
    sha256 = hashlib.sha256
    hashes = []
    append = hashes.append
    for body in encode_blocks(token_ids, block_size, num_blocks, tokens_head, tail):
        parent = sha256(head + parent + body).digest()
        append(parent)
    return hashes


try:
    # The same function in C with OpenSSL's SHA-256 (setup.py builds it when
    # a compiler and OpenSSL's headers are there): no Python object per block
    # but the digest it returns.
    from kv_manager_service.core._chain_hash import hash_chain
except ImportError:  # pragma: no cover - exercised by the twin's own tests
    hash_chain = hash_chain_py


def implementation() -> str:
    """Which sha256_cbor chain this install runs, for the start's log: the C chain with OpenSSL's SHA-256,
    or the C block encoder with hashlib (about 3.6x slower per block), or Python alone."""
    if hash_chain is not hash_chain_py:
        return "the C chain with OpenSSL's SHA-256"
    if encode_blocks is not encode_blocks_py:
        return "the C block encoder with hashlib's SHA-256 (the C chain was not built: OpenSSL's headers missing?)"
    return "Python alone (no C extension was built: no compiler at install?)"


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
        A trailing partial block is not hashed. Token ids must lie in
        0..2**32-1 (the manager validates them).
        """
        block_size = self.block_size
        num_full = len(token_ids) // block_size
        if num_full == 0:
            return []
        if self.algorithm is HashAlgorithm.SHA256_CBOR and extras.is_empty():  # the hot path, C when built
            return hash_chain(parent, token_ids, block_size, num_full, self._head, self._tokens_head, cbor.NULL)
        new = self._new
        head = self._head
        hashes: list[BlockHash] = []
        append = hashes.append
        if extras.is_empty():
            for body in encode_blocks(token_ids, block_size, num_full, self._tokens_head, cbor.NULL):
                parent = new(head + parent + body).digest()
                append(parent)
        else:
            bodies = encode_blocks(token_ids, block_size, num_full, self._tokens_head, b"")
            for i, body in enumerate(bodies):
                suffix = cbor.encode(block_extra_keys(extras, start_token + i * block_size, block_size))
                parent = new(head + parent + body + suffix).digest()
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
