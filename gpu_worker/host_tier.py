"""The worker's half of the host-memory tier: a KV buffer in host memory and the copies the manager orders.

The manager owns the tier's accounting (which host block holds what, when a
block moves); the worker only moves bytes. A step's delta carries two lists
of `TierCopy` (device_block_id, host_block_id), applied before the step's
forward pass and before its copy-on-write copies:

    offloads   host[host_block_id]   = device[device_block_id]   every tier layer
    onloads    device[device_block_id] = host[host_block_id]     every tier layer

Offloads go first: an offload reads a device block the manager evicted, and
the same step may hand that block out again as an onload or copy
destination. Onloads then see the offloads' writes, so an onload may read a
host block offloaded in the same step.

The tier layers are those of the full-attention group (the manager puts no
other kind of group behind the tier). The buffer is one tensor,
`[num_host_blocks, num_tier_layers, 2, block_size, num_kv_heads, head_dim]`,
so one host block, over every layer, is one contiguous region, and so is a
run of consecutive host blocks: on CUDA each run crosses as one transfer.

A batch of copies moves a chunk of at most `chunk_blocks` blocks at a time
(`copy_plan`), so what it holds besides the two sides is bounded whatever
the batch's size.

On a CPU both sides are RAM and there are no streams: per chunk and tier
layer, one gather of the chunk's blocks from one side and one scatter into
the other, through a temporary of that layer's blocks of the chunk (small
enough to stay in the CPU's caches); each call returns once its bytes have
moved.

On CUDA every copy passes through a fixed-size device buffer (two slots of
`chunk_blocks` blocks, every tier layer; allocated with the host buffer, so
a step never allocates device memory for its copies):

    offload   gather the chunk's device blocks into a slot (one index_select per layer),
              then slot -> host, one transfer per run of consecutive host blocks
    onload    host -> slot, one transfer per run, then scatter the slot into the
              device blocks (one index_copy_ per layer)

The caller sorts a batch's copies by host block, so the runs are as long as
the ids allow, and all the transfers of a chunk go in one call (`copy_runs`:
one loop in C++ instead of one Python call per run). A run is the only unit
one DMA can move: a scattered host block is one transfer, since gathering
scattered blocks on the host first would cost host memory bandwidth of the
order of the link's, on the one thread that queues the step.

On CUDA the host buffer is pinned, every transfer is DMA, and offloads
overlap the forward pass:

- An offload gathers the evicted blocks into a slot on the compute stream.
  Everything the step queues after it (onloads and copy-on-write copies
  into the same device blocks, the forward pass's stores) runs after the
  gather, so the device blocks are free to reuse at once. The slot's
  device-to-host transfers then run on a side stream, concurrently with the
  forward pass, and an event marks the end of each slot's and each batch's.
- The compute stream waits for a slot's last transfers before it writes the
  slot again (a wait on the device, not on the host): chunks alternate
  between the two slots, so the gather of one overlaps the transfers of the
  other. A batch larger than two chunks therefore holds the compute stream
  back by the transfers of all but its last two chunks; it still completes
  within the step that evicts.
- Batches of offloads whose transfers may still run are kept in a queue of
  (event, host blocks written), retired once their event has completed. An
  onload makes the compute stream wait for the last queued batch that writes
  a host block it reads, and for nothing else; its host-to-device transfers
  then run on the compute stream, ahead of the forward pass that reads
  their destinations.
- The side stream waits for the compute stream before each chunk of
  offloads, so an offload never overwrites a host block that an earlier,
  queued onload has yet to read.

So the worker may acknowledge a step as soon as its copies are queued: the
manager may then reuse the device and host blocks they name, and every later
copy that touches them is ordered after them on the device. Nothing reads
the host buffer on the host, except `synchronize()`'s callers.

The host buffer is allocated as ordinary memory and then page-locked at its
exact size (`pin_host_memory`): torch's pinned allocations round up to a
power of two, which for a large tier would lock up to twice the memory the
host-memory check counted.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import torch

DEVICE_BUFFER_BYTES = 256 << 20  # both slots of the device buffer together, at most


def check_tier_copies(
    field: str, pairs: Sequence[tuple[int, int]], num_device_blocks: int, num_host_blocks: int, destination: str
) -> None:
    """Raise ValueError, naming the field and the first offending copy, unless `pairs` can be applied as a batch.

    pairs: (device_block_id, host_block_id). Every device id must lie in
    [0, num_device_blocks), every host id in [0, num_host_blocks), and no two
    copies may write one block: `destination` ("host" for offloads,
    "device" for onloads) names the side that must not repeat. Mutates nothing.
    """
    written: set[int] = set()
    for index, (device_block_id, host_block_id) in enumerate(pairs):
        if not 0 <= device_block_id < num_device_blocks:
            raise ValueError(
                f"{field}[{index}].device_block_id is {device_block_id}, "
                f"the device pool has blocks 0..{num_device_blocks - 1}"
            )
        if not 0 <= host_block_id < num_host_blocks:
            supported = f"blocks 0..{num_host_blocks - 1}" if num_host_blocks else "no blocks (no host tier)"
            raise ValueError(f"{field}[{index}].host_block_id is {host_block_id}, the host tier has {supported}")
        target = host_block_id if destination == "host" else device_block_id
        if target in written:
            raise ValueError(
                f"{field}[{index}] writes {destination} block {target}, which an earlier copy of {field} writes too: "
                f"a step writes each {destination} block at most once"
            )
        written.add(target)


def consecutive_runs(host_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(row, first host block, count) per maximal run of consecutive ids: rows row..row+count-1 of a step's
    copies touch host blocks first..first+count-1, one contiguous region, so one transfer moves them."""
    runs: list[tuple[int, int, int]] = []
    for row, host_block_id in enumerate(host_block_ids):
        if runs and runs[-1][1] + runs[-1][2] == host_block_id:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((row, host_block_id, 1))
    return runs


