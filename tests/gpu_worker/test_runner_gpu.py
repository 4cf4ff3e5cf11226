"""The runner on a CUDA device with the Triton kernels: what only a GPU can show.

- a step picks the dense CPU pass's tokens, greedy and sampled;
- a step moves its inputs in one pinned host-to-device copy, and its results
  back in one device-to-host copy, changed block-table rows included;
- a delta that does not fit the pool is refused before the device sees it,
  and the device is still healthy afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import kernels
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import BUILTIN_MODELS
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape, ScheduledRequest
from gpu_worker.sampling import GREEDY, SamplingParams, choose
from gpu_worker.weights import random_weights
from kv_manager_service.shared.errors import FailedPreconditionError
from kvcache.v1 import kv_manager_pb2 as pb
from devices import DEVICE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")]

MODEL = "tiny-swa"
BLOCK_SIZE = 16
NUM_BLOCKS = 64
PARAMS = {"a": GREEDY, "b": SamplingParams(1.0, 5), "c": SamplingParams(0.7, 9)}


def make_runner() -> ModelRunner:
    config = BUILTIN_MODELS[MODEL]
    device = torch.device("cuda")
    groups = (CacheGroup(0, BLOCK_SIZE, 0), CacheGroup(1, BLOCK_SIZE, config.sliding_window))
    model = LlamaModel(config, random_weights(config, 3, torch.float32, device))
    pool = PoolShape(NUM_BLOCKS, groups, max_model_len=256, max_num_requests=8)
    return ModelRunner(model, pool, kernels.load("triton", "cuda"), device, torch.float32)


def start(runner: ModelRunner, prompts: dict[str, list[int]]) -> None:
    """Step 1: a table of three blocks per group for each request (blocks 0..17 at most)."""
    delta = pb.StepDelta(step_id=1)
    for index, request_id in enumerate(prompts):
        row = delta.rows_added.add(request_id=request_id)
        for group_id in range(2):
            first = 6 * index + 3 * group_id
            row.groups.add(group_id=group_id, block_ids=range(first, first + 3))
    runner.apply_step(delta)


def prompts_of(vocab_size: int) -> dict[str, list[int]]:
    return {rid: [(7 * n + len(rid) * i) % vocab_size for i in range(n)] for rid, n in zip(PARAMS, (5, 17, 30))}


def test_steps_on_the_device_choose_what_the_dense_cpu_pass_chooses():
    runner = make_runner()
    config = runner.model.config
    dense = LlamaModel(config, random_weights(config, 3, torch.float32, torch.device("cpu")))
    tokens = prompts_of(config.vocab_size)
    start(runner, tokens)
    scheduled = {rid: ScheduledRequest(rid, list(t), 0, PARAMS[rid]) for rid, t in tokens.items()}
    for _ in range(4):
        outputs = runner.execute(list(scheduled.values()))
        for output in outputs:
            rid, sequence = output.request_id, tokens[output.request_id]
            expected, logprob = choose(dense.dense_logits(torch.tensor(sequence)), PARAMS[rid], len(sequence))
            assert output.token_id == expected, output
            assert output.logprob == pytest.approx(logprob, abs=2e-3), output
            scheduled[rid] = ScheduledRequest(rid, [output.token_id], len(sequence), PARAMS[rid])
            sequence.append(output.token_id)


def test_a_step_copies_once_each_way_and_from_pinned_memory():
    runner = make_runner()
    tokens = prompts_of(runner.model.config.vocab_size)
    start(runner, tokens)
    scheduled = [ScheduledRequest(rid, t, 0, PARAMS[rid]) for rid, t in tokens.items()]
    for _ in range(2):  # a prefill, then a decode step: every kernel is compiled before the measured step
        outputs = runner.execute(scheduled)
        for output in outputs:
            tokens[output.request_id].append(output.token_id)
        scheduled = [
            ScheduledRequest(o.request_id, [o.token_id], len(tokens[o.request_id]) - 1, PARAMS[o.request_id])
            for o in outputs
        ]
    appended = pb.StepDelta(step_id=2)  # changed table rows must travel in the same copy
    appended.blocks_appended.add(request_id="a", group_id=0, new_block_index=3, block_ids=[40])
    runner.apply_step(appended)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        runner.execute(scheduled)
        torch.cuda.synchronize()
    names = [event.name for event in trace.events()]
    to_device = [name for name in names if name.startswith("Memcpy HtoD")]
    to_host = [name for name in names if name.startswith("Memcpy DtoH")]
    assert len(to_device) == 1 and "Pinned" in to_device[0], to_device
    assert len(to_host) == 1, to_host
    assert runner.tables.batch(["a"])[0].tolist() == [[0, 1, 2, 40]]


def test_a_bad_copy_is_refused_before_the_device_sees_it():
    runner = make_runner()
    start(runner, {"a": [1]})
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, device=cache.device))
    before = [cache.clone() for cache in runner.kv_caches]
    bad = pb.StepDelta(step_id=2)
    bad.copies.add(src_block_id=3, dst_block_id=NUM_BLOCKS + 1000)
    with pytest.raises(FailedPreconditionError, match=r"block ids in \[0, 64\)"):
        runner.apply_step(bad)
    torch.cuda.synchronize()  # no illegal memory access was queued
    assert runner.last_applied_step_id == 1
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
    good = pb.StepDelta(step_id=2)
    good.copies.add(src_block_id=3, dst_block_id=9)
    runner.apply_step(good)
    assert all(torch.equal(cache[9], cache[3]) for cache in runner.kv_caches)
