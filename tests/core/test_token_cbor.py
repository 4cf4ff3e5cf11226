"""The C encoder of token blocks and its pure-Python twin produce the same bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_manager_service.core import hashing
from kv_manager_service.core.hashing import encode_blocks_py

c_encoder = pytest.importorskip("kv_manager_service.core._token_cbor")

token_ids = st.integers(0, 2**32 - 1) | st.integers(0, 300) | st.integers(60_000, 70_000)


def test_the_hasher_uses_the_c_encoder_when_built():
    assert hashing.encode_blocks is c_encoder.encode_blocks


@settings(max_examples=2 * settings.default.max_examples, deadline=None)
@given(st.lists(token_ids, max_size=70), st.integers(1, 9), st.binary(max_size=3), st.binary(max_size=3))
def test_c_and_python_encoders_agree(tokens, block_size, head, tail):
    num_blocks = len(tokens) // block_size
    assert c_encoder.encode_blocks(tokens, block_size, num_blocks, head, tail) == encode_blocks_py(
        tokens, block_size, num_blocks, head, tail
    )


@pytest.mark.parametrize("bad, error", [([-1], OverflowError), ([2**32], OverflowError), ([1.5], TypeError), (["7"], TypeError)])
def test_c_encoder_rejects_what_is_not_a_token_id(bad, error):
    with pytest.raises(error):
        c_encoder.encode_blocks(bad, 1, 1, b"", b"")


def test_c_encoder_refuses_more_blocks_than_tokens():
    with pytest.raises(ValueError):
        c_encoder.encode_blocks([1, 2, 3], 2, 2, b"", b"")


class ShrinkingToken:
    """A token id whose __index__ empties the list it sits in."""

    def __init__(self, tokens: list) -> None:
        self.tokens = tokens

    def __index__(self) -> int:
        self.tokens.clear()
        return 7


def test_c_encoder_raises_when_the_tokens_shrink_while_read():
    tokens: list = [1, 2, 3, 4]
    tokens[1] = ShrinkingToken(tokens)
    with pytest.raises(RuntimeError, match="changed size"):
        c_encoder.encode_blocks(tokens, 2, 2, b"", b"")
