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
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from gpu_worker.host_tier import (
    CopyChunk, HostKVBuffer, OffloadQueue, consecutive_runs, copy_plan, copy_runs, pin_host_memory,
)  # fmt: skip
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


def fake_host(tmp_path, meminfo_kib: int | None, proc_cgroup: str, files: dict[str, str]) -> dict[str, str]:
    """A /proc/meminfo, a /proc/self/cgroup and cgroup files under a fake /sys/fs/cgroup; the paths to read."""
    tmp_path.mkdir(exist_ok=True)
    paths = {"meminfo": tmp_path / "meminfo", "proc_cgroup": tmp_path / "cgroup", "cgroup_root": tmp_path / "fs"}
    if meminfo_kib is not None:
        paths["meminfo"].write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {meminfo_kib} kB\n")
    paths["proc_cgroup"].write_text(proc_cgroup)
    for name, text in files.items():
        path = paths["cgroup_root"] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {name: str(path) for name, path in paths.items()}


def test_available_host_memory_is_meminfo_where_no_cgroup_limits_it(tmp_path):
    assert available_host_bytes(**fake_host(tmp_path, 250, "0::/\n", {"memory.max": "max\n"})) == 250 * 1024
    assert available_host_bytes(**fake_host(tmp_path / "none", None, "", {})) is None


def test_a_cgroup_v2_limit_and_its_ancestors_bound_the_available_host_memory(tmp_path):
    """The worker's cgroup leaves 700 + 100 reclaimable bytes; its parent's limit leaves 500: 500."""
    files = {
        "kube/pod/memory.max": "2000\n", "kube/pod/memory.current": "1300\n",
        "kube/pod/memory.stat": "anon 1000\ninactive_file 100\nactive_file 200\n",
        "kube/memory.max": "10000\n", "kube/memory.current": "9500\n",
        "memory.max": "max\n",
    }  # fmt: skip
    paths = fake_host(tmp_path, 4_000_000, "0::/kube/pod\n", files)
    assert available_host_bytes(**paths) == 500
    files["kube/memory.max"] = "max\n"
    assert available_host_bytes(**fake_host(tmp_path / "b", 4_000_000, "0::/kube/pod\n", files)) == 800
    # In a cgroup namespace the process's own cgroup is the mount's root: its path is not there.
    root_only = {"memory.max": "3000\n", "memory.current": "1000\n"}
    assert available_host_bytes(**fake_host(tmp_path / "c", 4_000_000, "0::/elsewhere\n", root_only)) == 2000


def test_a_cgroup_v1_memory_limit_bounds_the_available_host_memory(tmp_path):
    proc_cgroup = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    files = {
        "memory/docker/abc/memory.limit_in_bytes": "4096\n", "memory/docker/abc/memory.usage_in_bytes": "1024\n",
        "memory/docker/abc/memory.stat": "cache 600\ntotal_inactive_file 24\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5000\n",
    }  # fmt: skip
    assert available_host_bytes(**fake_host(tmp_path, 4_000_000, proc_cgroup, files)) == 3096
    assert available_host_bytes(**fake_host(tmp_path / "b", 1, proc_cgroup, files)) == 1024  # meminfo is lower


def test_consecutive_host_blocks_cross_as_one_run():
    assert consecutive_runs([]) == []
    assert consecutive_runs([4, 5, 6, 2, 3, 9, 8]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1), (6, 8, 1)]


def test_a_batch_moves_in_chunks_of_runs():
    assert copy_plan([], 4) == []
    assert copy_plan([0, 1, 2, 3, 10, 12, 13], 4) == [
        CopyChunk(0, 4, [(0, 0, 4)]), CopyChunk(4, 7, [(0, 10, 1), (1, 12, 2)])
    ]  # fmt: skip
    # A run longer than a chunk is split at the chunk's end; scattered ids are one run each.
    assert copy_plan([5, 6, 7, 8, 9, 2, 40, 41], 3) == [
        CopyChunk(0, 3, [(0, 5, 3)]), CopyChunk(3, 6, [(0, 8, 2), (2, 2, 1)]), CopyChunk(6, 8, [(0, 40, 2)])
    ]  # fmt: skip


