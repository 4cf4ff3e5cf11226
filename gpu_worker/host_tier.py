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
so one host block, over every layer, is one contiguous region: a direction's
copies are one gather on one side, one transfer, one scatter on the other.
On CUDA the buffer is pinned, so the transfers are DMA, and the copies run on
the current stream, ahead of the forward pass that reads their destinations.

Both directions have finished with the host buffer when `offload` and
`onload` return (an offload waits for its device-to-host transfer; an
onload reads the buffer into a pinned staging tensor of its own before its
transfer is queued), so the step may be acknowledged at once and the
manager may reuse the host blocks it names.

Next step, not done here: run offloads on a side stream that overlaps the
forward pass. An offload reads a block that the same step may overwrite
(as an onload or copy destination, or through the forward pass's own
stores), so overlapping needs a device-side staging copy of the evicted
blocks first, and an event that the host buffer's next reader waits on.
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
        self.blocks = torch.zeros(
            (num_host_blocks, num_layers, *block_shape), dtype=dtype, pin_memory=device.type == "cuda"
        )

    @property
    def num_host_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def offload(
        self, caches: Sequence[torch.Tensor], device_block_ids: torch.Tensor, host_block_ids: Sequence[int]
    ) -> None:
        """host[host_block_ids[i]] = every cache's block device_block_ids[i]; returns once the host buffer holds them.

        caches: the tier layers' device caches, in the buffer's layer order.
        device_block_ids: int64 on the caches' device; host_block_ids distinct.
        Mutates the named host blocks only. Checked by the caller
        (`check_tier_copies`).
        """
        if not host_block_ids:
            return
        gathered = torch.stack([cache.index_select(0, device_block_ids) for cache in caches], dim=1)
        if gathered.device.type != "cpu":
            landed = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            landed.copy_(gathered)  # blocking: the scatter below runs on the host
            gathered = landed
        self.blocks.index_copy_(0, torch.tensor(host_block_ids, dtype=torch.int64), gathered)

    def onload(
        self, caches: Sequence[torch.Tensor], device_block_ids: torch.Tensor, host_block_ids: Sequence[int]
    ) -> None:
        """Every cache's block device_block_ids[i] = host[host_block_ids[i]]; queued on the caches' device.

        device_block_ids: int64 on the caches' device, distinct. Mutates the
        named device blocks only. The host buffer is read before this returns.
        """
        if not host_block_ids:
            return
        host_ids = torch.tensor(host_block_ids, dtype=torch.int64)
        if self.device.type == "cpu":
            loaded = self.blocks.index_select(0, host_ids)
        else:
            # A fresh pinned tensor per call: torch's pinned-memory cache hands it out
            # again only once the transfer that reads it has completed.
            shape = (len(host_block_ids), *self.blocks.shape[1:])
            staged = torch.empty(shape, dtype=self.blocks.dtype, pin_memory=True)
            torch.index_select(self.blocks, 0, host_ids, out=staged)
            loaded = staged.to(self.device, non_blocking=True)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, device_block_ids, loaded[:, layer])
