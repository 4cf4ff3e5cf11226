"""Canonical CBOR (RFC 8949 section 4.2.1) for the few types block hashes use.

Only what hashing needs: unsigned and negative integers, byte strings, text
strings, arrays (lists and tuples) and null. Integers use their shortest form,
which is what makes the encoding canonical, so the bytes are the same in every
language and on every replica.
"""

from __future__ import annotations

import struct
from typing import Any

_MAJOR_UINT = 0
_MAJOR_NEGINT = 1
_MAJOR_BYTES = 2
_MAJOR_TEXT = 3
_MAJOR_ARRAY = 4
NULL = b"\xf6"

_MAX_UINT64 = (1 << 64) - 1


def encode_head(major: int, value: int) -> bytes:
    """The initial byte(s) of a data item: major type plus its shortest argument."""
    if value < 0 or value > _MAX_UINT64:
        raise ValueError(f"CBOR argument {value} is outside 0..2**64-1")
    top = major << 5
    if value < 24:
        return bytes((top | value,))
    if value < 0x100:
        return bytes((top | 24, value))
    if value < 0x10000:
        return bytes((top | 25,)) + struct.pack(">H", value)
    if value < 0x100000000:
        return bytes((top | 26,)) + struct.pack(">I", value)
    return bytes((top | 27,)) + struct.pack(">Q", value)


def encode_uint(value: int) -> bytes:
    return encode_head(_MAJOR_UINT, value)


def encode_bytes_head(num_bytes: int) -> bytes:
    return encode_head(_MAJOR_BYTES, num_bytes)


def encode_array_head(num_items: int) -> bytes:
    return encode_head(_MAJOR_ARRAY, num_items)


def encode(value: Any) -> bytes:
    """Canonical CBOR of `value` (int, bytes, str, list/tuple of those, None)."""
    if value is None:
        return NULL
    if isinstance(value, bool):
        raise TypeError("booleans are not part of the block-hash encoding")
    if isinstance(value, int):
        if value >= 0:
            return encode_head(_MAJOR_UINT, value)
        return encode_head(_MAJOR_NEGINT, -1 - value)
    if isinstance(value, (bytes, bytearray)):
        return encode_head(_MAJOR_BYTES, len(value)) + bytes(value)
    if isinstance(value, str):
        data = value.encode("utf-8")
        return encode_head(_MAJOR_TEXT, len(data)) + data
    if isinstance(value, (list, tuple)):
        return encode_head(_MAJOR_ARRAY, len(value)) + b"".join(map(encode, value))
    raise TypeError(f"cannot CBOR-encode a {type(value).__name__}")
