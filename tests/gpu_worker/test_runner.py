"""The runner in-process on a CPU: paged steps against the dense pass, and deltas checked before anything moves."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

import kernels
from gpu_worker.kv_presence import UnfilledKVError
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import BUILTIN_MODELS
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape, ScheduledRequest, batch_positions
from gpu_worker.sampling import GREEDY, SamplingParams, choose
from gpu_worker.staging import Staging
from gpu_worker.weights import random_weights
from kv_manager_service.shared.errors import FailedPreconditionError, InvalidArgumentError, KVMissingError
from kvcache.v1 import kv_manager_pb2 as pb

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def make_runner() -> ModelRunner:
    """tiny-swa on a CPU with the torch kernels: group 0 full attention, group 1 its 24-token window."""
    config = BUILTIN_MODELS["tiny-swa"]
    groups = (CacheGroup(0, BLOCK_SIZE, 0), CacheGroup(1, BLOCK_SIZE, 24))
    pool = PoolShape(NUM_BLOCKS, groups, max_model_len=64, max_num_requests=8)
    weights = random_weights(config, 3, torch.float32, CPU)
    return ModelRunner(LlamaModel(config, weights), pool, kernels.load("torch", "cpu"), CPU, torch.float32)


def add_requests(runner: ModelRunner, step_id: int, tables: dict[str, list[list[int]]]) -> None:
    delta = pb.StepDelta(step_id=step_id)
    for request_id, per_group in tables.items():
        row = delta.rows_added.add(request_id=request_id)
        for group_id, block_ids in enumerate(per_group):
            row.groups.add(group_id=group_id, block_ids=block_ids)
    runner.apply_step(delta)


def dense_choice(runner: ModelRunner, tokens: list[int], params: SamplingParams) -> tuple[int, float]:
    """What the dense reference picks after `tokens` (the oracle of the end-to-end tests)."""
    return choose(runner.model.dense_logits(torch.tensor(tokens)), params, len(tokens))


def test_prefill_chunks_and_decode_steps_choose_what_the_dense_pass_chooses():
    runner = make_runner()
    rng = random.Random(0)
    vocab = runner.model.config.vocab_size
    prompts = {"a": 5, "b": 9, "c": 13}
    params = {"a": GREEDY, "b": SamplingParams(1.0, 5), "c": SamplingParams(0.7, (1 << 64) - 1)}
    tokens = {rid: [rng.randrange(vocab) for _ in range(n)] for rid, n in prompts.items()}
    blocks = iter(range(NUM_BLOCKS))
    add_requests(runner, 1, {rid: [[next(blocks) for _ in range(7)] for _ in range(2)] for rid in prompts})
    computed = {rid: 0 for rid in prompts}

    def schedule(request_id: str, num_tokens: int) -> ScheduledRequest:
        start = computed[request_id]
        computed[request_id] += num_tokens
        return ScheduledRequest(request_id, tokens[request_id][start : start + num_tokens], start, params[request_id])

    # Step 1: a and b prefill whole, c its first 6 tokens (its output is dropped, as a scheduler drops it).
    # Step 2: a and b decode while c prefills the rest. Then everybody decodes.
    steps = [[("a", 5), ("b", 9), ("c", 6)], [("a", 1), ("b", 1), ("c", 7)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 6
    num_not_greedy = 0
    for index, step in enumerate(steps):
        outputs = runner.execute([schedule(rid, n) for rid, n in step])
        assert [o.request_id for o in outputs] == [rid for rid, _ in step]
        for output in outputs:
            rid = output.request_id
            if computed[rid] < len(tokens[rid]):
                continue  # a prefill chunk that does not reach the end of the prompt
            expected, logprob = dense_choice(runner, tokens[rid], params[rid])
            assert output.token_id == expected, (index, rid)
            assert output.logprob == pytest.approx(logprob, abs=1e-4), (index, rid)
            num_not_greedy += output.token_id != dense_choice(runner, tokens[rid], GREEDY)[0]
            tokens[rid].append(output.token_id)
    assert num_not_greedy > 0  # the sampled requests did sample


@pytest.mark.parametrize("seed", range(5))
def test_positions_derived_on_the_device_equal_the_host_construction(seed):
    rng = random.Random(seed)
    query_lens = [rng.choice([1, 1, 2, 7]) for _ in range(rng.randint(1, 9))]
    starts = [rng.randrange(50) for _ in query_lens]
    positions, query_start_loc, seq_lens = [], [0], []
    for start, length in zip(starts, query_lens):
        positions.extend(range(start, start + length))
        query_start_loc.append(len(positions))
        seq_lens.append(start + length)
    derived = batch_positions(
        torch.tensor(query_start_loc, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), len(positions)
    )
    assert derived.dtype == torch.int64 and derived.tolist() == positions


def test_a_step_moves_its_inputs_in_one_staging(monkeypatch):
    runner = make_runner()
    add_requests(runner, 1, {"a": [[1, 2], [3, 4]], "b": [[5], [6]]})
    moved = []
    original = Staging.to

    def counted(staging: Staging, device: torch.device) -> None:
        moved.append([array.shape for array in staging.arrays])
        original(staging, device)

    monkeypatch.setattr(Staging, "to", counted)
    scheduled = [ScheduledRequest("a", [1, 2, 3], 0, GREEDY), ScheduledRequest("b", [4], 0, SamplingParams(1.0, 2))]
    outputs = runner.execute(scheduled)
    assert len(moved) == 1 and len(outputs) == 2
    # token ids, query starts, lengths, the batch's table rows; the sampled row, its temperature and noise key
    assert moved[0] == [(4,), (3,), (2,), (2,), (1,), (1,), (1,)]


def test_a_seed_that_is_not_a_uint64_is_refused():
    runner = make_runner()
    add_requests(runner, 1, {"a": [[1], [2]]})
    with pytest.raises(InvalidArgumentError, match="seed must be a uint64") as refused:
        runner.execute([ScheduledRequest("a", [1], 0, SamplingParams(1.0, -1))])
    assert refused.value.field == "requests[0].sampling.seed"


def state_of(runner: ModelRunner) -> tuple:
    num_groups = len(runner.pool.groups)
    tables = {rid: [runner.tables.block_ids(rid, g) for g in range(num_groups)] for rid in sorted(runner.tables.rows)}
    return runner.last_applied_step_id, tables, [cache.clone() for cache in runner.kv_caches]


def assert_same_state(before: tuple, after: tuple) -> None:
    assert before[:2] == after[:2]
    assert all(torch.equal(a, b) for a, b in zip(before[2], after[2]))


def step_two() -> pb.StepDelta:
    """Adds c, appends to a, frees b, and copies block 10 onto 11."""
    delta = pb.StepDelta(step_id=2, requests_freed=["b"])
    row = delta.rows_added.add(request_id="c")
    row.groups.add(group_id=0, block_ids=[20])
    row.groups.add(group_id=1, block_ids=[21])
    delta.blocks_appended.add(request_id="a", group_id=0, new_block_index=1, block_ids=[22])
    delta.copies.add(src_block_id=10, dst_block_id=11)
    return delta


def set_copies(delta: pb.StepDelta, *pairs: tuple[int, int]) -> None:
    del delta.copies[:]
    for src, dst in pairs:
        delta.copies.add(src_block_id=src, dst_block_id=dst)


# (what is wrong, how it spoils step_two, what the error says)
BAD_DELTAS = [
    ("copy source past the pool", lambda d: set_copies(d, (10, 11), (NUM_BLOCKS, 12)),
     r"block ids in \[0, 64\).*copy 1 is 64 -> 12"),
    ("copy destination past the pool", lambda d: set_copies(d, (10, 1000)), r"block ids in \[0, 64\)"),
    ("repeated destination", lambda d: set_copies(d, (10, 11), (12, 11)),
     "must not repeat a destination block: copy 1"),
    ("destination also a source", lambda d: set_copies(d, (10, 11), (11, 12)), "destination block as a source"),
    ("table block past the pool", lambda d: d.rows_added[0].groups[1].block_ids.append(NUM_BLOCKS),
     r"rows_added\[0\].groups\[1\] holds block 64"),
    ("appended block past the pool", lambda d: d.blocks_appended[0].block_ids.append(99),
     r"blocks_appended\[0\] holds block 99"),
    ("unknown group in a new row", lambda d: setattr(d.rows_added[0].groups[1], "group_id", 2),
     "names group 2, the pool has 2"),
    ("unknown group in an append", lambda d: setattr(d.blocks_appended[0], "group_id", 5), "names group 5"),
]  # fmt: skip


@pytest.mark.parametrize("spoil, message", [b[1:] for b in BAD_DELTAS], ids=[b[0] for b in BAD_DELTAS])
def test_a_delta_that_does_not_fit_the_pool_is_refused_before_anything_moves(spoil, message):
    runner = make_runner()
    add_requests(runner, 1, {"a": [[1], [2]], "b": [[3], [4]]})
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))
    copied = []
    runner.kernels = runner.kernels._replace(copy_blocks=lambda caches, copies: copied.append(copies))
    before = state_of(runner)
    delta = step_two()
    spoil(delta)
    with pytest.raises(FailedPreconditionError, match=message) as refused:
        runner.apply_step(delta)
    assert "step 2 does not fit this worker's pool, and none of it was applied" in str(refused.value)
    assert copied == []
    assert_same_state(before, state_of(runner))

    runner.apply_step(step_two())  # the step as the manager meant it goes through
    assert [c.tolist() for c in copied] == [[[10, 11]]]
    assert runner.last_applied_step_id == 2 and "b" not in runner.tables
    assert runner.tables.block_ids("a", 0) == [1, 22] and runner.tables.block_ids("c", 1) == [21]


def test_after_a_refused_step_every_later_step_is_refused():
    runner = make_runner()
    add_requests(runner, 1, {"a": [[1], [2]], "b": [[3], [4]]})
    bad = step_two()
    set_copies(bad, (10, 1000))
    with pytest.raises(FailedPreconditionError):
        runner.apply_step(bad)
    before = state_of(runner)
    later = pb.StepDelta(step_id=3, requests_freed=["a"])
    with pytest.raises(FailedPreconditionError, match="step 3 does not follow the last step applied here \\(1\\)"):
        runner.apply_step(later)
    assert_same_state(before, state_of(runner))


def test_good_copies_reach_the_kernel_on_the_runner_device_and_copy_every_layer():
    runner = make_runner()
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(1)))
    delta = pb.StepDelta(step_id=1)
    delta.copies.add(src_block_id=5, dst_block_id=6)
    delta.copies.add(src_block_id=5, dst_block_id=7)
    runner.apply_step(delta)
    for cache in runner.kv_caches:
        assert torch.equal(cache[6], cache[5]) and torch.equal(cache[7], cache[5])


def test_importing_the_runner_leaves_the_triton_backend_free_to_choose_the_interpreter():
    """`gpu-worker --device cpu --backend triton` imports the runner before `kernels.load` sets TRITON_INTERPRET."""
    code = "import gpu_worker.runner, kernels; kernels.load('triton', 'cpu'); print(kernels.interpreting())"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout == "True\n", done.stderr


def admit_sharing(
    runner: ModelRunner, step_id: int, request_id: str, tables: list[list[int]], num_hit_tokens: int
) -> None:
    """A request whose row holds, in its first blocks, `num_hit_tokens` the manager counts as cached."""
    delta = pb.StepDelta(step_id=step_id)
    row = delta.rows_added.add(request_id=request_id, num_hit_tokens=num_hit_tokens)
    for group_id, block_ids in enumerate(tables):
        row.groups.add(group_id=group_id, block_ids=block_ids)
    runner.apply_step(delta)


@pytest.mark.parametrize("a_computed", ["never", "before", "in the same step"])
def test_a_hit_on_blocks_never_computed_here_is_refused_and_a_computed_one_reads_them(a_computed):
    """a is admitted and its step may never run here; b's row then says a's first two blocks hold its first 8 tokens."""
    runner = make_runner()
    rng = random.Random(4)
    prompt = [rng.randrange(runner.model.config.vocab_size) for _ in range(10)]
    add_requests(runner, 1, {"a": [[1, 2, 3], [4, 5, 6]]})
    if a_computed == "before":
        runner.execute([ScheduledRequest("a", prompt, 0, GREEDY)])
    admit_sharing(runner, 2, "b", [[1, 2, 7], [4, 5, 8]], num_hit_tokens=8)
    b = ScheduledRequest("b", prompt[8:], 8, GREEDY)
    batch = [ScheduledRequest("a", prompt, 0, GREEDY), b] if a_computed == "in the same step" else [b]
    before = state_of(runner)
    if a_computed == "never":
        with pytest.raises(UnfilledKVError) as refused:
            runner.execute(batch)
        assert isinstance(refused.value, KVMissingError) and refused.value.request_ids == ["b"]
        assert refused.value.field == "requests[0]" and refused.value.missing.device_block_ids == (1, 2, 4, 5)
        assert_same_state(before, state_of(runner))  # nothing computed, nothing stored
        return
    output = runner.execute(batch)[-1]
    expected, logprob = dense_choice(runner, prompt, GREEDY)
    assert output.request_id == "b" and output.token_id == expected
    assert output.logprob == pytest.approx(logprob, abs=1e-4)


def test_a_refusal_names_every_request_that_would_read_what_is_not_here_and_the_rest_runs_again():
    runner = make_runner()
    vocab = runner.model.config.vocab_size
    prompt = [(5 * i + 1) % vocab for i in range(6)]
    add_requests(runner, 1, {"a": [[1, 2], [3, 4]], "x": [[5, 6], [7, 8]]})
    admit_sharing(runner, 2, "b", [[1, 2], [3, 4]], num_hit_tokens=6)  # a fork of a before a ran
    batch = [
        ScheduledRequest("x", prompt, 0, GREEDY),
        ScheduledRequest("b", prompt[4:5], 6, GREEDY),
        ScheduledRequest("a", prompt[4:], 4, GREEDY),  # a skips its first 4 tokens
    ]
    before = state_of(runner)
    with pytest.raises(UnfilledKVError) as refused:
        runner.execute(batch)
    assert refused.value.request_ids == ["b", "a"] and refused.value.field == "requests[1]"
    assert_same_state(before, state_of(runner))
    (output,) = runner.execute(batch[:1])
    assert output.token_id == dense_choice(runner, prompt, GREEDY)[0]


def test_a_worker_that_joined_late_holds_nothing_of_the_requests_live_before_it():
    runner = make_runner()
    runner.add_unfilled("old", [[1, 2], [3, 4]])
    with pytest.raises(UnfilledKVError, match="'old'"):
        runner.execute([ScheduledRequest("old", [1], 5, GREEDY)])
    runner.execute([ScheduledRequest("old", [1, 2, 3, 4, 5, 6], 0, GREEDY)])
    runner.execute([ScheduledRequest("old", [7], 6, GREEDY)])