class OpLog(TorchDispatchMode):
    """Every aten op a block of code runs, with the bytes of each tensor it creates (an output that shares no
    storage with the op's arguments, `out=` included) and the number of tensors it copies (foreach ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, int]] = []
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.created.append((str(func), t.untyped_storage().nbytes()))
        self.calls.append((str(func), len(args[0]) if isinstance(args[0], (list, tuple)) else 1))
        return out


def tier_sides(num_blocks: int, num_host_blocks: int, chunk_blocks: int):
    """Three layers of random device caches, a host buffer of random blocks whose device buffer holds two slots
    of `chunk_blocks` blocks, and their contents before any copy."""
    shape, num_layers = (2, 4, 2, 8), 3
    generator = torch.Generator().manual_seed(3)
    caches = [torch.randn((num_blocks, *shape), generator=generator) for _ in range(num_layers)]
    block_bytes = num_layers * 2 * 4 * 2 * 8 * 4
    host = HostKVBuffer(num_host_blocks, num_layers, shape, torch.float32, CPU, 2 * chunk_blocks * block_bytes)
    host.blocks.copy_(torch.randn(host.blocks.shape, generator=generator))
    return caches, host, [cache.clone() for cache in caches], host.blocks.clone(), block_bytes


def test_a_large_batch_moves_exactly_in_chunks_through_a_bounded_temporary():
    caches, host, device_before, host_before, block_bytes = tier_sides(80, 64, chunk_blocks=4)
    assert host.chunk_blocks == 4 and host.device_buffer_bytes == 0  # a CPU has no device buffer
    rng = random.Random(4)
    offloads = sorted(zip(rng.sample(range(80), 40), [*range(20, 30), *rng.sample(range(30, 64), 30)]),
                      key=lambda pair: pair[1])  # fmt: skip
    onloads = sorted(zip(rng.sample(range(80), 40), rng.sample(range(64), 40)), key=lambda pair: pair[1])

    with OpLog() as log:
        for pairs, move in ((offloads, host.offload), (onloads, host.onload)):
            move(caches, torch.tensor([d for d, _ in pairs]), [h for _, h in pairs])

    # Nothing scales with the batch: on a CPU, one layer's blocks of one chunk at a time (on CUDA the slots).
    layer_block_bytes = block_bytes // len(caches)
    assert max(num_bytes for _, num_bytes in log.created) == host.chunk_blocks * layer_block_bytes, log.created
    expected_host = host_before.clone()
    for device_block_id, host_block_id in offloads:
        expected_host[host_block_id] = torch.stack([cache[device_block_id] for cache in device_before])
    expected_device = [cache.clone() for cache in device_before]
    for device_block_id, host_block_id in onloads:
        for layer, cache in enumerate(expected_device):
            cache[device_block_id] = expected_host[host_block_id, layer]
    assert torch.equal(host.blocks, expected_host)
    assert all(torch.equal(got, want) for got, want in zip(caches, expected_device))


def test_each_chunk_crosses_in_one_call_one_transfer_per_run():
    """The CUDA path's transfers, on host tensors: host blocks 0..3 in one copy; 10, then 12..13, in two."""
    host_blocks = torch.randn((16, 3, 2, 4, 2, 8))
    rows = torch.randn((4, 3, 2, 4, 2, 8))
    [first_chunk, second_chunk] = copy_plan([0, 1, 2, 3, 10, 12, 13], 4)
    for chunk, ids in ((first_chunk, [0, 1, 2, 3]), (second_chunk, [10, 12, 13])):
        before = host_blocks.clone()
        with OpLog() as log:
            copy_runs(host_blocks, rows[: len(ids)], chunk.runs, to_host=True)
        assert [count for op, count in log.calls if "_foreach_copy_" in op] == [len(chunk.runs)]
        assert torch.equal(host_blocks[ids], rows[: len(ids)])
        untouched = [block for block in range(16) if block not in ids]
        assert torch.equal(host_blocks[untouched], before[untouched])
        loaded = torch.zeros_like(rows[: len(ids)])
        copy_runs(host_blocks, loaded, chunk.runs, to_host=False)
        assert torch.equal(loaded, host_blocks[ids])


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_an_onload_waits_for_the_last_running_offload_of_the_blocks_it_reads_only():
    queue = OffloadQueue()
    first, second, third = FakeEvent(), FakeEvent(), FakeEvent()
    queue.push(first, [1, 2])
    queue.push(second, [3])
    queue.push(third, [2, 7])
    assert queue.last_writer([5, 6]) is None  # reads nothing an offload still writes
    assert queue.last_writer([3]) is second
    assert queue.last_writer([1]) is first
    assert queue.last_writer([1, 2]) is third  # the later one: waiting for it waits for both
    first.done = True
    assert queue.last_writer([1]) is None and len(queue) == 2  # retired
    second.done = third.done = True
    queue.retire()
    assert len(queue) == 0


