"""The model over the paged KV cache: the worker's compute, free of any network code.

The runner owns the KV tensors (one per layer) and the block tables. The
service feeds it the manager's step deltas in order (`apply_step`), then the
tokens of a step (`execute`); copies of a step are applied with its delta,
before any compute that reads them. With a host tier (`gpu_worker.host_tier`)
the runner also owns the host KV buffer, and a delta's tier copies go first:
offloads, then onloads, then copy-on-write copies.

The runner never reads a block for a request unless this process filled it
(`gpu_worker.kv_presence`): `execute` refuses, computing nothing, a batch in
which a request would read KV that is not here.

Host and device meet twice per step. Every small input (token ids, query
starts, lengths, block-table rows, sampling parameters) goes over in one
copy of a per-step staging buffer (`gpu_worker.staging`); positions and the
rows whose logits are needed are derived on the device. Sampling runs on the
device too, and only each request's token id and log-probability come back,
in one copy. With `use_decode_graphs`, a decode step copies its staged arrays
into static buffers and runs padded to a fixed batch size, on CUDA from a
captured graph (`gpu_worker.decode_graphs`). Whatever could be an illegal
memory access on a GPU (a block id past the pool, aliasing copies) is checked
on the host before it moves.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

from gpu_worker.block_tables import BlockTables
from gpu_worker.decode_graphs import DecodeGraphs, DecodeInputs
from gpu_worker.host_tier import HostKVBuffer, check_tier_copies
from gpu_worker.kv_presence import KVPresence, TokenSpan, UnfilledKVError
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig
from gpu_worker.sampling import SampledRows, SamplingParams, noise_key, sample, sample_rows
from gpu_worker.staging import StagedArray, Staging
from kernels import KernelSet
from kernels.copy_checks import check_copies
from kv_manager_service.shared.errors import FailedPreconditionError, InvalidArgumentError
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
    num_host_blocks: int = 0  # the host tier behind the pool; 0: none


class BlockMoves(NamedTuple):
    """A delta's block moves, checked against the pool, in the order they are applied."""

    offloads: list[tuple[int, int]]  # (device_block_id, host_block_id)
    onloads: list[tuple[int, int]]  # (device_block_id, host_block_id)
    copies: list[tuple[int, int]]  # (src_block_id, dst_block_id)


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
        # Invariant: the manager puts only the full-attention group behind the host tier.
        self.tier_layers = [
            layer for layer, group in enumerate(self.layer_groups) if pool.groups[group].sliding_window == 0
        ]
        if pool.num_host_blocks and not self.tier_layers:
            raise ValueError(
                f"the manager's host tier of {pool.num_host_blocks} blocks needs a full-attention group, "
                f"and model {config.name!r} has no layer in one"
            )
        tier_block_shape = tuple(self.kv_caches[self.tier_layers[0]].shape[1:]) if self.tier_layers else ()
        self.host_kv = HostKVBuffer(pool.num_host_blocks, len(self.tier_layers), tier_block_shape, dtype, device)
        max_blocks = [-(-pool.max_model_len // g.block_size) for g in pool.groups]
        self.tables = BlockTables(pool.max_num_requests, max_blocks, device)
        self.presence = KVPresence(
            pool.num_blocks, [g.block_size for g in pool.groups], [g.sliding_window for g in pool.groups],
            pool.num_host_blocks,
        )  # fmt: skip
        self.scale = config.head_dim**-0.5
        self.last_applied_step_id = 0
        self.decode_graphs: DecodeGraphs | None = None  # see `use_decode_graphs`

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    @property
    def host_kv_cache_bytes(self) -> int:
        """Bytes of the host tier's buffer (host memory, pinned on CUDA)."""
        return self.host_kv.num_bytes

    def apply_step(self, delta: pb.StepDelta) -> None:
        """The table changes and block moves of one step, which must be the next one.

        The moves run in the contract's order, all before the step's forward
        pass: offloads (device -> host), onloads (host -> device), then the
        copy-on-write copies. On CUDA the offloads' transfers overlap the
        forward pass, ordered against every later use of their blocks (see
        `gpu_worker.host_tier`). Raises FailedPreconditionError, having changed nothing
        (tables, device and host KV, last_applied_step_id), when the delta
        names a group or a block id outside the pool or the host tier, or two
        of its moves write one block (see `check_copies`, `check_tier_copies`),
        or when it does not follow the last applied step: after a refused step
        every later one is refused too, since the tables here no longer match
        the manager's (the worker must restart to resync).

        `presence` follows the delta too: which blocks hold KV computed here.
        """
        if delta.step_id != self.last_applied_step_id + 1:
            raise FailedPreconditionError(
                f"step {delta.step_id} does not follow the last step applied here ({self.last_applied_step_id}): "
                "a step between them was refused (see the log); restart the worker to resync with the manager",
                "step_id",
            )
        moves = self._check_delta(delta)
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
        if moves.offloads or moves.onloads or moves.copies:
            self._move_blocks(moves)
        self.presence.apply_step(delta)
        self.last_applied_step_id = delta.step_id

    def add_unfilled(self, request_id: str, tables: Sequence[Sequence[int]]) -> None:
        """A request that was live before this process followed any step: its table, and none of its KV."""
        self.tables.add(request_id, tables)
        self.presence.add_unfilled(request_id, tables)

    def _move_blocks(self, moves: BlockMoves) -> None:
        """Apply checked moves in order; every device-side id goes over in one staging copy."""
        staging = Staging()
        offload_ids = staging.add([device_id for device_id, _ in moves.offloads], torch.int64)
        onload_ids = staging.add([device_id for device_id, _ in moves.onloads], torch.int64)
        copies = moves.copies
        staged_copies = staging.add([block_id for pair in copies for block_id in pair], torch.int64, (len(copies), 2))
        staging.to(self.device)
        tier_caches = [self.kv_caches[layer] for layer in self.tier_layers]
        self.host_kv.offload(tier_caches, offload_ids.tensor, [host_id for _, host_id in moves.offloads])
        self.host_kv.onload(tier_caches, onload_ids.tensor, [host_id for _, host_id in moves.onloads])
        if copies:
            self.kernels.copy_blocks(self.kv_caches, staged_copies.tensor)

    def execute(self, requests: Sequence[ScheduledRequest]) -> list[RequestOutput]:
        """Compute and store the K/V of every scheduled token; the next token of each request.

        Raises a KVCacheError (nothing computed, nothing stored) when a request
        has no table here or its tokens run past its blocks, and UnfilledKVError
        (a KVMissingError naming every such request) when a request would read
        a slot this process has not filled and no request of the batch writes.
        Records the slots written once the forward pass has returned; a pass
        that fails part-way leaves its slots counted as holding nothing.
        """
        self._check(requests)
        spans = [TokenSpan(r.request_id, r.start_position, len(r.token_ids)) for r in requests]
        missing = self.presence.check(spans)
        if missing is not None:
            raise UnfilledKVError(missing, self.last_applied_step_id)
        try:
            outputs = self._forward(requests)
        except BaseException:
            self.presence.forget_written(spans)
            raise
        self.presence.record_written(spans)
        return outputs

    def use_decode_graphs(self, batch_sizes: Sequence[int], capture: bool) -> None:
        """Run every later decode step of at most max(batch_sizes) requests padded to the next batch size,
        through static buffers (`gpu_worker.decode_graphs`); with `capture` (CUDA), from CUDA graphs
        recorded now, one per batch size. Other steps run as before.
        """
        if max(batch_sizes) > self.pool.max_num_requests:
            raise ValueError(f"batch sizes {list(batch_sizes)} exceed the pool's {self.pool.max_num_requests} requests")
        max_blocks = [-(-self.pool.max_model_len // group.block_size) for group in self.pool.groups]
        graphs = DecodeGraphs(
            DecodeInputs.allocate(max(batch_sizes), max_blocks, self.device), batch_sizes, self._decode_body
        )
        if capture:
            graphs.capture()
        self.decode_graphs = graphs

    def _forward(self, requests: Sequence[ScheduledRequest]) -> list[RequestOutput]:
        """The forward pass over checked requests: stores their K/V, samples their next tokens."""
        token_ids: list[int] = []
        query_start_loc = [0]
        seq_lens = []
        sampled = []
        for index, request in enumerate(requests):
            token_ids.extend(request.token_ids)
            query_start_loc.append(len(token_ids))
            end = request.start_position + len(request.token_ids)
            seq_lens.append(end)
            if request.sampling.temperature > 0:
                sampled.append((index, request.sampling, end))
        graphs = self.decode_graphs
        bucket = graphs.bucket_of(len(requests)) if graphs is not None and len(token_ids) == len(requests) else None
        if bucket is not None:
            chosen, logprobs = self._decode_step(requests, token_ids, seq_lens, sampled, bucket)
        else:
            chosen, logprobs = self._step(requests, token_ids, query_start_loc, seq_lens, sampled)
        # The step's one device-to-host copy; token ids are exact in float64.
        chosen_ids, chosen_logprobs = torch.stack((chosen.double(), logprobs.double())).cpu().tolist()
        return [
            RequestOutput(request.request_id, int(token_id), logprob)
            for request, token_id, logprob in zip(requests, chosen_ids, chosen_logprobs)
        ]

    def _step(
        self,
        requests: Sequence[ScheduledRequest],
        token_ids: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        sampled: Sequence[tuple[int, SamplingParams, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Any batch, eagerly: (chosen token ids, log-probabilities) on the device."""
        staging = Staging()
        staged_tokens = staging.add(token_ids, torch.int64)
        staged_starts = staging.add(query_start_loc, torch.int32)
        staged_lengths = staging.add(seq_lens, torch.int32)
        staged_tables = self.tables.stage([r.request_id for r in requests], staging)
        staged_sampling = _stage_sampling(sampled, staging)
        staging.to(self.device)

        tokens, starts, lengths = staged_tokens.tensor, staged_starts.tensor, staged_lengths.tensor
        block_tables = staged_tables.tables()
        positions = batch_positions(starts, lengths, len(token_ids))
        slot_mappings = [
            self.kernels.slot_mapping(table, starts, positions, group.block_size)
            for table, group in zip(block_tables, self.pool.groups)
        ]
        sequence_ends = None
        if self.model.rotary.needs_sequence_ends:  # dynamic RoPE: every token at its request's length this step
            sequence_ends = lengths.repeat_interleave(starts.diff(), output_size=len(token_ids))
        hidden = self._run_model(tokens, starts, lengths, positions, block_tables, slot_mappings, sequence_ends)
        logits = self.model.logits(hidden.index_select(0, starts[1:] - 1))
        return sample(logits, None if staged_sampling is None else staged_sampling.on_device())

    def _decode_step(
        self,
        requests: Sequence[ScheduledRequest],
        token_ids: list[int],
        seq_lens: list[int],
        sampled: Sequence[tuple[int, SamplingParams, int]],
        bucket: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step through the static buffers of `bucket` rows: (chosen token ids, log-probabilities)."""
        temperatures, noise_keys = [0.0] * len(requests), [0] * len(requests)
        for row, params, position in sampled:
            temperatures[row], noise_keys[row] = params.temperature, noise_key(params.seed, position)
        staging = Staging()
        staged = [
            staging.add(token_ids, torch.int64),
            staging.add(seq_lens, torch.int32),
            staging.add(temperatures, torch.float32),
            staging.add(noise_keys, torch.int64),
            staging.add([len(requests)], torch.int64),
        ]
        staged_tables = self.tables.stage([r.request_id for r in requests], staging)
        staging.to(self.device)
        graphs = self.decode_graphs
        graphs.inputs.fill(*(array.tensor for array in staged), staged_tables.tables())
        chosen, logprobs = graphs.run(bucket)
        return chosen[: len(requests)], logprobs[: len(requests)]

    def _decode_body(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token per row of `inputs` (a bucket), with no host-side branch on values."""
        positions = (inputs.seq_lens - 1).to(torch.int64)
        padding = inputs.row_ids >= inputs.num_rows
        slot_mappings = [
            self.kernels.slot_mapping(table, inputs.query_start_loc, positions, group.block_size).masked_fill_(
                padding, -1
            )
            for table, group in zip(inputs.block_tables, self.pool.groups)
        ]
        sequence_ends = inputs.seq_lens if self.model.rotary.needs_sequence_ends else None
        hidden = self._run_model(
            inputs.token_ids, inputs.query_start_loc, inputs.seq_lens, positions, inputs.block_tables, slot_mappings,
            sequence_ends,
        )  # fmt: skip
        return sample_rows(self.model.logits(hidden), inputs.temperatures, inputs.noise_keys)

    def _run_model(
        self,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        positions: torch.Tensor,
        block_tables: Sequence[torch.Tensor],
        slot_mappings: Sequence[torch.Tensor],
        sequence_ends: torch.Tensor | None,
    ) -> torch.Tensor:
        """Final hidden states of the batch; stores its K/V at `slot_mappings` (per group) on the way."""

        def paged_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            group = self.layer_groups[layer]
            cache = self.kv_caches[layer]
            self.kernels.store_kv(key, value, cache, slot_mappings[group])
            return self.kernels.paged_attention(
                query, cache, block_tables[group], starts, lengths, self.scale, self.pool.groups[group].sliding_window
            )

        return self.model.forward(tokens, positions, paged_attention, sequence_ends, self.kernels.layer_ops)

    def _check_delta(self, delta: pb.StepDelta) -> BlockMoves:
        """The delta's block moves; FailedPreconditionError when the delta does not fit the pool or the host tier."""
        num_groups, num_blocks = len(self.pool.groups), self.pool.num_blocks
        prefix = f"step {delta.step_id} does not fit this worker's pool, and none of it was applied"
        changes = [
            (f"rows_added[{i}].groups[{j}]", group)
            for i, row in enumerate(delta.rows_added)
            for j, group in enumerate(row.groups)
        ]
        changes += [(f"blocks_appended[{i}]", update) for i, update in enumerate(delta.blocks_appended)]
        for field, change in changes:
            if change.group_id >= num_groups:
                raise FailedPreconditionError(
                    f"{prefix}: {field} names group {change.group_id}, the pool has {num_groups}", f"{field}.group_id"
                )
            if change.block_ids and max(change.block_ids) >= num_blocks:
                raise FailedPreconditionError(
                    f"{prefix}: {field} holds block {max(change.block_ids)}, the pool has {num_blocks} blocks",
                    f"{field}.block_ids",
                )
        copies = [(copy.src_block_id, copy.dst_block_id) for copy in delta.copies]
        try:
            check_copies(copies, num_blocks)
        except ValueError as error:
            raise FailedPreconditionError(f"{prefix}: {error}", "copies") from None
        tier_moves = {
            field: [(move.device_block_id, move.host_block_id) for move in getattr(delta, field)]
            for field in ("offloads", "onloads")
        }
        for field, destination in (("offloads", "host"), ("onloads", "device")):
            try:
                check_tier_copies(field, tier_moves[field], num_blocks, self.pool.num_host_blocks, destination)
            except ValueError as error:
                raise FailedPreconditionError(f"{prefix}: {error}", field) from None
        return BlockMoves(tier_moves["offloads"], tier_moves["onloads"], copies)

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
            if not 0 <= request.sampling.seed < 1 << 64:
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: seed must be a uint64, got {request.sampling.seed}",
                    f"{field}.sampling.seed",
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


def batch_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 `[num_tokens]`: the position of each token of a batch, derived on the tensors' device.

    Request r's tokens are `query_start_loc[r]:query_start_loc[r + 1]` (at
    least one) and its last one sits at position `seq_lens[r] - 1`, so token
    t of request r sits at `t + seq_lens[r] - query_start_loc[r + 1]`.
    `num_tokens` (the host's `query_start_loc[-1]`) spares the device a sync.
    """
    if num_tokens == seq_lens.shape[0]:  # one token per request: a decode step
        return (seq_lens - 1).to(torch.int64)
    offsets = (seq_lens - query_start_loc[1:]).to(torch.int64)
    per_token = offsets.repeat_interleave(query_start_loc.diff(), output_size=num_tokens)
    return per_token + torch.arange(num_tokens, dtype=torch.int64, device=seq_lens.device)


class _StagedSampling(NamedTuple):
    """The arrays of `SampledRows`, staged."""

    rows: StagedArray
    temperatures: StagedArray
    noise_keys: StagedArray

    def on_device(self) -> SampledRows:
        return SampledRows(self.rows.tensor, self.temperatures.tensor, self.noise_keys.tensor)


def _stage_sampling(sampled: Sequence[tuple[int, SamplingParams, int]], staging: Staging) -> _StagedSampling | None:
    """Stage the (row, params, position of the new token) of every sampling request; None when every row is greedy."""
    if not sampled:
        return None
    return _StagedSampling(
        staging.add([row for row, _, _ in sampled], torch.int64),
        staging.add([params.temperature for _, params, _ in sampled], torch.float32),
        staging.add([noise_key(params.seed, position) for _, params, position in sampled], torch.int64),
    )
