"""The worker's kernels, each a Triton kernel beside its torch reference.

Every kernel module exports a Triton launcher `<name>` and a torch
reference `<name>_reference` with the same signature; `load(backend, device)`
returns one of the two sets. Shapes (docs/architecture.md, "Kernel shapes and the interpreter"):

- KV cache of one layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
  (index 0 of dim 1 is K, 1 is V).
- Block table of a batch: int32 `[num_reqs, max_blocks]`, row i for request i.
- `query_start_loc`: int32 `[num_reqs + 1]`, request i's tokens are
  `query_start_loc[i]:query_start_loc[i + 1]` of the batch.
- Slot mapping: int64, `-1` where nothing is written. All address math is int64.

Nothing here touches a GPU driver at import time. On a CPU, Triton kernels
run only under `TRITON_INTERPRET=1`, which must be set before the kernel
modules are imported: `load("triton", "cpu")` does it. Triton reads the
variable once, when a kernel module is imported, and builds interpreter or
GPU kernels for the life of the process; `load("triton", "cuda")` refuses
interpreter kernels, which would read device memory on the host.

`layer_ops` holds the decoder layer's RMSNorm (with the residual add) and
RoPE: the fused Triton kernels of `kernels.rms_norm` and `kernels.rotary`,
or their torch references (`kernels.layer_ops`, which the dense pass uses).

`kernels.warmup` compiles, before a worker serves, every kernel variant its
model and pool can launch.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NamedTuple

from kernels.layer_ops import TORCH_LAYER_OPS, LayerOps

BACKENDS = ("torch", "triton")
_KERNEL_MODULES = (
    "kernels.store_kv", "kernels.slot_mapping", "kernels.paged_attention", "kernels.copy_blocks", "kernels.rms_norm",
    "kernels.rotary",
)  # fmt: skip


class KernelSet(NamedTuple):
    store_kv: Callable[..., None]
    slot_mapping: Callable[..., object]
    paged_attention: Callable[..., object]
    copy_blocks: Callable[..., None]
    layer_ops: LayerOps


def load(backend: str, device: str) -> KernelSet:
    """The kernels of `backend` ("torch" or "triton") for `device` ("cpu" or "cuda").

    Imports the kernel modules and touches no GPU driver. The Triton backend needs interpreter
    kernels on a CPU (sets TRITON_INTERPRET=1 when no kernel module is imported yet) and GPU
    kernels on CUDA; RuntimeError, naming TRITON_INTERPRET, when the process has the other kind.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    imported = [name for name in _KERNEL_MODULES if name in sys.modules]
    if backend == "triton" and device == "cpu" and not imported:
        os.environ["TRITON_INTERPRET"] = "1"
    from kernels import copy_blocks, paged_attention, rms_norm, rotary, slot_mapping, store_kv

    if backend == "triton" and device == "cpu" and not interpreting():
        raise RuntimeError(
            f"the Triton backend on a CPU needs TRITON_INTERPRET=1 before {imported[0]} is imported; "
            "set it in the environment"
        )
    if backend == "triton" and device == "cuda" and interpreting():
        raise RuntimeError(
            "the Triton backend on CUDA needs GPU kernels, but TRITON_INTERPRET was set when the kernel modules "
            f"were imported (it is {os.environ.get('TRITON_INTERPRET')!r} now): they are Triton's CPU interpreter "
            "kernels, which would read device memory on the host. Start the process without TRITON_INTERPRET in its "
            "environment"
        )

    suffix = "_reference" if backend == "torch" else ""
    fused = LayerOps(rms_norm.rms_norm, rms_norm.add_rms_norm, rotary.rotary)
    layer_ops = TORCH_LAYER_OPS if backend == "torch" else fused
    return KernelSet(
        getattr(store_kv, "store_kv" + suffix),
        getattr(slot_mapping, "slot_mapping" + suffix),
        getattr(paged_attention, "paged_attention" + suffix),
        getattr(copy_blocks, "copy_blocks" + suffix),
        layer_ops,
    )


def interpreting() -> bool:
    """True when this process's Triton kernels run in the CPU interpreter.

    Imports the kernel modules: Triton builds their kernels then, as TRITON_INTERPRET says at
    that moment, and the answer never changes afterwards, whatever the environment says later.
    """
    from kernels import paged_attention

    return paged_attention.INTERPRETED
