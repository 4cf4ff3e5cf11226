"""Sampling on the logits' device: batched, reproducible from (logits, seed, position), as the dense pass samples."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker import sampling
from gpu_worker.sampling import (
    GREEDY,
    SampledRows,
    SamplingParams,
    choose,
    gumbel_noise,
    noise_key,
    sample,
    sample_rows,
)
from devices import DEVICE

CUDA = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")


def batch_of(params: list[SamplingParams], positions: list[int], device: str = "cpu") -> SampledRows | None:
    """The SampledRows of a batch whose row i has params[i] and chooses the token at positions[i]."""
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return None
    return SampledRows(
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=device),
        torch.tensor([noise_key(params[i].seed, positions[i]) for i in rows], dtype=torch.int64, device=device),
    )


PARAMS = [
    GREEDY,
    SamplingParams(1.0, 0),
    SamplingParams(0.7, 12345),
    GREEDY,
    SamplingParams(1.3, (1 << 64) - 1),
    SamplingParams(1.0, 7),
]
POSITIONS = [5, 0, 17, 300, 4095, 5]


@pytest.mark.parametrize("vocab_size", [1, 7, 2048])
def test_a_batch_chooses_what_the_dense_reference_chooses_row_by_row(vocab_size):
    logits = torch.randn(len(PARAMS), vocab_size, generator=torch.Generator().manual_seed(vocab_size))
    token_ids, logprobs = sample(logits, batch_of(PARAMS, POSITIONS))
    assert token_ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    for row, (params, position) in enumerate(zip(PARAMS, POSITIONS)):
        assert (int(token_ids[row]), float(logprobs[row])) == choose(logits[row], params, position)


def test_greedy_rows_take_the_first_maximum_and_the_logprob_is_log_softmax_there():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    logits[2, [10, 20]] = logits[2].max() + 1  # a tie: the first index wins
    token_ids, logprobs = sample(logits, None)
    assert token_ids.tolist() == logits.argmax(-1).tolist() and int(token_ids[2]) == 10
    expected = torch.log_softmax(logits, -1).gather(1, token_ids[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, rtol=1e-6, atol=1e-6)


def test_sampled_rows_report_the_log_softmax_of_the_token_they_drew():
    logits = torch.randn(len(PARAMS), 500, generator=torch.Generator().manual_seed(2))
    token_ids, logprobs = sample(logits, batch_of(PARAMS, POSITIONS))
    expected = torch.log_softmax(logits, -1).gather(1, token_ids[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, rtol=1e-6, atol=1e-6)
    assert (token_ids != logits.argmax(-1)).any()  # the sampled rows did not all fall back to greedy


def test_a_choice_depends_only_on_the_logits_the_seed_and_the_position():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(2.0, 99)
    alone = choose(logits[0], params, 40)
    # The same row inside a larger batch, at another row index, with other rows around it.
    batch = torch.cat([torch.randn(3, 1000), logits, torch.randn(2, 1000)])
    rows = [SamplingParams(1.0, 1), GREEDY, SamplingParams(1.0, 2), params, GREEDY, SamplingParams(1.0, 99)]
    positions = [40, 40, 41, 40, 9, 41]
    token_ids, logprobs = sample(batch, batch_of(rows, positions))
    assert (int(token_ids[3]), float(logprobs[3])) == alone
    by_seed = {choose(logits[0], SamplingParams(2.0, seed), 40)[0] for seed in range(30)}
    by_position = {choose(logits[0], params, position)[0] for position in range(30)}
    assert len(by_seed) > 5 and len(by_position) > 5


def test_sampling_follows_the_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature, draws = 0.8, 6000
    counts = torch.zeros(4)
    for position in range(draws):
        counts[choose(logits[0], SamplingParams(temperature, 1234), position)[0]] += 1
    torch.testing.assert_close(counts / draws, torch.softmax(logits[0] / temperature, -1), atol=0.02, rtol=0)


def test_the_noise_is_standard_gumbel():
    noise = gumbel_noise(torch.tensor([noise_key(seed, 11) for seed in range(4)]), 1 << 16)
    assert noise.shape == (4, 1 << 16) and noise.dtype == torch.float32 and noise.isfinite().all()
    euler_gamma, gumbel_std = 0.5772156649, torch.pi / 6**0.5
    moments = torch.stack((noise.double().mean(1), noise.double().std(1)))
    expected = torch.tensor([[euler_gamma] * 4, [gumbel_std] * 4], dtype=torch.float64)
    torch.testing.assert_close(moments, expected, atol=0.02, rtol=0)
    # Rows of different keys are not shifted copies of one another.
    assert not torch.equal(noise[0].sort().values[:100], noise[1].sort().values[:100])


def test_noise_keys_use_every_bit_of_the_seed_and_refuse_what_is_not_a_uint64():
    seeds = [0, 1, 1 << 32, 1 << 63, (1 << 64) - 1]
    assert len({noise_key(seed, 0) for seed in seeds}) == len(seeds)
    assert noise_key(5, 1) != noise_key(5, 2)
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match="uint64"):
            noise_key(bad, 0)
    with pytest.raises(ValueError, match="temperature"):
        choose(torch.zeros(3), SamplingParams(-1.0), 0)


def test_the_hash_gives_the_same_bits_for_python_ints_and_int64_tensors():
    rng = random.Random(0)
    values = [0, 1, (1 << 32) - 1] + [rng.getrandbits(32) for _ in range(200)]
    hashed = sampling._mix32(torch.tensor(values, dtype=torch.int64))
    assert hashed.tolist() == [sampling._mix32(value) for value in values]
    assert len(set(hashed.tolist())) == len(values) and int(hashed.max()) < 1 << 32


@pytest.mark.parametrize("vocab_size", [1, 7, 2048])
def test_every_row_computed_both_ways_chooses_what_sample_chooses(vocab_size):
    """`sample_rows` (no host-side branch: a CUDA graph's) against `sample` over a mixed batch, on the tests' device."""
    logits = (4 * torch.randn(len(PARAMS), vocab_size, generator=torch.Generator().manual_seed(vocab_size))).to(DEVICE)
    temperatures = torch.tensor([p.temperature for p in PARAMS], device=DEVICE)
    keys = torch.tensor([noise_key(p.seed, n) if p.temperature else 0 for p, n in zip(PARAMS, POSITIONS)], device=DEVICE)
    expected = sample(logits, batch_of(PARAMS, POSITIONS, DEVICE))
    actual = sample_rows(logits, temperatures, keys)
    assert torch.equal(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1], atol=0, rtol=0)
    greedy_only = sample_rows(logits, torch.zeros_like(temperatures), keys)
    assert torch.equal(greedy_only[0], logits.argmax(dim=-1))


def test_chunking_over_rows_changes_nothing(monkeypatch):
    logits = torch.randn(len(PARAMS), 3000, generator=torch.Generator().manual_seed(4))
    whole = sample(logits, batch_of(PARAMS, POSITIONS))
    monkeypatch.setitem(sampling._CHUNK_ELEMENTS, "cpu", 1)  # one row at a time
    by_row = sample(logits, batch_of(PARAMS, POSITIONS))
    assert torch.equal(whole[0], by_row[0]) and torch.equal(whole[1], by_row[1])


@pytest.mark.gpu
@CUDA
def test_a_cuda_batch_draws_the_cpu_noise_and_tokens():
    keys = torch.tensor([noise_key(seed, 3) for seed in range(8)])
    cpu_noise = gumbel_noise(keys, 128256)
    cuda_noise = gumbel_noise(keys.cuda(), 128256)
    torch.testing.assert_close(cuda_noise.cpu(), cpu_noise, rtol=1e-6, atol=1e-6)  # log may differ by an ulp
    logits = torch.randn(len(PARAMS), 128256, generator=torch.Generator().manual_seed(5)) * 4
    cpu_tokens, cpu_logprobs = sample(logits, batch_of(PARAMS, POSITIONS))
    cuda_tokens, cuda_logprobs = sample(logits.cuda(), batch_of(PARAMS, POSITIONS, "cuda"))
    assert cuda_tokens.cpu().tolist() == cpu_tokens.tolist()
    torch.testing.assert_close(cuda_logprobs.cpu(), cpu_logprobs, rtol=1e-5, atol=1e-5)
