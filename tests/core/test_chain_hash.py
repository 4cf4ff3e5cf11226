"""The C sha256_cbor chain and its pure-Python twin give the same digests, and both equal cbor2 + hashlib."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_manager_service.core import BlockHasher, HashAlgorithm, cbor, hashing
from kv_manager_service.core.hashing import HashExtras, LoraRef, encode_blocks_py, hash_chain_py

c_chain = pytest.importorskip("kv_manager_service.core._chain_hash")

# The last id of each CBOR width class and the first of the next one.
WIDTH_BOUNDARIES = (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1)
HEAD = b"\x83" + cbor.encode_bytes_head(32)


def tokens_head(block_size: int) -> bytes:
    return cbor.encode_array_head(block_size)


@st.composite
def token_streams(draw: st.DrawFn, max_size: int = 300) -> list[int]:
    """Token ids below a drawn vocabulary size (up to all 2**32 ids), mixed with every width boundary below it."""
    vocab_size = draw(st.sampled_from((24, 256, 65536, 150_000, 2**32)) | st.integers(1, 2**32))
    boundaries = [t for t in WIDTH_BOUNDARIES if t < vocab_size]
    return draw(st.lists(st.integers(0, vocab_size - 1) | st.sampled_from(boundaries), max_size=max_size))


@contextlib.contextmanager
def python_encoder() -> Iterator[None]:
    """The twin as it runs where neither C extension was built."""
    saved = hashing.encode_blocks
    hashing.encode_blocks = encode_blocks_py
    try:
        yield
    finally:
        hashing.encode_blocks = saved


def both(parent: bytes, tokens: list[int], block_size: int, num_blocks: int, head: bytes = HEAD,
         tail: bytes = cbor.NULL) -> list[bytes]:
    """The C chain's digests, after checking the twin (with either encoder) gives the same."""
    args = (parent, tokens, block_size, num_blocks, head, tokens_head(block_size), tail)
    in_c = c_chain.hash_chain(*args)
    assert hash_chain_py(*args) == in_c
    with python_encoder():
        assert hash_chain_py(*args) == in_c
    return in_c


