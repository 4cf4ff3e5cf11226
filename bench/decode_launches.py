"""Kernel launches per decoder layer of a decode step: a CPU-countable proxy for the host cost of a step.

On a GPU a decode step of a small model is bound by launches: each costs a few microseconds of
host time whatever its size. This counts, for one decode step of `ModelRunner.execute` (batch
4, tiny with the Triton kernels in the interpreter):

- every torch operator that would launch a kernel (a `TorchDispatchMode` sees each one; views,
  reshapes and allocations launch nothing and are not counted);
- every Triton launch (each counts once; what the interpreter does inside it is not counted).

Not counted: the value checks of `store_kv` and `slot_mapping`, which read their tensors only when
those are on the CPU (a GPU skips them).

Per layer is the difference between the same model with 4 and with 2 layers, over 2. Three
ways of running the layers: `unfused` (torch RMSNorm and RoPE around the Triton attention
kernels, as before the fused kernels), `fused` (the Triton backend's `layer_ops`), and `graph`,
the fused decode step through the static buffers of a CUDA graph (on a GPU the whole body is
one graph launch; counted here are the operators the capture records, and, separately, those
the host still issues per step).

    python bench/decode_launches.py
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels
import kernels.slot_mapping
import kernels.store_kv
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import BUILTIN_MODELS
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape, ScheduledRequest
from gpu_worker.sampling import GREEDY, SamplingParams
from gpu_worker.weights import random_weights
from kernels.layer_ops import TORCH_LAYER_OPS
from kvcache.v1 import kv_manager_pb2 as pb

# Operators that only describe memory (views, shapes) or allocate it: no kernel.
_NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "slice", "select", "transpose", "t", "expand", "as_strided", "detach",
    "alias", "unsqueeze", "squeeze", "permute", "empty", "empty_strided", "empty_like", "lift_fresh", "unbind",
    "split", "split_with_sizes", "narrow", "_reshape_alias", "view_as", "numpy_T", "resolve_conj", "resolve_neg",
    "is_pinned", "set_", "_to_copy_view",
}  # fmt: skip
BATCH = 4


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-launching torch operators and Triton launches, by name, into `counts[phase]`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, Counter[str]] = {"host": Counter(), "body": Counter(), "checks": Counter()}
        self.phase = "host"
        self.inside_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_triton and name not in _NO_KERNEL:
            self.counts[self.phase][name] += 1
        return func(*args, **(kwargs or {}))

    def in_phase(self, phase: str, fn):
        def counted(*args, **kwargs):
            previous, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = previous

        return counted

    def count_triton(self, run):
        def counted(kernel, *args, **kwargs):
            if self.inside_triton:
                return run(kernel, *args, **kwargs)
            self.counts[self.phase][f"triton {kernel.fn.__name__}"] += 1
            self.inside_triton = True
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self.inside_triton = False

        return counted


def decode_counts(num_layers: int, mode: str) -> tuple[Counter[str], Counter[str]]:
    """(operators of one decode step's compute, operators the host issues around it) for `mode`."""
    config = dataclasses.replace(BUILTIN_MODELS["tiny"], num_layers=num_layers, layer_types=())
    cpu = torch.device("cpu")
    pool = PoolShape(64, (CacheGroup(0, 16, 0),), max_model_len=64, max_num_requests=BATCH)
    kernel_set = kernels.load("triton", "cpu")
    if mode == "unfused":
        kernel_set = kernel_set._replace(layer_ops=TORCH_LAYER_OPS)
    runner = ModelRunner(LlamaModel(config, random_weights(config, 0, torch.float32, cpu)), pool, kernel_set, cpu,
                         torch.float32)  # fmt: skip
    if mode == "graph":
        runner.use_decode_graphs((BATCH,), capture=False)
    delta = pb.StepDelta(step_id=1)
    for row in range(BATCH):
        delta.rows_added.add(request_id=f"r{row}").groups.add(group_id=0, block_ids=[4 * row + i for i in range(4)])
    runner.apply_step(delta)
    params = [GREEDY, SamplingParams(1.0, 3), GREEDY, GREEDY]
    runner.execute([ScheduledRequest(f"r{row}", [1, 2, 3], 0, params[row]) for row in range(BATCH)])
    step = [ScheduledRequest(f"r{row}", [4], 3, params[row]) for row in range(BATCH)]

    from triton.runtime.interpreter import InterpretedFunction

    counter = LaunchCounter()
    if mode == "graph":  # the body apart: a CUDA graph records it once and replays it as one launch
        graphs = runner.decode_graphs
        inner = graphs.body

        graphs.body = counter.in_phase("body", inner)
    checked = [kernels.store_kv, kernels.slot_mapping]
    original_checks = [module._check_args for module in checked]
    for module, check in zip(checked, original_checks):
        module._check_args = counter.in_phase("checks", check)
    original_run = InterpretedFunction.run
    InterpretedFunction.run = counter.count_triton(original_run)
    try:
        with counter:
            runner.execute(step)
    finally:
        InterpretedFunction.run = original_run
        for module, check in zip(checked, original_checks):
            module._check_args = check
    if mode == "graph":
        return counter.counts["body"], counter.counts["host"]
    return counter.counts["host"], Counter()


def main() -> int:
    print(f"One decode step of {BATCH} requests (the tiny model's shape), Triton kernels interpreted; "
          f"torch {torch.__version__}")  # fmt: skip
    print()
    print("| layers run | per layer | per step, 2 layers | host, per step, outside the body |")
    print("|---|---:|---:|---:|")
    details = {}
    for mode in ("unfused", "fused", "graph"):
        two, host = decode_counts(2, mode)
        four, _ = decode_counts(4, mode)
        per_layer = (sum(four.values()) - sum(two.values())) / 2
        details[mode] = {name: (four[name] - two[name]) // 2 for name in four if four[name] != two[name]}
        outside = sum(host.values()) if mode == "graph" else "the whole step"
        print(f"| {mode} | {per_layer:g} | {sum(two.values())} | {outside} |")
    print()
    for mode, ops in details.items():
        print(f"{mode}, per layer: " + ", ".join(f"{name} {count}" for name, count in sorted(ops.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
