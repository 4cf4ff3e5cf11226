"""Does the model with its KV cache fit in a device's free memory? The arithmetic, and the start-up check.

The rule: the weights, the KV cache (`num_blocks` blocks in every layer) and a
headroom must fit in the memory the device reports free before the worker
allocates anything. The headroom is for what is not sized up front: a step's
activations and logits, the caching allocator's fragmentation, the library
workspaces of cuBLAS and Triton. It is 10% of the device's total memory, and
at least 1 GiB. A worker sharing its GPU sees what the workers already running
there took as used, so the one that does not fit is refused at start-up; two
that check at the same moment can both pass, so start them one after the other.

`memory_budget` is pure arithmetic over given (free, total) figures;
`check_device_memory` asks the device for them, on CUDA only.

The host tier's buffer (`num_host_blocks` blocks of the full-attention
layers) lives in host memory, pinned on CUDA, so it is no part of the device
budget (its copies pass through a device buffer of at most 256 MiB,
`gpu_worker.host_tier`, which the headroom covers); `check_host_memory`
refuses one larger than the memory available to the worker, since pinned
pages cannot be swapped out: the host's MemAvailable, or less where the
worker's cgroup (a container's memory limit, v1 or v2) leaves it less.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.runner import PoolShape, assign_layers
from gpu_worker.weights import layer_shapes

HEADROOM_FRACTION = 0.10  # of the device's total memory
MIN_HEADROOM_BYTES = 1 << 30
MIN_NUM_BLOCKS = 2  # the manager's smallest pool: the null block and one more


class DeviceMemoryError(ValueError):
    """The model and the KV cache the manager asks for do not fit in the device's free memory."""


class HostMemoryError(ValueError):
    """The host tier the manager asks for does not fit in the host's available memory."""


def weight_bytes(config: ModelConfig, element_size: int) -> int:
    """Bytes of the decoder's weights, `element_size` bytes per element, the config's biases and q/k norms included.

    A tied lm_head is the embedding.
    """
    per_layer = sum(math.prod(shape) for shape in layer_shapes(config).values())
    vocab = config.vocab_size * config.hidden_size
    lm_head = 0 if config.tie_word_embeddings else vocab
    return (config.num_layers * per_layer + vocab + lm_head + config.hidden_size) * element_size


def kv_block_bytes(config: ModelConfig, pool: PoolShape, element_size: int) -> int:
    """Bytes one block id takes over every layer's cache: K and V of its group's `block_size` slots.

    Raises ValueError, as the runner does, when the model's layers and the pool's groups do not match.
    """
    block_sizes = [pool.groups[group].block_size for group in assign_layers(config, pool.groups)]
    return sum(2 * block_size * config.num_kv_heads * config.head_dim for block_size in block_sizes) * element_size


def host_tier_bytes(config: ModelConfig, pool: PoolShape, element_size: int) -> int:
    """Bytes of the host tier's buffer: K and V of `num_host_blocks` blocks in every full-attention layer."""
    block_sizes = [
        pool.groups[group].block_size
        for group in assign_layers(config, pool.groups)
        if pool.groups[group].sliding_window == 0
    ]
    per_block = sum(2 * block_size * config.num_kv_heads * config.head_dim for block_size in block_sizes)
    return pool.num_host_blocks * per_block * element_size


def headroom_bytes(total_bytes: int) -> int:
    """What the rule keeps free for activations and workspaces on a device of `total_bytes`."""
    return max(MIN_HEADROOM_BYTES, int(total_bytes * HEADROOM_FRACTION))


