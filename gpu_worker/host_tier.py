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

On a CPU both sides are RAM and each copy returns once it is done: per
layer, one gather of the step's blocks and one scatter into the other side,
through a temporary of one layer's blocks (small enough to stay in the
CPU's caches for typical steps).

On CUDA the buffer is pinned, every transfer is DMA, and offloads overlap
the forward pass:

- An offload first snapshots the evicted blocks into a device tensor, on the
  compute stream. Everything the step queues after it (onloads and
  copy-on-write copies into the same device blocks, the forward pass's
  stores) runs after the snapshot, so the device blocks are free to reuse
  at once. The device-to-host transfers of the snapshot then run on a side
  stream, concurrently with the forward pass, and an event marks their end.
- An onload that reads a host block an offload may still be writing makes
  the compute stream wait for that event (a wait on the device, not on the
  host); its host-to-device transfers then run on the compute stream, ahead
  of the forward pass that reads their destinations.
- The side stream waits for the compute stream before each batch of
  offloads, so an offload never overwrites a host block that an earlier,
  queued onload has yet to read.

So the worker may acknowledge a step as soon as its copies are queued: the
manager may then reuse the device and host blocks they name, and every later
copy that touches them is ordered after them on the device. Nothing reads
the host buffer on the host, except `synchronize()`'s callers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


class HostKVBuffer:
    """The host tier's blocks for the tier layers; copies to and from the device caches of those layers."""

    def __init__(
        self,
        num_host_blocks: int,
        num_layers: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """block_shape: one layer's block, `(2, block_size, num_kv_heads, head_dim)`; device: the caches' device."""
        self.device = device
        on_cuda = device.type == "cuda"
        self.blocks = torch.zeros((num_host_blocks, num_layers, *block_shape), dtype=dtype, pin_memory=on_cuda)
        # CUDA only: the offloads' side stream, the end of the last batch it queued, and
        # the host blocks written since that end was last seen (None / empty on a CPU).
        self._offload_stream = torch.cuda.Stream(device) if on_cuda and num_host_blocks else None
        self._offloaded = torch.cuda.Event() if self._offload_stream is not None else None
        self._offloading: set[int] = set()

    @property
    def num_host_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def offload(
        self, caches: Sequence[torch.Tensor], device_block_ids: torch.Tensor, host_block_ids: Sequence[int]
    ) -> None:
        """host[host_block_ids[i]] = every cache's block device_block_ids[i].

        caches: the tier layers' device caches, in the buffer's layer order.
        device_block_ids: int64 on the caches' device; host_block_ids distinct.
        Mutates the named host blocks only. Checked by the caller
        (`check_tier_copies`). On CUDA it returns once the transfers are
        queued (see the module docstring for what orders them).
        """
        if not host_block_ids:
            return
        if self._offload_stream is None:
            host_ids = torch.tensor(host_block_ids, dtype=torch.int64)
            for layer, cache in enumerate(caches):
                self.blocks[:, layer].index_copy_(0, host_ids, cache.index_select(0, device_block_ids))
            return
        snapshot = torch.stack([cache.index_select(0, device_block_ids) for cache in caches], dim=1)
        self._offload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._offload_stream):
            for row, first, count in consecutive_runs(host_block_ids):
                self.blocks[first : first + count].copy_(snapshot[row : row + count], non_blocking=True)
        snapshot.record_stream(self._offload_stream)  # kept from reuse until its transfers are done
        self._offloaded.record(self._offload_stream)
        self._offloading.update(host_block_ids)

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
            host_ids = torch.tensor(host_block_ids, dtype=torch.int64)
            for layer, cache in enumerate(caches):
                cache.index_copy_(0, device_block_ids, self.blocks[:, layer].index_select(0, host_ids))
            return
        compute = torch.cuda.current_stream(self.device)
        if self._offloading:
            if self._offloaded.query():
                self._offloading.clear()
            elif not self._offloading.isdisjoint(host_block_ids):
                compute.wait_event(self._offloaded)
        loaded = torch.empty((len(host_block_ids), *self.blocks.shape[1:]), dtype=self.blocks.dtype, device=self.device)
        for row, first, count in consecutive_runs(host_block_ids):
            loaded[row : row + count].copy_(self.blocks[first : first + count], non_blocking=True)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, device_block_ids, loaded[:, layer])

    def synchronize(self) -> None:
        """Return once every queued copy to or from the host buffer is done (then it may be read on the host)."""
        if self._offload_stream is not None:
            torch.cuda.synchronize(self.device)