class CopyChunk(NamedTuple):
    """Rows start..stop-1 of a batch of copies, which pass through one slot of the device buffer together."""

    start: int
    stop: int
    runs: list[tuple[int, int, int]]  # (row within the chunk, first host block, count): one transfer each


def copy_plan(host_block_ids: Sequence[int], chunk_blocks: int) -> list[CopyChunk]:
    """The chunks of at most `chunk_blocks` rows a batch of copies moves in, in row order, each with its runs."""
    chunks = []
    for start in range(0, len(host_block_ids), chunk_blocks):
        stop = min(start + chunk_blocks, len(host_block_ids))
        chunks.append(CopyChunk(start, stop, consecutive_runs(host_block_ids[start:stop])))
    return chunks


class Event(Protocol):
    """What `OffloadQueue` needs of a `torch.cuda.Event`."""

    def query(self) -> bool: ...


class OffloadQueue:
    """Batches of offloads whose device-to-host transfers may still run: (event at their end, host blocks written).

    The events complete in the order pushed (they are recorded on one stream),
    so finished batches are retired from the front.
    """

    def __init__(self) -> None:
        self._batches: deque[tuple[Event, frozenset[int]]] = deque()

    def __len__(self) -> int:
        return len(self._batches)

    def push(self, event: Event, host_block_ids: Sequence[int]) -> None:
        self.retire()
        self._batches.append((event, frozenset(host_block_ids)))

    def retire(self) -> None:
        """Drop the batches whose transfers are done."""
        while self._batches and self._batches[0][0].query():
            self._batches.popleft()

    def last_writer(self, host_block_ids: Sequence[int]) -> Event | None:
        """The event of the last batch still running that writes one of `host_block_ids`; None when none does.

        Waiting for it waits for every earlier batch too, so a reader of those
        blocks waits for that event alone.
        """
        self.retire()
        for event, written in reversed(self._batches):
            if not written.isdisjoint(host_block_ids):
                return event
        return None


def pin_host_memory(tensor: torch.Tensor) -> Callable[[], None]:
    """Page-lock the host memory of contiguous `tensor`, exactly its bytes; returns the call that unlocks it.

    Unlike `pin_memory=True`, which rounds an allocation up to a power of two,
    this locks only the tensor's own pages. The returned call holds `tensor`,
    so the memory stays allocated until it is unlocked. Raises RuntimeError
    when CUDA refuses (too little lockable memory, most likely).
    """
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    cudart = torch.cuda.cudart()
    address, num_bytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    error = cudart.cudaHostRegister(address, num_bytes, 0)
    if error != cudart.cudaError.success:
        raise RuntimeError(f"could not page-lock {num_bytes} bytes of host memory: {cudart.cudaGetErrorString(error)}")

    def unpin() -> None:
        cudart.cudaHostUnregister(tensor.data_ptr())

    return unpin