def reference_chain(parent: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """sha256(canonical CBOR([parent, block tokens, null])) per full block, with cbor2."""
    chain = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        block = [parent, tokens[start : start + block_size], None]
        parent = hashlib.sha256(cbor2.dumps(block, canonical=True)).digest()
        chain.append(parent)
    return chain


def test_the_hasher_uses_the_c_chain_when_built() -> None:
    assert hashing.hash_chain is c_chain.hash_chain


@settings(max_examples=300, deadline=None)
@given(tokens=token_streams(), block_size=st.integers(1, 64), parent=st.binary(min_size=32, max_size=32))
def test_c_and_python_chains_agree(tokens: list[int], block_size: int, parent: bytes) -> None:
    num_blocks = len(tokens) // block_size
    chain = both(parent, tokens, block_size, num_blocks)
    assert len(chain) == num_blocks and all(len(h) == 32 for h in chain)


@settings(deadline=None)
@given(
    tokens=token_streams(max_size=40),
    block_size=st.integers(1, 9),
    parent=st.binary(max_size=40),
    head=st.binary(max_size=4),
    tail=st.binary(max_size=4),
)
def test_c_and_python_chains_agree_on_any_framing(
    tokens: list[int], block_size: int, parent: bytes, head: bytes, tail: bytes
) -> None:
    # Not what the hasher passes, but the twins must still agree byte for byte.
    both(parent, tokens, block_size, len(tokens) // block_size, head, tail)


@settings(deadline=None)
@given(tokens=token_streams(max_size=80), block_size=st.integers(1, 16))
def test_chain_equals_cbor2_from_the_root(tokens: list[int], block_size: int) -> None:
    root = BlockHasher(block_size).root_hash
    assert both(root, tokens, block_size, len(tokens) // block_size) == reference_chain(root, tokens, block_size)


def test_chain_equals_cbor2_from_a_non_root_parent() -> None:
    parent = hashlib.sha256(b"some earlier block").digest()
    tokens = list(WIDTH_BOUNDARIES) * 6
    assert both(parent, tokens, 16, 3) == reference_chain(parent, tokens, 16)


def test_zero_full_blocks_give_an_empty_chain() -> None:
    assert both(b"\x00" * 32, [1, 2, 3], 4, 0) == []
    assert both(b"\x00" * 32, [], 4, 0) == []


def test_a_trailing_partial_block_is_not_hashed() -> None:
    tokens = list(range(11))
    root = BlockHasher(4).root_hash
    assert both(root, tokens, 4, 2) == reference_chain(root, tokens, 4)


@pytest.mark.parametrize(
    "bad, error",
    [(-1, OverflowError), (2**32, OverflowError), (2**70, OverflowError), (1.0, TypeError), ("7", TypeError),
     (None, TypeError)],
)
def test_a_bad_token_id_raises_and_returns_nothing(bad: object, error: type[Exception]) -> None:
    # The bad id sits in the last block: the blocks before it are not returned either. (The
    # Python twin relies on the manager's validation of token ids, as `hash_blocks` says.)
    tokens = [1] * 8 + [bad] + [2] * 3
    with pytest.raises(error):
        c_chain.hash_chain(b"\x00" * 32, tokens, 4, 3, HEAD, tokens_head(4), cbor.NULL)


class TokenLike:
    """An int-like token id whose __index__ may run code of its own."""

    def __init__(self, value: int, side_effect: object = None) -> None:
        self.value, self.side_effect = value, side_effect

    def __index__(self) -> int:
        if callable(self.side_effect):
            self.side_effect()
        return self.value


def test_int_likes_are_token_ids() -> None:
    framing = (HEAD, tokens_head(4), cbor.NULL)
    as_ints = c_chain.hash_chain(b"p" * 32, list(WIDTH_BOUNDARIES), 4, 2, *framing)
    assert c_chain.hash_chain(b"p" * 32, [TokenLike(t) for t in WIDTH_BOUNDARIES], 4, 2, *framing) == as_ints


def test_tokens_shrunk_while_being_read_raise_instead_of_crashing() -> None:
    tokens: list = [1, 2, 3, 4, 5, 6, 7, 8]
    tokens[2] = TokenLike(3, tokens.clear)
    with pytest.raises(RuntimeError, match="changed size"):
        c_chain.hash_chain(b"\x00" * 32, tokens, 4, 2, HEAD, tokens_head(4), cbor.NULL)


@pytest.mark.parametrize("block_size, num_blocks", [(0, 0), (4, 3), (4, -1)])
def test_c_chain_refuses_an_impossible_shape(block_size: int, num_blocks: int) -> None:
    with pytest.raises(ValueError):
        c_chain.hash_chain(b"\x00" * 32, [1] * 8, block_size, num_blocks, HEAD, b"\x84", cbor.NULL)


def test_c_chain_needs_a_sequence_of_tokens() -> None:
    with pytest.raises(TypeError):
        c_chain.hash_chain(b"\x00" * 32, 5, 1, 0, HEAD, b"\x81", cbor.NULL)


@contextlib.contextmanager
def hash_chain_set_to(chain: object) -> Iterator[None]:
    saved = hashing.hash_chain
    hashing.hash_chain = chain
    try:
        yield
    finally:
        hashing.hash_chain = saved


@settings(deadline=None)
@given(tokens=token_streams(max_size=200), block_size=st.integers(1, 32), seed=st.none() | st.text(max_size=8))
def test_hash_blocks_is_the_same_with_and_without_the_c_chain(
    tokens: list[int], block_size: int, seed: str | None
) -> None:
    hasher = BlockHasher(block_size, seed=seed)
    suffix = tokens[block_size:]
    with_c = hasher.hash_blocks(hasher.root_hash, tokens)
    continued = hasher.hash_blocks(with_c[0], suffix, block_size) if with_c else []
    with hash_chain_set_to(hash_chain_py):
        assert hasher.hash_blocks(hasher.root_hash, tokens) == with_c
        if with_c:
            assert hasher.hash_blocks(with_c[0], suffix, block_size) == continued == with_c[1:]


def refuse_to_hash(*args: object) -> list[bytes]:
    raise AssertionError("hash_chain was called")


def test_extra_keys_and_xxh3_stay_on_the_python_path() -> None:
    tokens = list(range(64))
    sha = BlockHasher(16)
    lora = HashExtras(lora=LoraRef("adapter", "/path"))
    xxh3 = BlockHasher(16, HashAlgorithm.XXH3_128, seed="secret")
    with hash_chain_set_to(refuse_to_hash):
        with_extras = sha.hash_blocks(sha.root_hash, tokens, 0, lora)
        xxh3_chain = xxh3.hash_blocks(xxh3.root_hash, tokens)
    assert len(with_extras) == len(xxh3_chain) == 4
    assert with_extras != sha.hash_blocks(sha.root_hash, tokens)
    assert len(xxh3_chain[0]) == 16
