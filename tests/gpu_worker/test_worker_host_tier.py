"""The host tier on the worker: the buffer GetConfig sizes, the step's tier copies in their order, refusals.

Unit tests run the runner in-process on a CPU (tiny-swa: layer 0 in a
24-token window, layer 1 full attention, so only layer 1 is a tier layer).
The end-to-end test runs a real manager with a small device pool and a host
tier and a real worker: a prompt whose blocks were offloaded and come back
from the host generates exactly what it generated when they were computed,
and what the dense pass chooses.
"""

from __future__ import annotations

import random

import pytest
import torch
from devices import DEVICE
from e2e_support import DenseOracle, start_stack, stop_stack

import kernels
from gpu_worker.host_tier import HostKVBuffer, consecutive_runs
from gpu_worker.memory_budget import HostMemoryError, available_host_bytes, check_host_memory, host_tier_bytes
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import BUILTIN_MODELS
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape
from gpu_worker.server import pool_shape
from gpu_worker.weights import random_weights
from kv_manager_service.shared.errors import FailedPreconditionError
from kvcache.v1 import kv_manager_pb2 as pb

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 16
NUM_HOST_BLOCKS = 8
SLIDING_LAYER, FULL_LAYER = 0, 1


def make_runner(num_host_blocks: int = NUM_HOST_BLOCKS, device: torch.device = CPU) -> ModelRunner:
    """tiny-swa with the torch kernels, random device and host KV."""
    config = BUILTIN_MODELS["tiny-swa"]
    groups = (CacheGroup(0, BLOCK_SIZE, 0), CacheGroup(1, BLOCK_SIZE, 24))
    pool = PoolShape(NUM_BLOCKS, groups, max_model_len=32, max_num_requests=4, num_host_blocks=num_host_blocks)
    weights = random_weights(config, 3, torch.float32, device)
    runner = ModelRunner(LlamaModel(config, weights), pool, kernels.load("torch", device.type), device, torch.float32)
    generator = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    runner.host_kv.blocks.copy_(torch.randn(runner.host_kv.blocks.shape, generator=generator))
    return runner


def tier_delta(step_id: int, offloads=(), onloads=(), copies=()) -> pb.StepDelta:
    delta = pb.StepDelta(step_id=step_id)
    for device_block_id, host_block_id in offloads:
        delta.offloads.add(device_block_id=device_block_id, host_block_id=host_block_id)
    for device_block_id, host_block_id in onloads:
        delta.onloads.add(device_block_id=device_block_id, host_block_id=host_block_id)
    for src, dst in copies:
        delta.copies.add(src_block_id=src, dst_block_id=dst)
    return delta