class HostKVBuffer:
    """The host tier's blocks for the tier layers; copies to and from the device caches of those layers."""

    def __init__(
        self,
        num_host_blocks: int,
        num_layers: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        device_buffer_bytes: int = DEVICE_BUFFER_BYTES,
    ) -> None:
        """block_shape: one layer's block, `(2, block_size, num_kv_heads, head_dim)`; device: the caches' device.

        device_buffer_bytes: the most the device buffer may take (two slots,
        each of at least one block and at most `num_host_blocks`); on a CPU,
        which has none, it sizes the chunks all the same.
        """
        self.device = device
        on_cuda = device.type == "cuda"
        shape = (num_host_blocks, num_layers, *block_shape)
        if on_cuda and num_host_blocks:
            self.blocks = torch.empty(shape, dtype=dtype)
            weakref.finalize(self, pin_host_memory(self.blocks))  # unlocked, then freed, with the buffer
        else:
            self.blocks = torch.zeros(shape, dtype=dtype)
        block_bytes = self.blocks[0].numel() * self.blocks.element_size() if num_host_blocks else 0
        self.chunk_blocks = min(num_host_blocks, max(1, device_buffer_bytes // max(2 * block_bytes, 1)))
        # CUDA only (None on a CPU): the device buffer's two slots, and the next one to use; the offloads' side
        # stream; per slot, the end of the last transfers that read it; the offloads whose transfers may still run.
        self._offload_stream = torch.cuda.Stream(device) if on_cuda and num_host_blocks else None
        self._slots = self._slot_read = None
        if self._offload_stream is not None:
            self._slots = torch.empty((2, self.chunk_blocks, *shape[1:]), dtype=dtype, device=device)
            self._slot_read = [torch.cuda.Event(), torch.cuda.Event()]
        self._next_slot = 0
        self.offloads_running = OffloadQueue()

    @property
    def num_host_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    @property
    def device_buffer_bytes(self) -> int:
        """Bytes of the device buffer the copies pass through (0 on a CPU, where there is none)."""
        return 0 if self._slots is None else self._slots.numel() * self._slots.element_size()

    def offload(
        self, caches: Sequence[torch.Tensor], device_block_ids: torch.Tensor, host_block_ids: Sequence[int]
    ) -> None:
        """host[host_block_ids[i]] = every cache's block device_block_ids[i].

        caches: the tier layers' device caches, in the buffer's layer order.
        device_block_ids: int64 on the caches' device; host_block_ids distinct
        (sorted, for the fewest transfers). Mutates the named host blocks only.
        Checked by the caller (`check_tier_copies`). On CUDA it returns once
        the transfers are queued (see the module docstring for what orders them).
        """
        if not host_block_ids:
            return
        side = self._offload_stream
        if side is None:
            for ids, host_ids in self._cpu_chunks(device_block_ids, host_block_ids):
                for layer, cache in enumerate(caches):
                    self.blocks[:, layer].index_copy_(0, host_ids, cache.index_select(0, ids))
            return
        compute = torch.cuda.current_stream(self.device)
        for chunk in copy_plan(host_block_ids, self.chunk_blocks):
            slot, staged = self._take_slot(compute)
            ids = device_block_ids[chunk.start : chunk.stop]
            for layer, cache in enumerate(caches):
                torch.index_select(cache, 0, ids, out=staged[: len(ids), layer])
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                copy_runs(self.blocks, staged[: len(ids)], chunk.runs, to_host=True)
            self._slot_read[slot].record(side)
        done = torch.cuda.Event()
        done.record(side)
        self.offloads_running.push(done, host_block_ids)

    def onload(
        self, caches: Sequence[torch.Tensor], device_block_ids: torch.Tensor, host_block_ids: Sequence[int]
    ) -> None:
        """Every cache's block device_block_ids[i] = host[host_block_ids[i]].

        device_block_ids: int64 on the caches' device, distinct. Mutates the
        named device blocks only. On CUDA the copies are queued on the
        current stream, after any offload still writing the host blocks read.
        """
        if not host_block_ids:
            return
        if self._offload_stream is None:
            for ids, host_ids in self._cpu_chunks(device_block_ids, host_block_ids):
                for layer, cache in enumerate(caches):
                    cache.index_copy_(0, ids, self.blocks[:, layer].index_select(0, host_ids))
            return
        compute = torch.cuda.current_stream(self.device)
        writer = self.offloads_running.last_writer(host_block_ids)
        if writer is not None:
            compute.wait_event(writer)
        for chunk in copy_plan(host_block_ids, self.chunk_blocks):
            _, staged = self._take_slot(compute)
            ids = device_block_ids[chunk.start : chunk.stop]
            copy_runs(self.blocks, staged[: len(ids)], chunk.runs, to_host=False)
            for layer, cache in enumerate(caches):
                cache.index_copy_(0, ids, staged[: len(ids), layer])

    def synchronize(self) -> None:
        """Return once every queued copy to or from the host buffer is done (then it may be read on the host)."""
        if self._offload_stream is not None:
            torch.cuda.synchronize(self.device)
            self.offloads_running.retire()

    def _take_slot(self, compute: torch.cuda.Stream) -> tuple[int, torch.Tensor]:
        """The next slot of the device buffer, once (on the compute stream) its last reader is done."""
        slot = self._next_slot
        self._next_slot = 1 - slot
        compute.wait_event(self._slot_read[slot])  # a no-op until the event is first recorded
        return slot, self._slots[slot]

    def _cpu_chunks(
        self, device_block_ids: torch.Tensor, host_block_ids: Sequence[int]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per chunk of a CPU's batch: its device ids and its host ids (int64)."""
        for start in range(0, len(host_block_ids), self.chunk_blocks):
            stop = start + self.chunk_blocks
            yield device_block_ids[start:stop], torch.tensor(host_block_ids[start:stop], dtype=torch.int64)


def copy_runs(
    host_blocks: torch.Tensor, rows: torch.Tensor, runs: Sequence[tuple[int, int, int]], to_host: bool
) -> None:
    """For each run (row, first, count): host_blocks[first:first+count] <-> rows[row:row+count], one copy each,
    queued by one call (non-blocking: on CUDA each is one DMA transfer on the current stream).

    runs: `consecutive_runs` of the host block ids of `rows`' blocks, in row order (they cover every row).
    """
    host = [host_blocks[first : first + count] for _, first, count in runs]
    device = rows.split([count for _, _, count in runs])
    if to_host:
        torch._foreach_copy_(host, device, non_blocking=True)
    else:
        torch._foreach_copy_(list(device), host, non_blocking=True)
