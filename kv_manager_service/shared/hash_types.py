"""The values block hashes are made from and made into: the hash itself, the algorithm, and a
request's LoRA adapter and multimodal items (see `core.hashing` for how they enter the chain)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)


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