def test_the_host_buffer_holds_every_full_attention_layer_of_num_host_blocks_blocks():
    runner = make_runner()
    config = runner.model.config
    assert runner.tier_layers == [FULL_LAYER]
    blocks = runner.host_kv.blocks
    assert blocks.shape == (NUM_HOST_BLOCKS, 1, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    assert blocks.dtype == torch.float32 and blocks.device == CPU and not blocks.is_pinned()
    assert runner.host_kv_cache_bytes == NUM_HOST_BLOCKS * 2 * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 4
    assert make_runner(0).host_kv_cache_bytes == 0


def test_get_config_sizes_the_host_tier():
    config = pb.GetConfigResponse(num_blocks=32, max_model_len=64, max_num_requests=2, num_host_blocks=100)
    config.groups.add(group_id=0, kind=pb.GROUP_KIND_FULL_ATTENTION, block_size=16)
    assert pool_shape(config).num_host_blocks == 100
    config.num_host_blocks = 0
    assert pool_shape(config).num_host_blocks == 0


def test_an_offload_reads_a_device_block_before_an_onload_overwrites_it():
    """Device block 5 goes to host block 3 while host block 2 comes into device block 5, in one step."""
    runner = make_runner()
    full, sliding, host = runner.kv_caches[FULL_LAYER], runner.kv_caches[SLIDING_LAYER], runner.host_kv.blocks
    evicted, incoming, sliding_block = full[5].clone(), host[2, 0].clone(), sliding[5].clone()
    assert not torch.equal(evicted, incoming)

    runner.apply_step(tier_delta(1, offloads=[(5, 3)], onloads=[(5, 2)]))

    assert torch.equal(host[3, 0], evicted)  # onloads first would have put `incoming` here
    assert torch.equal(full[5], incoming)
    assert torch.equal(sliding[5], sliding_block)  # no tier there: the window's layer keeps its block
    assert runner.last_applied_step_id == 1


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_on_cuda_the_host_buffer_is_pinned_and_the_copies_keep_their_order():
    runner = make_runner(device=torch.device("cuda"))
    full, host = runner.kv_caches[FULL_LAYER], runner.host_kv.blocks
    assert host.is_pinned() and host.device == CPU
    evicted, incoming, twelve = full[5].cpu(), host[2, 0].clone(), full[12].cpu()

    runner.apply_step(tier_delta(1, offloads=[(5, 3)], onloads=[(5, 2), (7, 3)], copies=[(5, 9)]))
    # The next step reuses both host blocks at once, while step 1's copies may still be queued:
    # host 2, which an onload of step 1 reads, is overwritten; host 3, which an offload of step 1
    # writes, is read back.
    runner.apply_step(tier_delta(2, offloads=[(12, 2)], onloads=[(11, 3)]))
    runner.host_kv.synchronize()

    assert torch.equal(host[3, 0], evicted) and torch.equal(full[11].cpu(), evicted)
    assert torch.equal(full[5].cpu(), incoming) and torch.equal(full[9].cpu(), incoming)
    assert torch.equal(full[7].cpu(), evicted)
    assert torch.equal(host[2, 0], twelve)


def host_ids(rng: random.Random, num_host_blocks: int, size: int) -> list[int]:
    """Distinct host ids: scattered, or one run of consecutive ones (which cross as one transfer)."""
    if rng.random() < 0.5:
        return rng.sample(range(num_host_blocks), size)
    first = rng.randrange(num_host_blocks - size + 1)
    return list(range(first, first + size))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_on_cuda_overlapped_offloads_give_what_the_cpu_copies_give_over_many_steps():
    """Random steps of offloads and onloads that reuse blocks at once, on blocks large enough for the
    transfers to overlap: the CUDA path (side stream, events) ends with the CPU path's bytes."""
    shape, num_layers, num_blocks, num_host_blocks = (2, 16, 8, 128), 4, 48, 32
    generator = torch.Generator().manual_seed(1)
    initial = [torch.randn((num_blocks, *shape), generator=generator) for _ in range(num_layers)]
    cuda = torch.device("cuda")
    sides = {
        device: ([cache.clone().to(device) for cache in initial],
                 HostKVBuffer(num_host_blocks, num_layers, shape, torch.float32, device))
        for device in (CPU, cuda)
    }  # fmt: skip
    rng = random.Random(2)
    for _ in range(40):
        size = rng.randrange(1, 12)
        offloads, onloads = (
            list(zip(rng.sample(range(num_blocks), size), host_ids(rng, num_host_blocks, size))) for _ in range(2)
        )
        for device, (caches, host) in sides.items():
            for pairs, move in ((offloads, host.offload), (onloads, host.onload)):
                device_ids = torch.tensor([d for d, _ in pairs], dtype=torch.int64, device=device)
                move(caches, device_ids, [h for _, h in pairs])
    (cpu_caches, cpu_host), (cuda_caches, cuda_host) = sides[CPU], sides[cuda]
    cuda_host.synchronize()
    assert torch.equal(cuda_host.blocks, cpu_host.blocks)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu_caches, cuda_caches))


def test_an_onload_sees_an_offload_of_the_same_step_and_copies_see_the_onloads():
    runner = make_runner()
    full, host = runner.kv_caches[FULL_LAYER], runner.host_kv.blocks
    evicted, incoming = full[5].clone(), host[2, 0].clone()

    # 5 -> host 3 -> 7; host 2 -> 9, then copy-on-write 9 -> 10.
    runner.apply_step(tier_delta(1, offloads=[(5, 3)], onloads=[(7, 3), (9, 2)], copies=[(9, 10)]))

    assert torch.equal(full[7], evicted)
    assert torch.equal(full[9], incoming) and torch.equal(full[10], incoming)


def test_many_blocks_move_in_one_step_each_to_its_own_place():
    runner = make_runner()
    full, host = runner.kv_caches[FULL_LAYER], runner.host_kv.blocks
    before_device, before_host = full.clone(), host.clone()
    offloads, onloads = [(1, 7), (4, 0), (1, 5)], [(12, 6), (2, 6), (3, 1)]

    runner.apply_step(tier_delta(1, offloads=offloads, onloads=onloads))

    for device_block_id, host_block_id in offloads:
        assert torch.equal(host[host_block_id, 0], before_device[device_block_id])
    for device_block_id, host_block_id in onloads:
        assert torch.equal(full[device_block_id], before_host[host_block_id, 0])
    moved_to_host = {h for _, h in offloads}
    moved_to_device = {d for d, _ in onloads}
    for host_block_id in set(range(NUM_HOST_BLOCKS)) - moved_to_host:
        assert torch.equal(host[host_block_id], before_host[host_block_id])
    for device_block_id in set(range(NUM_BLOCKS)) - moved_to_device:
        assert torch.equal(full[device_block_id], before_device[device_block_id])


# (what is wrong, offloads, onloads, the field, what the error says)
BAD_TIER_COPIES = [
    ("offload from past the device pool", [(NUM_BLOCKS, 1)], [], "offloads",
     r"offloads\[0\].device_block_id is 16, the device pool has blocks 0..15"),
    ("offload to past the host tier", [(1, 1), (2, NUM_HOST_BLOCKS)], [], "offloads",
     r"offloads\[1\].host_block_id is 8, the host tier has blocks 0..7"),
    ("onload from past the host tier", [], [(1, 99)], "onloads", r"onloads\[0\].host_block_id is 99"),
    ("onload into past the device pool", [], [(40, 1)], "onloads", r"onloads\[0\].device_block_id is 40"),
    ("two offloads to one host block", [(1, 4), (2, 4)], [], "offloads",
     r"offloads\[1\] writes host block 4, which an earlier copy of offloads writes too"),
    ("two onloads into one device block", [(1, 4)], [(6, 1), (6, 2)], "onloads",
     r"onloads\[1\] writes device block 6"),
]  # fmt: skip


