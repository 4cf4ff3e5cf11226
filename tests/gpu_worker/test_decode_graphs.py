"""Decode steps through static buffers padded to batch-size buckets: the same tokens as the eager path.

On a CPU the buckets' bodies run eagerly over the static buffers (everything but the capture);
the `gpu` test captures CUDA graphs with the Triton kernels and replays them.
"""

from __future__ import annotations

import random

import pytest
import torch
from devices import DEVICE

import kernels
from gpu_worker.decode_graphs import DecodeGraphs, DecodeInputs, bucket_sizes
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import BUILTIN_MODELS
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape, ScheduledRequest
from gpu_worker.sampling import GREEDY, SamplingParams
from gpu_worker.weights import random_weights
from kvcache.v1 import kv_manager_pb2 as pb

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_REQUESTS = 8
PARAMS = [GREEDY, SamplingParams(1.0, 5), SamplingParams(0.7, 9), GREEDY, SamplingParams(1.3, 2**64 - 1)]
# Decode rows per step, as requests finish and return: buckets 8, 4, 1, 2, then 8 again.
DECODE_ROWS = [5, 5, 3, 1, 2, 5]


def make_runner(device: str, backend: str) -> ModelRunner:
    config = BUILTIN_MODELS["tiny-swa"]
    groups = (CacheGroup(0, BLOCK_SIZE, 0), CacheGroup(1, BLOCK_SIZE, 24))
    pool = PoolShape(NUM_BLOCKS, groups, max_model_len=64, max_num_requests=MAX_REQUESTS)
    weights = random_weights(config, 3, torch.float32, torch.device(device))
    model = LlamaModel(config, weights)
    return ModelRunner(model, pool, kernels.load(backend, device), torch.device(device), torch.float32)


def generate(runner: ModelRunner) -> list[list[tuple[str, int, float]]]:
    """Five requests (blocks 1..50, block 0 and 51.. owned by none) prefill, then decode DECODE_ROWS rows."""
    rng = random.Random(0)
    vocab = runner.model.config.vocab_size
    delta = pb.StepDelta(step_id=1)
    blocks = iter(range(1, NUM_BLOCKS))
    for index in range(len(PARAMS)):
        row = delta.rows_added.add(request_id=f"r{index}")
        for group_id in range(2):
            row.groups.add(group_id=group_id, block_ids=[next(blocks) for _ in range(5)])
    runner.apply_step(delta)
    tokens = {f"r{i}": [rng.randrange(vocab) for _ in range(3 + 2 * i)] for i in range(len(PARAMS))}
    steps = [[ScheduledRequest(rid, t, 0, PARAMS[i]) for i, (rid, t) in enumerate(tokens.items())]]
    results = []
    for num_rows in DECODE_ROWS:
        outputs = runner.execute(steps[-1])
        results.append([tuple(output) for output in outputs])
        for output in outputs:
            tokens[output.request_id].append(output.token_id)
        steps.append([
            ScheduledRequest(rid, [tokens[rid][-1]], len(tokens[rid]) - 1, PARAMS[int(rid[1:])])
            for rid in list(tokens)[:num_rows]
        ])  # fmt: skip
    return results


def assert_same_outputs(actual, expected) -> None:
    for got, want in zip(actual, expected, strict=True):
        assert [(rid, token) for rid, token, _ in got] == [(rid, token) for rid, token, _ in want]
        assert [logprob for *_, logprob in got] == pytest.approx([logprob for *_, logprob in want], abs=1e-4)


def test_bucket_sizes_are_powers_of_two_up_to_the_request_cap():
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(12) == (1, 2, 4, 8, 12)
    assert bucket_sizes(1000) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    graphs = DecodeGraphs(DecodeInputs.allocate(12, [3], torch.device("cpu")), bucket_sizes(12), lambda inputs: None)
    assert [graphs.bucket_of(n) for n in (1, 3, 5, 9, 12, 13)] == [1, 4, 8, 12, 12, None]
    with pytest.raises(ValueError, match="batch sizes"):
        DecodeGraphs(DecodeInputs.allocate(4, [3], torch.device("cpu")), (2, 8), lambda inputs: None)


def test_padded_decode_steps_choose_what_eager_steps_choose_and_padding_writes_nothing():
    eager = make_runner("cpu", "torch")
    padded = make_runner("cpu", "torch")
    padded.use_decode_graphs(bucket_sizes(MAX_REQUESTS), capture=False)
    ran = []
    body = padded.decode_graphs.body
    padded.decode_graphs.body = lambda inputs: ran.append(inputs.token_ids.shape[0]) or body(inputs)

    assert_same_outputs(generate(padded), generate(eager))
    assert ran == [8, 8, 4, 1, 2]  # every decode step went through its bucket; the prefill did not
    for padded_cache, eager_cache in zip(padded.kv_caches, eager.kv_caches):
        torch.testing.assert_close(padded_cache, eager_cache, atol=1e-5, rtol=1e-5)
        assert not padded_cache[0].any() and not padded_cache[51:].any()  # no request owns these


def test_a_decode_step_past_the_largest_bucket_runs_eagerly():
    eager = make_runner("cpu", "torch")
    padded = make_runner("cpu", "torch")
    padded.use_decode_graphs((1, 2), capture=False)
    ran = []
    body = padded.decode_graphs.body
    padded.decode_graphs.body = lambda inputs: ran.append(inputs.token_ids.shape[0]) or body(inputs)
    assert_same_outputs(generate(padded), generate(eager))
    assert ran == [1, 2]
    with pytest.raises(ValueError, match="exceed the pool"):
        padded.use_decode_graphs((16,), capture=False)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_captured_cuda_graphs_replay_what_eager_steps_compute():
    eager = make_runner("cuda", "triton")
    captured = make_runner("cuda", "triton")
    captured.use_decode_graphs(bucket_sizes(MAX_REQUESTS), capture=True)
    assert sorted(captured.decode_graphs.graphs) == [1, 2, 4, 8]
    for cache in captured.kv_caches:
        assert not cache.any()  # the capture's warm-up runs had no real row: nothing was stored
    assert_same_outputs(generate(captured), generate(eager))