def test_finished_offloads_are_retired_as_new_ones_arrive():
    """Under steady pressure the queue holds the batches still running, not every block ever offloaded."""
    queue = OffloadQueue()
    events = []
    for step in range(100):
        if events:
            events[-1].done = True  # each batch finishes during the next step
        events.append(FakeEvent())
        queue.push(events[-1], [step])
    assert len(queue) == 1 and queue.last_writer([98]) is None and queue.last_writer([99]) is events[-1]


class FakeCudart:
    """torch.cuda.cudart()'s page-locking calls, recorded."""

    class cudaError:  # noqa: N801 - the binding's name
        success = 0

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.calls: list[tuple] = []

    def cudaHostRegister(self, address: int, num_bytes: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", address, num_bytes, flags))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address))
        return 0

    def cudaGetErrorString(self, error: int) -> str:  # noqa: N802
        return "out of memory"


def test_the_host_buffer_is_pinned_at_its_exact_size(monkeypatch):
    """A tier of 3 blocks of 2 layers of 20,480 bytes: 122,880 bytes locked, not the 131,072 of the power of two
    a pinned allocation rounds up to."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    blocks = torch.empty((3, 2, 2, 16, 4, 40), dtype=torch.float32)
    unpin = pin_host_memory(blocks)
    assert cudart.calls == [("register", blocks.data_ptr(), 122_880, 0)]
    unpin()
    assert cudart.calls[-1] == ("unregister", blocks.data_ptr())

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(error=2))
    with pytest.raises(RuntimeError, match="could not page-lock 122880 bytes of host memory: out of memory"):
        pin_host_memory(blocks)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_on_cuda_the_pinned_buffer_is_the_size_the_host_memory_check_counts():
    runner = make_runner(device=torch.device("cuda"))
    blocks = runner.host_kv.blocks
    assert blocks.is_pinned() and blocks.untyped_storage().nbytes() == runner.host_kv_cache_bytes
    assert runner.host_kv_cache_bytes == host_tier_bytes(runner.model.config, runner.pool, 4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_on_cuda_a_large_batch_takes_no_device_memory_beyond_the_buffer():
    shape, num_layers, num_blocks = (2, 16, 8, 128), 8, 256  # 1 MiB per block over the layers
    cuda = torch.device("cuda")
    caches = [torch.randn((num_blocks, *shape), device=cuda) for _ in range(num_layers)]
    before = [cache.cpu() for cache in caches]
    host = HostKVBuffer(num_blocks, num_layers, shape, torch.float32, cuda, device_buffer_bytes=32 << 20)
    assert host.chunk_blocks == 16
    ids = list(range(0, num_blocks, 2)) + list(range(1, num_blocks, 2))  # device blocks, to host blocks 0..255
    device_ids = torch.tensor(ids, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated()
    host.offload(caches, device_ids, range(num_blocks))
    host.onload(caches, device_ids.flip(0), range(num_blocks))  # host block r into device block ids[255 - r]
    host.synchronize()
    assert torch.cuda.max_memory_allocated() - allocated < 1 << 20  # the old snapshot took 2 x 256 MiB
    for layer in range(num_layers):
        assert torch.equal(host.blocks[:, layer], before[layer][ids])
        assert torch.equal(caches[layer][ids[::-1]].cpu(), before[layer][ids])
