"""The precondition of `copy_blocks`, checked on host integers, importable without Triton.

A caller that holds its copies as Python integers (the worker, from a step's
delta) checks them here before anything moves to a device, where a bad block
id would be an illegal memory access rather than an error. `copy_blocks`
runs the same check on copies that are on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_copies(copies: Sequence[Sequence[int]], num_blocks: int) -> None:
    """Raise ValueError, naming the first offending pair, unless `copies` meets `copy_blocks`' precondition.

    copies: (src_block_id, dst_block_id) pairs. Every id must lie in
    [0, num_blocks), no destination may repeat, and no destination may also
    be a source. Mutates nothing.
    """
    sources = {src for src, _ in copies}
    destinations: set[int] = set()
    for index, (src, dst) in enumerate(copies):
        if not (0 <= src < num_blocks and 0 <= dst < num_blocks):
            raise ValueError(
                f"copies must hold block ids in [0, {num_blocks}) (num_blocks): copy {index} is {src} -> {dst}"
            )
        if dst in destinations:
            raise ValueError(f"copies must not repeat a destination block: copy {index} is {src} -> {dst}")
        if dst in sources:
            raise ValueError(
                f"copies must not use a destination block as a source in the same call: copy {index} is {src} -> {dst}"
            )
        destinations.add(dst)
