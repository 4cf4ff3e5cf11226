"""Chained block hashes: byte-compatible sha256_cbor, extra keys, seeds, xxh3_128.

The reference implementation here is written from docs/architecture.md ("Block hashing") with
`cbor2` (canonical) and `hashlib`, independently of the fast encoder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from typing import Iterator

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_manager_service.core import (
    BlockHasher,
    GroupKind,
    GroupSpec,
    HashAlgorithm,
    KVCacheConfig,
    KVCacheManager,
    LoraRef,
    MMFeature,
)
from kv_manager_service.core import cbor, hashing
from kv_manager_service.core.hashing import HashExtras, block_extra_keys, encode_blocks_py

DESIGN_VECTOR = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"

# Token ids in every CBOR width class: immediate, 1, 2 and 4 argument bytes.
TOKEN_IDS = st.one_of(
    st.integers(0, 23),
    st.integers(24, 255),
    st.integers(256, 65535),
    st.integers(65536, 2**32 - 1),
)


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def reference_extra_keys(extras: HashExtras, block_start: int, block_size: int) -> list | None:
    keys: list = []
    if extras.lora is not None:
        keys.append(["lora", extras.lora.name, extras.lora.path])
    for mm in extras.mm_features:
        if mm.offset < block_start + block_size and mm.offset + mm.length > block_start:
            keys.append(["mm", mm.identifier, mm.offset - block_start])
    if extras.cache_salt and block_start == 0:
        keys.append(["cache_salt", extras.cache_salt])
    return keys or None


def reference_chain(
    token_ids: list[int], block_size: int, extras: HashExtras = HashExtras(), seed: str | None = None
) -> list[bytes]:
    parent = sha256_cbor(seed if seed else "vllm-none-hash")
    chain = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        extra = reference_extra_keys(extras, start, block_size)
        parent = sha256_cbor([parent, token_ids[start : start + block_size], extra])
        chain.append(parent)
    return chain


# The token-block encoder and the sha256_cbor chain in use (C when built), and their pure-Python twins.
ENCODERS = {
    "default": (hashing.encode_blocks, hashing.hash_chain),
    "python": (encode_blocks_py, hashing.hash_chain_py),
}


@contextlib.contextmanager
def using_encoder(name: str) -> Iterator[None]:
    saved = hashing.encode_blocks, hashing.hash_chain
    hashing.encode_blocks, hashing.hash_chain = ENCODERS[name]
    try:
        yield
    finally:
        hashing.encode_blocks, hashing.hash_chain = saved


@st.composite
def extras_for(draw: st.DrawFn, num_tokens: int) -> HashExtras:
    lora = draw(st.none() | st.builds(LoraRef, st.text(max_size=8), st.text(max_size=12)))
    salt = draw(st.none() | st.text(min_size=1, max_size=8))
    mm: list[MMFeature] = []
    if num_tokens:
        for _ in range(draw(st.integers(0, 3))):
            offset = draw(st.integers(0, num_tokens - 1))
            length = draw(st.integers(1, num_tokens - offset))
            mm.append(MMFeature(draw(st.text(min_size=1, max_size=6)), offset, length))
    return HashExtras(lora, salt, tuple(mm))


# -- vectors and roots ---------------------------------------------------------------------------


def test_design_test_vector() -> None:
    hasher = BlockHasher(16)
    assert hasher.hash_blocks(hasher.root_hash, list(range(16)))[0].hex() == DESIGN_VECTOR
    assert hasher.hash_block(hasher.root_hash, range(16)).hex() == DESIGN_VECTOR


def test_root_is_the_hash_of_the_none_seed() -> None:
    assert BlockHasher(16).root_hash == sha256_cbor("vllm-none-hash")


def test_seed_changes_the_root_and_the_chain() -> None:
    default = BlockHasher(4)
    seeded = BlockHasher(4, seed="replica-secret")
    assert seeded.root_hash == sha256_cbor("replica-secret")
    assert seeded.root_hash != default.root_hash
    tokens = list(range(8))
    assert seeded.hash_blocks(seeded.root_hash, tokens) == reference_chain(tokens, 4, seed="replica-secret")
    assert seeded.hash_blocks(seeded.root_hash, tokens) != default.hash_blocks(default.root_hash, tokens)
    assert BlockHasher(4, seed="other").root_hash != seeded.root_hash


def test_hashes_do_not_depend_on_the_process() -> None:
    """Never Python's salted hash(): another interpreter computes the same bytes."""
    code = (
        "from kv_manager_service.core import BlockHasher, LoraRef\n"
        "from kv_manager_service.core.hashing import HashExtras\n"
        "h = BlockHasher(4)\n"
        "e = HashExtras(LoraRef('a', '/a'), 'salt')\n"
        "print(h.hash_blocks(h.root_hash, list(range(12)), 0, e)[-1].hex())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    output = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    hasher = BlockHasher(4)
    expected = hasher.hash_blocks(hasher.root_hash, list(range(12)), 0, HashExtras(LoraRef("a", "/a"), "salt"))
    assert output.stdout.strip() == expected[-1].hex()


# -- the fast encoder against cbor2 --------------------------------------------------------------


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@settings(deadline=None)
@given(data=st.data(), block_size=st.integers(1, 16), token_ids=st.lists(TOKEN_IDS, max_size=64))
def test_fast_encoder_equals_cbor2(encoder: str, data: st.DataObject, block_size: int, token_ids: list[int]) -> None:
    extras = data.draw(st.just(HashExtras()) | extras_for(len(token_ids)))
    hasher = BlockHasher(block_size)
    with using_encoder(encoder):
        chain = hasher.hash_blocks(hasher.root_hash, token_ids, 0, extras)
    assert chain == reference_chain(token_ids, block_size, extras)


@settings(deadline=None)
@given(token_ids=st.lists(TOKEN_IDS, min_size=1, max_size=16), extra=st.none() | st.lists(st.text(), max_size=2))
def test_hash_block_equals_cbor2(token_ids: list[int], extra: list | None) -> None:
    hasher = BlockHasher(len(token_ids))
    expected = sha256_cbor([hasher.root_hash, token_ids, extra or None])
    assert hasher.hash_block(hasher.root_hash, token_ids, extra) == expected


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_large_token_ids_are_encoded_every_time(encoder: str) -> None:
    # Ids past the Python memo table are encoded on the fly; repeated use gives the same bytes.
    tokens = [2**18 - 1, 2**18, 2**18 + 1, 2**32 - 1, 0, 23, 24, 255, 256, 65535, 65536, 2**18 - 1]
    hasher = BlockHasher(4)
    with using_encoder(encoder):
        for _ in range(2):
            assert hasher.hash_blocks(hasher.root_hash, tokens) == reference_chain(tokens, 4)


def test_trailing_partial_block_is_not_hashed() -> None:
    hasher = BlockHasher(4)
    assert len(hasher.hash_blocks(hasher.root_hash, list(range(11)))) == 2
    assert hasher.hash_blocks(hasher.root_hash, [1, 2, 3]) == []


@settings(deadline=None)
@given(data=st.data(), token_ids=st.lists(TOKEN_IDS, min_size=8, max_size=40))
def test_hashing_a_suffix_from_its_parent_continues_the_chain(data: st.DataObject, token_ids: list[int]) -> None:
    block_size = 4
    extras = data.draw(extras_for(len(token_ids)))
    hasher = BlockHasher(block_size)
    whole = hasher.hash_blocks(hasher.root_hash, token_ids, 0, extras)
    split = data.draw(st.integers(1, len(token_ids) // block_size)) * block_size
    head = hasher.hash_blocks(hasher.root_hash, token_ids[:split], 0, extras)
    tail = hasher.hash_blocks(head[-1], token_ids[split:], split, extras)
    assert head + tail == whole


# -- extra keys --------------------------------------------------------------------------------


def test_extra_keys_order_and_placement() -> None:
    extras = HashExtras(LoraRef("adapter", "/a"), "salt", (MMFeature("img", 2, 9), MMFeature("aud", 9, 1)))
    # Block [0, 4): lora, the image (offset 2), the salt.
    assert block_extra_keys(extras, 0, 4) == [["lora", "adapter", "/a"], ["mm", "img", 2], ["cache_salt", "salt"]]
    # Block [4, 8): the image started 2 tokens before it: a negative offset; no salt.
    assert block_extra_keys(extras, 4, 4) == [["lora", "adapter", "/a"], ["mm", "img", -2]]
    assert block_extra_keys(extras, 8, 4) == [["lora", "adapter", "/a"], ["mm", "img", -6], ["mm", "aud", 1]]
    assert block_extra_keys(extras, 12, 4) == [["lora", "adapter", "/a"]]
    assert block_extra_keys(HashExtras(cache_salt="salt"), 4, 4) is None


def test_every_extra_key_changes_the_hashes_it_should() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(12))
    plain = hasher.hash_blocks(hasher.root_hash, tokens)
    salted = hasher.hash_blocks(hasher.root_hash, tokens, 0, HashExtras(cache_salt="s"))
    lora_a = hasher.hash_blocks(hasher.root_hash, tokens, 0, HashExtras(LoraRef("n", "/a")))
    lora_b = hasher.hash_blocks(hasher.root_hash, tokens, 0, HashExtras(LoraRef("n", "/b")))
    # Every hash of a salted chain differs (through the parent), every lora hash too.
    assert all(x != y for x, y in zip(plain, salted))
    assert all(x != y for x, y in zip(lora_a, lora_b))
    # The salt enters block 0 only: from block 1 on, the salted chain is the plain
    # recurrence over a different root.
    assert salted[1] == sha256_cbor([salted[0], tokens[4:8], None])
    # A multimodal item changes the blocks it overlaps and, through the chain, the rest.
    mm = hasher.hash_blocks(hasher.root_hash, tokens, 0, HashExtras(mm_features=(MMFeature("img", 5, 2),)))
    assert mm[0] == plain[0] and mm[1] != plain[1] and mm[2] != plain[2]


# -- canonical CBOR ----------------------------------------------------------------------------


CBOR_VALUES = st.recursive(
    st.none() | st.integers(-(2**64), 2**64 - 1) | st.binary(max_size=40) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=2 * settings.default.max_examples, deadline=None)
@given(value=CBOR_VALUES)
def test_cbor_encode_equals_cbor2_canonical(value: object) -> None:
    assert cbor.encode(value) == cbor2.dumps(value, canonical=True)


def test_cbor_encode_of_tuples_is_an_array() -> None:
    assert cbor.encode((1, b"x", "y")) == cbor2.dumps([1, b"x", "y"], canonical=True)


@pytest.mark.parametrize("value", [True, 1.5, 2**64, -(2**64) - 1, {"a": 1}])
def test_cbor_refuses_what_block_hashes_never_contain(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        cbor.encode(value)


# -- xxh3_128 -----------------------------------------------------------------------------------


def test_xxh3_is_refused_without_a_seed() -> None:
    with pytest.raises(ValueError):
        BlockHasher(16, HashAlgorithm.XXH3_128)
    with pytest.raises(ValueError):
        BlockHasher(16, "xxh3_128", seed="")
    with pytest.raises(ValueError):
        KVCacheConfig(num_blocks=8, hash_algorithm="xxh3_128")


def test_xxh3_is_deterministic_with_a_seed() -> None:
    tokens = list(range(48))
    a = BlockHasher(16, "xxh3_128", seed="secret")
    b = BlockHasher(16, HashAlgorithm.XXH3_128, seed="secret")
    other = BlockHasher(16, "xxh3_128", seed="other-secret")
    chain = a.hash_blocks(a.root_hash, tokens)
    assert chain == b.hash_blocks(b.root_hash, tokens)
    assert all(len(h) == 16 for h in chain) and len(a.root_hash) == 16
    assert chain != other.hash_blocks(other.root_hash, tokens)
    assert chain != BlockHasher(16, seed="secret").hash_blocks(BlockHasher(16, seed="secret").root_hash, tokens)
    # The 16-byte parent is framed as a 16-byte CBOR string: block-by-block equals whole.
    assert a.hash_block(a.hash_blocks(a.root_hash, tokens[:32])[-1], tokens[32:]) == chain[-1]


def test_manager_with_xxh3_finds_prefix_hits() -> None:
    config = KVCacheConfig(
        num_blocks=11, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),), hash_algorithm="xxh3_128", hash_seed="s"
    )
    m = KVCacheManager(config)
    m.allocate("a", list(range(9)), 9)
    assert m.find_cache_hit(list(range(9))).num_cached_tokens == 8
    m.check_invariants()


# -- incremental hashing through the manager ---------------------------------------------------


@settings(deadline=None)
@given(
    data=st.data(),
    sequence=st.lists(TOKEN_IDS, min_size=2, max_size=40),
    hash_block_size=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_incremental_hashing_equals_hashing_the_whole_sequence(
    data: st.DataObject, sequence: list[int], hash_block_size: int
) -> None:
    extras = data.draw(extras_for(len(sequence)))
    prompt_len = data.draw(st.integers(1, len(sequence)))
    config = KVCacheConfig(num_blocks=64, groups=(GroupSpec(GroupKind.FULL_ATTENTION, hash_block_size),))
    m = KVCacheManager(config)
    mm = tuple(f for f in extras.mm_features if f.offset + f.length <= prompt_len)
    extras = HashExtras(extras.lora, extras.cache_salt, mm)
    m.allocate("r", sequence[:prompt_len], prompt_len, cache_salt=extras.cache_salt, lora=extras.lora, mm_features=mm)
    position = prompt_len
    while position < len(sequence):
        n = data.draw(st.integers(1, min(3, len(sequence) - position)))
        m.allocate("r", sequence[position : position + n], n)
        position += n
    m.check_invariants()
    hasher = BlockHasher(hash_block_size)
    whole = hasher.hash_blocks(hasher.root_hash, sequence, 0, extras)
    assert m.requests["r"].block_hashes == whole
    assert whole == reference_chain(sequence, hash_block_size, extras)
    # Every full block is now cached: a new request with the same inputs hits all of them.
    hit = m.find_cache_hit(sequence + [0], extras.cache_salt, extras.lora, mm)
    assert hit.num_cached_tokens == len(sequence) // hash_block_size * hash_block_size


def test_decode_one_token_at_a_time_gives_the_prompt_chain() -> None:
    m = KVCacheManager(KVCacheConfig(num_blocks=20, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),)))
    sequence = [7, 300, 70000, 2**32 - 1, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    m.allocate("decoded", sequence[:1], 1)
    for token in sequence[1:]:
        m.allocate("decoded", [token], 1)
    m.allocate("prefilled", sequence, len(sequence))
    assert m.requests["decoded"].block_hashes == m.requests["prefilled"].block_hashes
    assert m.requests["decoded"].tail_token_ids == m.requests["prefilled"].tail_token_ids == [13]
    m.check_invariants()
