"""The Mooncake trace as a token-level workload.

The Mooncake FAST'25 traces give each request's prompt as `hash_ids`: one id
per 512 input tokens, where equal ids at equal positions mean an equal prefix
up to that block. To drive a real block manager we expand every id into 512
token ids that depend on the id alone, so chained block hashes reproduce the
trace's prefix sharing exactly:

    tokens(id) = big-endian uint32 words of SHAKE-128("mooncake:<id>"), each mod vocab_size

The derivation is language-neutral (any SHAKE-128 gives the same tokens), and
the prompt is the concatenation of its ids' tokens, cut to `input_length`.

Scaling: a trace of 15k-token prompts is too big for a fast test. With
`scale = s`, every 512-token block becomes `round(512 * s)` tokens (the first
ones of the full block, at least 1), the last partial block shrinks in
proportion, and `output_length` becomes `max(1, round(output_length * s))`.
Prefix sharing is kept: two prompts share their first k scaled blocks exactly
where their first k ids agree.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces
# The project's trace, shipped inside this package (package data), so every install has it.
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"
DEFAULT_VOCAB_SIZE = 32000


@dataclass(frozen=True)
class TraceRecord:
    """One request of the trace, as written (unscaled)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The first `limit` records (all when None) of a Mooncake JSON-lines trace, in file order.

    Raises ValueError on a record whose `hash_ids` do not cover `input_length`
    in 512-token blocks.
    """
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            data = json.loads(line)
            record = TraceRecord(
                int(data["timestamp"]),
                int(data["input_length"]),
                int(data["output_length"]),
                tuple(int(h) for h in data["hash_ids"]),
            )
            num_blocks = -(-record.input_length // TRACE_BLOCK_SIZE)
            if record.input_length < 1 or num_blocks != len(record.hash_ids):
                raise ValueError(
                    f"{path}:{line_number}: input_length {record.input_length} needs {num_blocks} "
                    f"hash ids of {TRACE_BLOCK_SIZE} tokens, got {len(record.hash_ids)}"
                )
            records.append(record)
    return records


class TokenExpander:
    """Expands trace records into prompt token ids; memoises each id's block.

    The memo lives as long as the expander (one block of up to 512 token ids
    per distinct hash id seen), so drop the expander to free it. For
    vocabularies up to 2**20 the token int objects are shared, so a memoised
    block costs about 4 KiB of pointers, and so do prompts built from it.
    """

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE, scale: float = 1.0) -> None:
        if not isinstance(vocab_size, int) or not 1 <= vocab_size <= 1 << 32:
            raise ValueError(f"vocab_size must be an integer in 1..2**32, got {vocab_size!r}")
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {scale!r}")
        self.vocab_size = vocab_size
        self.scale = scale
        self.block_size = scaled_length(TRACE_BLOCK_SIZE, scale)
        self._unpack = struct.Struct(f">{self.block_size}I").unpack
        self._memo: dict[int, tuple[int, ...]] = {}
        self._token_objects: list[int] | None = list(range(vocab_size)) if vocab_size <= 1 << 20 else None

    def block_token_ids(self, hash_id: int) -> tuple[int, ...]:
        """The `block_size` token ids that `hash_id` stands for."""
        tokens = self._memo.get(hash_id)
        if tokens is None:
            digest = hashlib.shake_128(f"mooncake:{hash_id}".encode("ascii")).digest(4 * self.block_size)
            vocab_size = self.vocab_size
            words = self._unpack(digest)
            if self._token_objects is None:
                tokens = tuple(word % vocab_size for word in words)
            else:
                objects = self._token_objects
                tokens = tuple(objects[word % vocab_size] for word in words)
            self._memo[hash_id] = tokens
        return tokens

    def prompt_length(self, record: TraceRecord) -> int:
        """Tokens in the scaled prompt: full scaled blocks, then the scaled last block."""
        num_full = len(record.hash_ids) - 1
        last = record.input_length - num_full * TRACE_BLOCK_SIZE
        return num_full * self.block_size + min(self.block_size, scaled_length(last, self.scale))

    def output_length(self, record: TraceRecord) -> int:
        return scaled_length(record.output_length, self.scale)

    def prompt_token_ids(self, record: TraceRecord) -> list[int]:
        """The prompt of `record`: its ids' blocks concatenated, cut to `prompt_length`."""
        token_ids: list[int] = []
        for hash_id in record.hash_ids:
            token_ids.extend(self.block_token_ids(hash_id))
        del token_ids[self.prompt_length(record) :]
        return token_ids


def scaled_length(num_tokens: int, scale: float) -> int:
    """`round(num_tokens * scale)`, at least 1; the identity at scale 1."""
    if scale == 1:
        return num_tokens
    return max(1, round(num_tokens * scale))


def prompt_token_ids(record: TraceRecord, expander: TokenExpander | None = None) -> list[int]:
    """The prompt token ids of `record`; full length and vocab 32000 unless `expander` says otherwise.

    Pass one `expander` to many calls to share its memo.
    """
    if expander is None:
        expander = TokenExpander()
    return expander.prompt_token_ids(record)