@pytest.mark.parametrize(
    "offloads, onloads, field, message", [b[1:] for b in BAD_TIER_COPIES], ids=[b[0] for b in BAD_TIER_COPIES]
)
def test_tier_copies_that_do_not_fit_are_refused_before_anything_moves(offloads, onloads, field, message):
    runner = make_runner()
    before = [cache.clone() for cache in runner.kv_caches], runner.host_kv.blocks.clone()
    delta = tier_delta(1, offloads=offloads, onloads=onloads, copies=[(1, 2)])
    delta.rows_added.add(request_id="a").groups.add(group_id=0, block_ids=[1])

    with pytest.raises(FailedPreconditionError, match=message) as refused:
        runner.apply_step(delta)

    assert "step 1 does not fit this worker's pool, and none of it was applied" in str(refused.value)
    assert refused.value.field == field
    assert all(torch.equal(a, b) for a, b in zip(before[0], runner.kv_caches))
    assert torch.equal(before[1], runner.host_kv.blocks)
    assert runner.last_applied_step_id == 0 and "a" not in runner.tables


def test_tier_copies_without_a_host_tier_are_refused():
    runner = make_runner(num_host_blocks=0)
    with pytest.raises(FailedPreconditionError, match=r"onloads\[0\].host_block_id is 0, the host tier has no blocks"):
        runner.apply_step(tier_delta(1, onloads=[(1, 0)]))


# The end-to-end test: a real manager with 12 device blocks of 16 tokens behind which sit 64 host blocks.
E2E_BLOCK_SIZE = 16
E2E_POOL = {"num_blocks": 12, "groups": [{"kind": "full_attention", "block_size": E2E_BLOCK_SIZE}]}
E2E_NUM_HOST_BLOCKS = 64


def tier_stats(stack) -> pb.GetStatsResponse:
    """The manager's GetStats as sent: its tier counters."""
    return stack.manager_client.stub.GetStats(pb.GetStatsRequest())


def prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_a_prefix_loaded_from_the_host_generates_what_computing_it_generated(backend, tmp_path, device):
    stack, processes = start_stack(
        tmp_path, "tiny", backend, E2E_POOL, seed=5, device=device,
        manager_args=["--num-host-blocks", str(E2E_NUM_HOST_BLOCKS)],
    )  # fmt: skip
    try:
        oracle = DenseOracle("tiny", seed=5)
        vocab = oracle.model.config.vocab_size
        assert stack.manager_client.get_config().num_host_blocks == E2E_NUM_HOST_BLOCKS
        tokens = prompt(1, 3 * E2E_BLOCK_SIZE + 5, vocab)  # three full blocks and a tail
        first = stack.scheduler()
        computed = first.add("a-computed", tokens, 6)
        first.run()
        oracle.check(computed)

        # Others fill the 11 usable device blocks twice over, so a's blocks are evicted: to the host.
        for n in range(3):
            others = stack.scheduler()
            others.add(f"other-{n}", prompt(100 + n, 7 * E2E_BLOCK_SIZE, vocab), 2)
            others.run()
        stats = tier_stats(stack)
        assert stats.num_offloaded_blocks > 0

        second = stack.scheduler()
        loaded = second.add("a-loaded", tokens, 6)
        second.step()
        assert loaded.num_cached_prompt_tokens == 3 * E2E_BLOCK_SIZE
        second.run()
        stats = tier_stats(stack)
        assert stats.num_onloaded_blocks > 0 and stats.prefix_cache_host_hits > 0

        assert loaded.output == computed.output
        oracle.check(loaded)
        assert stats.num_pending_copies == 0  # the worker acknowledged the tier copies
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)


def test_the_host_memory_check_counts_full_attention_layers_and_refuses_a_tier_past_the_available_memory():
    runner = make_runner()
    config, pool = runner.model.config, runner.pool
    assert host_tier_bytes(config, pool, 4) == runner.host_kv_cache_bytes
    assert check_host_memory(config, pool, torch.float32, None) == runner.host_kv_cache_bytes
    per_block = runner.host_kv_cache_bytes // NUM_HOST_BLOCKS
    with pytest.raises(HostMemoryError, match=r"for 8 host-tier blocks: .* --num-host-blocks 3 or fewer"):
        check_host_memory(config, pool, torch.float32, 3 * per_block + 1)


def test_available_host_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    250 kB\n")
    assert available_host_bytes(str(meminfo)) == 250 * 1024
    assert available_host_bytes(str(tmp_path / "missing")) is None


def test_consecutive_host_blocks_cross_as_one_run():
    assert consecutive_runs([]) == []
    assert consecutive_runs([4, 5, 6, 2, 3, 9, 8]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1), (6, 8, 1)]