def _gib(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / 2**30:.2f} GiB)"


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """The bytes a worker needs against what the device has free; every figure in bytes."""

    num_blocks: int
    block_bytes: int  # one block id, over every layer
    weight_bytes: int
    headroom_bytes: int
    free_bytes: int
    total_bytes: int

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def needed_bytes(self) -> int:
        return self.kv_cache_bytes + self.weight_bytes + self.headroom_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes

    @property
    def max_num_blocks(self) -> int:
        """The most blocks whose cache fits beside the weights and the headroom; 0 when not even those fit."""
        return max(0, (self.free_bytes - self.weight_bytes - self.headroom_bytes) // self.block_bytes)

    def refusal(self, device: str) -> str:
        """One line: what is needed, what is free, and the `--num-blocks` of the manager that would fit."""
        if self.max_num_blocks >= MIN_NUM_BLOCKS:
            advice = f"start the manager with --num-blocks {self.max_num_blocks} or fewer"
        else:
            advice = (
                f"no --num-blocks fits: the weights and the headroom alone need "
                f"{_gib(self.weight_bytes + self.headroom_bytes)}; free the device or run a smaller model or --dtype"
            )
        return (
            f"{device} has too little free memory for {self.num_blocks} KV blocks: needed {_gib(self.needed_bytes)} = "
            f"KV cache {self.kv_cache_bytes} + weights {self.weight_bytes} + headroom {self.headroom_bytes} bytes; "
            f"free {_gib(self.free_bytes)} of {self.total_bytes} bytes; {advice}"
        )


def memory_budget(
    config: ModelConfig, pool: PoolShape, dtype: torch.dtype, free_bytes: int, total_bytes: int
) -> MemoryBudget:
    """The budget of `config`'s weights and `pool`'s KV cache in `dtype` on a device with the given memory."""
    return MemoryBudget(
        num_blocks=pool.num_blocks,
        block_bytes=kv_block_bytes(config, pool, dtype.itemsize),
        weight_bytes=weight_bytes(config, dtype.itemsize),
        headroom_bytes=headroom_bytes(total_bytes),
        free_bytes=free_bytes,
        total_bytes=total_bytes,
    )


def check_device_memory(
    config: ModelConfig, pool: PoolShape, dtype: torch.dtype, device: torch.device
) -> MemoryBudget | None:
    """On a CUDA device, the budget against `torch.cuda.mem_get_info`; None on a CPU, which is not checked.

    Call it before allocating weights or cache. Raises DeviceMemoryError (its message one line) when they do not fit.
    """
    if device.type != "cuda":
        return None
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    budget = memory_budget(config, pool, dtype, free_bytes, total_bytes)
    if not budget.fits:
        raise DeviceMemoryError(budget.refusal(str(device)))
    return budget


def available_host_bytes(
    meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """The host memory this process may still take: the lower of MemAvailable and what its cgroups' limits leave
    (`cgroup_available_bytes`); None where neither is known."""
    known = [n for n in (_mem_available(meminfo), cgroup_available_bytes(cgroup_root, proc_cgroup)) if n is not None]
    return min(known, default=None)


def _mem_available(meminfo: str) -> int | None:
    """The host's MemAvailable in bytes; None where the kernel does not report it."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# Per cgroup version: the limit's file, the usage's file, and the inactive file pages' key in memory.stat.
_CGROUP_MEMORY_FILES = {
    2: ("memory.max", "memory.current", "inactive_file"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def cgroup_available_bytes(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The least that the memory limits of this process's cgroup and its ancestors leave it; None where none applies.

    Each limit leaves `limit - usage + inactive file pages` (the page cache the
    kernel reclaims before it refuses memory). The cgroup is read from
    `proc_cgroup` (v2: `0::PATH` under `cgroup_root`; v1: the `memory`
    controller's line, under `cgroup_root/memory`); where PATH is not there (a
    container's cgroup namespace mounts its own cgroup as the root), the root.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    left = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if fields[0] == "0" and fields[1] == "":
            version, mount = 2, Path(cgroup_root)
        elif "memory" in fields[1].split(","):
            version, mount = 1, Path(cgroup_root) / "memory"
        else:
            continue
        directory = mount / fields[2].lstrip("/")
        if not directory.is_dir():
            directory = mount
        while True:
            found = _cgroup_left(directory, *_CGROUP_MEMORY_FILES[version])
            if found is not None:
                left.append(found)
            if directory == mount or directory == directory.parent:
                break
            directory = directory.parent
    return min(left, default=None)


def _cgroup_left(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """What one cgroup's memory limit leaves; None when it has none (or its files cannot be read)."""
    try:
        limit = (directory / limit_file).read_text().strip()
        if limit == "max":
            return None
        left = int(limit) - int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                left += int(value)
    except (OSError, ValueError):
        pass
    return max(0, left)


def check_host_memory(config: ModelConfig, pool: PoolShape, dtype: torch.dtype, available_bytes: int | None) -> int:
    """The host tier's bytes; raises HostMemoryError (one line) when they exceed `available_bytes`.

    available_bytes: the memory available to the worker (`available_host_bytes`); None (unknown) skips the check.
    """
    needed = host_tier_bytes(config, pool, dtype.itemsize)
    if available_bytes is not None and needed > available_bytes:
        per_block = needed // pool.num_host_blocks
        raise HostMemoryError(
            f"the host has too little available memory for {pool.num_host_blocks} host-tier blocks: needed "
            f"{_gib(needed)}, available {_gib(available_bytes)}; start the manager with --num-host-blocks "
            f"{available_bytes // per_block} or fewer"
        )
    return needed
