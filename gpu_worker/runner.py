"""The model over the paged KV cache: the worker's compute, free of any network code.

The runner owns the KV tensors (one per layer) and the block tables. The
service feeds it the manager's step deltas in order (`apply_step`), then the
tokens of a step (`execute`); copies of a step are applied with its delta,
before any compute that reads them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

from gpu_worker.block_tables import BlockTables
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig
from gpu_worker.sampling import SamplingParams, choose
from kernels import KernelSet
from kv_manager_service.rpc.errors import FailedPreconditionError, InvalidArgumentError
from kvcache.v1 import kv_manager_pb2 as pb


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group of the manager's pool, as the worker needs it."""

    group_id: int
    block_size: int
    sliding_window: int = 0  # 0: full attention


@dataclasses.dataclass(frozen=True)
class PoolShape:
    num_blocks: int
    groups: tuple[CacheGroup, ...]
    max_model_len: int
    max_num_requests: int


class ScheduledRequest(NamedTuple):
    request_id: str
    token_ids: Sequence[int]
    start_position: int  # position of token_ids[0]
    sampling: SamplingParams


class RequestOutput(NamedTuple):
    request_id: str
    token_id: int
    logprob: float


def assign_layers(model: ModelConfig, groups: Sequence[CacheGroup]) -> list[int]:
    """The group each layer's KV lives in: the one whose window equals the layer's.

    Raises ValueError when a layer has no matching group, two groups match, or
    a group serves no layer: the manager was configured for another model.
    """
    described = ", ".join(f"group {g.group_id}: window {g.sliding_window or 'none'}" for g in groups)
    layer_groups = []
    for layer in range(model.num_layers):
        window = model.window_of(layer)
        matches = [g.group_id for g in groups if g.sliding_window == window]
        if len(matches) != 1:
            problem = "no group" if not matches else f"{len(matches)} groups"
            raise ValueError(
                f"model {model.name!r} layer {layer} attends with window {window or 'none'}, "
                f"and the manager's pool has {problem} for it ({described})"
            )
        layer_groups.append(matches[0])
    unused = sorted({g.group_id for g in groups} - set(layer_groups))
    if unused:
        raise ValueError(f"the manager's pool has groups {unused} that no layer of model {model.name!r} uses ({described})")
    return layer_groups


class ModelRunner:
    def __init__(
        self, model: LlamaModel, pool: PoolShape, kernels: KernelSet, device: torch.device, dtype: torch.dtype
    ) -> None:
        config = model.config
        if [g.group_id for g in pool.groups] != list(range(len(pool.groups))):
            raise ValueError(f"group ids must be 0..{len(pool.groups) - 1} in order, got {[g.group_id for g in pool.groups]}")
        self.model = model
        self.pool = pool
        self.kernels = kernels
        self.device = device
        self.layer_groups = assign_layers(config, pool.groups)
        self.kv_caches = [
            torch.zeros(
                (pool.num_blocks, 2, pool.groups[group].block_size, config.num_kv_heads, config.head_dim),
                dtype=dtype,
                device=device,
            )
            for group in self.layer_groups
        ]
        max_blocks = [-(-pool.max_model_len // g.block_size) for g in pool.groups]
        self.tables = BlockTables(pool.max_num_requests, max_blocks, device)
        self.scale = config.head_dim**-0.5
        self.last_applied_step_id = 0

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    def apply_step(self, delta: pb.StepDelta) -> None:
        """The table changes and block copies of one step, which must be the next one."""
        assert delta.step_id > self.last_applied_step_id, (delta.step_id, self.last_applied_step_id)
        tables = self.tables
        for row in delta.rows_added:
            per_group = [[] for _ in self.pool.groups]
            for group in row.groups:
                per_group[group.group_id] = list(group.block_ids)
            tables.add(row.request_id, per_group)
        for update in delta.blocks_appended:
            tables.update(update.request_id, update.group_id, update.new_block_index, update.block_ids)
        for request_id in delta.requests_freed:
            tables.remove(request_id)
        if delta.copies:
            copies = torch.tensor([(c.src_block_id, c.dst_block_id) for c in delta.copies], dtype=torch.int64)
            self.kernels.copy_blocks(self.kv_caches, copies.to(self.device))
        self.last_applied_step_id = delta.step_id

    def execute(self, requests: Sequence[ScheduledRequest]) -> list[RequestOutput]:
        """Compute and store the K/V of every scheduled token; the next token of each request.

        Raises a KVCacheError (nothing computed, nothing stored) when a request
        has no table here or its tokens run past its blocks.
        """
        self._check(requests)
        device = self.device
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens = []
        for request in requests:
            token_ids.extend(request.token_ids)
            end = request.start_position + len(request.token_ids)
            positions.extend(range(request.start_position, end))
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=device)
        position_tensor = torch.tensor(positions, dtype=torch.int64, device=device)
        starts = torch.tensor(query_start_loc, dtype=torch.int32, device=device)
        lengths = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        block_tables = self.tables.batch([r.request_id for r in requests])
        slot_mappings = [
            self.kernels.slot_mapping(table, starts, position_tensor, group.block_size)
            for table, group in zip(block_tables, self.pool.groups)
        ]

        def paged_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            group = self.layer_groups[layer]
            cache = self.kv_caches[layer]
            self.kernels.store_kv(key, value, cache, slot_mappings[group])
            return self.kernels.paged_attention(
                query, cache, block_tables[group], starts, lengths, self.scale, self.pool.groups[group].sliding_window
            )

        hidden = self.model.forward(tokens, position_tensor, paged_attention)
        last_rows = torch.tensor(query_start_loc[1:], device=device) - 1
        logits = self.model.logits(hidden[last_rows]).cpu()
        outputs = []
        for request, row, end in zip(requests, logits, seq_lens):
            token_id, logprob = choose(row, request.sampling, end)
            outputs.append(RequestOutput(request.request_id, token_id, logprob))
        return outputs

    def _check(self, requests: Sequence[ScheduledRequest]) -> None:
        if not requests:
            raise InvalidArgumentError("requests must not be empty", "requests")
        vocab_size = self.model.config.vocab_size
        seen = set()
        for index, request in enumerate(requests):
            field = f"requests[{index}]"
            if request.request_id in seen:
                raise InvalidArgumentError(f"request {request.request_id!r} appears twice", f"{field}.request_id")
            seen.add(request.request_id)
            if not request.token_ids:
                raise InvalidArgumentError(f"request {request.request_id!r} schedules no token", f"{field}.token_ids")
            if max(request.token_ids) >= vocab_size:
                bad = next(t for t in request.token_ids if t >= vocab_size)
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: token id {bad} is outside the vocabulary of {vocab_size}",
                    f"{field}.token_ids",
                )
            if request.sampling.temperature < 0 or request.sampling.temperature != request.sampling.temperature:
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: temperature must be >= 0, got {request.sampling.temperature}",
                    f"{field}.sampling.temperature",
                )
            end = request.start_position + len(request.token_ids)
            for group in self.pool.groups:
                capacity = self.tables.num_blocks(request.request_id, group.group_id) * group.block_size
                if end > capacity:
                    raise FailedPreconditionError(
                        f"request {request.request_id!r}: tokens up to position {end - 1} need more than the "
                        f"{capacity} slots its group-{group.group_id} table holds at step {self.last_applied_step_id}",
                        f"{field}.start_position",
                    )
