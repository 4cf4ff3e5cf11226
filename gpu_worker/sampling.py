"""How the next token is chosen from logits: greedy, or reproducible Gumbel-max sampling.

Sampling with temperature T picks argmax(logits / T + g), where the Gumbel
noise g of token t is a pure function of (seed, position of the new token, t):

    key   = mix(mix(mix(seed mod 2^32) ^ (seed >> 32)) ^ position)     per row, on the host (`noise_key`)
    bits  = mix(key ^ (t * 0x9E3779B1 mod 2^32))                       per token, on the logits' device
    u     = ((bits >> 9) + 0.5) / 2^23                                 in (0, 1), exact in fp32
    g     = -log(-log(u))

`mix` is a bijective xorshift-multiply hash of 32-bit values, one function
for Python integers and int64 tensors, whose arithmetic is exact on every
device. The choice therefore depends only on the logits, the seed and the
position: the paged worker and the dense reference (which both call
`sample`) pick the same tokens, and a batch needs no random state. The
choice and the log-probability of the chosen token (log_softmax(logits) at
it) are computed on the logits' device, batched over the rows.

`sample` takes only the rows that sample and leaves greedy rows alone;
`sample_rows` computes every row both ways and picks by temperature, with
no branch on the host, for a decode step captured in a CUDA graph. The two
choose the same tokens: the sampled rows' arithmetic is the same.
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import torch


class SamplingParams(NamedTuple):
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # uint64


GREEDY = SamplingParams()
IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)

_MASK32 = 0xFFFFFFFF
_TOKEN_SPREAD = 0x9E3779B1  # odd, so t -> t * _TOKEN_SPREAD mod 2^32 is a bijection
# Sampled rows handled at once: bounds the [rows, vocab] temporaries. Small
# chunks stay in a CPU's caches; a GPU takes a whole batch in one go.
_CHUNK_ELEMENTS = {"cpu": 1 << 17}
_DEFAULT_CHUNK_ELEMENTS = 1 << 26


class SampledRows(NamedTuple):
    """The rows of a batch that sample (temperature > 0), as tensors on the logits' device."""

    rows: torch.Tensor  # int64 [num_sampled]: the row of the logits
    temperatures: torch.Tensor  # float32 [num_sampled], each > 0
    noise_keys: torch.Tensor  # int64 [num_sampled]: `noise_key(seed, position of the token being chosen)`


def noise_key(seed: int, position: int) -> int:
    """The 32-bit key of the noise that picks the token at `position` for a request seeded with uint64 `seed`."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be a uint64, got {seed}")
    if not 0 <= position <= _MASK32:
        raise ValueError(f"position must be in [0, 2^32), got {position}")
    return _mix32(_mix32(_mix32(seed & _MASK32) ^ (seed >> 32)) ^ position)


def sample(logits: torch.Tensor, sampled: SampledRows | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of fp32 `logits` `[num_rows, vocab]`: the chosen token id (int64) and its log-probability (fp32).

    Rows listed in `sampled` draw Gumbel-max with their temperature and noise
    key; every other row is greedy (argmax, first index on ties). Both results
    are on the logits' device; nothing is copied to the host, nothing mutated.
    """
    chunk = _chunk_rows(logits)
    drawn = None  # per row: the sampled token, or -1 for a greedy row
    if sampled is not None and sampled.rows.numel():
        drawn = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
        drawn.index_copy_(0, sampled.rows, _gumbel_argmax(logits, sampled))
    token_ids, logprobs = [], []
    for start in range(0, logits.shape[0], chunk):
        part = logits[start : start + chunk]
        chosen = part.argmax(dim=-1)
        if drawn is not None:
            part_drawn = drawn[start : start + chunk]
            chosen = torch.where(part_drawn >= 0, part_drawn, chosen)
        token_ids.append(chosen)
        logprobs.append(torch.log_softmax(part, dim=-1).gather(1, chosen[:, None])[:, 0])
    return torch.cat(token_ids), torch.cat(logprobs)


def sample_rows(
    logits: torch.Tensor, temperatures: torch.Tensor, noise_keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with a temperature (0: greedy) and a noise key for every row, `[num_rows]` each.

    The same choices and log-probabilities as `sample` given the rows with
    temperature > 0, from a fixed sequence of operations whatever the
    temperatures: Gumbel noise is drawn for every row (a greedy row's is
    unused). Nothing is copied to the host, nothing mutated.
    """
    sampling = temperatures > 0
    scores = logits / torch.where(sampling, temperatures, 1.0)[:, None]
    drawn = scores.add_(gumbel_noise(noise_keys, logits.shape[1])).argmax(dim=-1)
    chosen = torch.where(sampling, drawn, logits.argmax(dim=-1))
    return chosen, torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0]


def choose(logits: torch.Tensor, params: SamplingParams, position: int) -> tuple[int, float]:
    """(token id, the model's log-probability of it) from one row of fp32 logits: `sample` on one row."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    sampled = None
    if params.temperature > 0:
        device = logits.device
        sampled = SampledRows(
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.tensor([params.temperature], dtype=torch.float32, device=device),
            torch.tensor([noise_key(params.seed, position)], dtype=torch.int64, device=device),
        )
    token_ids, logprobs = sample(logits[None], sampled)
    return int(token_ids[0]), float(logprobs[0])


def gumbel_noise(noise_keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 `[len(noise_keys), vocab_size]`: the Gumbel noise of every token for each key (int64)."""
    return _gumbel(noise_keys, _token_codes(vocab_size, noise_keys.device))


def _gumbel_argmax(logits: torch.Tensor, sampled: SampledRows) -> torch.Tensor:
    """argmax(logits / T + g) of each sampled row, int64 `[num_sampled]`."""
    keys = sampled.noise_keys
    codes = _token_codes(logits.shape[1], logits.device)
    chunk = _chunk_rows(logits)
    choices = []
    for start in range(0, keys.shape[0], chunk):
        part = slice(start, start + chunk)
        scores = logits.index_select(0, sampled.rows[part]).div_(sampled.temperatures[part, None])
        choices.append(scores.add_(_gumbel(keys[part], codes)).argmax(dim=-1))
    return torch.cat(choices)


def _chunk_rows(logits: torch.Tensor) -> int:
    """Rows of `logits` to handle at once: a whole batch on a GPU, a cache-sized slice on a CPU."""
    return max(1, _CHUNK_ELEMENTS.get(logits.device.type, _DEFAULT_CHUNK_ELEMENTS) // logits.shape[1])


def _token_codes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """int64 `[vocab_size]`: each token id spread over 32 bits (distinct, since the multiplier is odd)."""
    return (torch.arange(vocab_size, dtype=torch.int64, device=device) * _TOKEN_SPREAD) & _MASK32


def _gumbel(keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """fp32 `[len(keys), len(codes)]`: -log(-log(u)) with u from the hash of each (key, token code)."""
    bits = _mix32(keys[:, None] ^ codes[None, :])
    uniform = (bits >> 9).to(torch.float32).add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_().log_().neg_()


def _mix32(x: IntOrTensor) -> IntOrTensor:
    """A bijective hash of 32-bit values: a Python int, or the values of an int64 tensor (updated in place).

    The multipliers are below 2^31, so each product of a 32-bit value stays
    below 2^63: int64 arithmetic never overflows, and a Python int and a
    tensor on any device give the same bits.
    """
    x ^= x >> 16
    x *= 0x21F0AAAD
    x &= _MASK32
    x ^= x >> 15
    x *= 0x735A2D97
    x &= _MASK32
    x ^= x >> 15
    return x
