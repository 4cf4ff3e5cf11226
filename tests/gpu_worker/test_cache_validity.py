"""A prefix hit only from KV a worker really holds, through real processes.

Each scenario is one way a separated manager's cache could name KV that no
worker holds: the worker restarts (SIGKILL, or SIGTERM and a new start), a
worker joins late, a worker refuses a step, a scheduler allocates and drops a
request before `Execute`, and a scheduler that runs its own model says what
it did not compute. After each, the same prompt must generate exactly what a
dense pass over the whole sequence generates. Every scenario runs on a pool
without a host tier and on one with a host tier, where the stale blocks are
first pushed out of device memory into the host tier, so that the hit would
come from the host.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import grpc
import pytest
from e2e_support import DenseOracle, Stack, launch_worker, start_stack, stop_stack
from processes import check_clean_exit

from kv_manager_service.client import AllocateOp, FreeOp, KVLossCause, KVManagerClient
from kv_manager_service.shared.errors import KVCacheError
from kv_tooling.launch import LaunchedProcess
from reference_scheduler import ReferenceScheduler, WorkerClient
from reference_scheduler.scheduler import Request

BLOCK_SIZE = 16
# 39 usable device blocks: a few filler requests push a prompt's blocks out to the host tier.
POOL = {"num_blocks": 40, "groups": [{"kind": "full_attention", "block_size": BLOCK_SIZE}]}
NUM_HOST_BLOCKS = 96
MODEL, BACKEND, SEED = "tiny", "torch", 3


class Deployment:
    """A manager and its worker as real processes; the worker can be killed and started again."""

    def __init__(self, directory: Path, tier: str, device: str) -> None:
        self.directory = directory
        self.tier = tier
        self.device = device
        manager_args = ["--num-host-blocks", str(NUM_HOST_BLOCKS)] if tier == "host" else []
        self.stack, self.processes = start_stack(
            directory, MODEL, BACKEND, POOL, seed=SEED, device=device, manager_args=manager_args
        )
        self.oracle = DenseOracle(MODEL, seed=SEED)
        self.vocab_size = self.oracle.model.config.vocab_size
        self.num_starts = 1
        self.num_fillers = 0

    @property
    def manager(self) -> KVManagerClient:
        return self.stack.manager_client

    def scheduler(self) -> ReferenceScheduler:
        return self.stack.scheduler()

    def generate(self, name: str, tokens: list[int], max_new_tokens: int = 6) -> Request:
        """Run one request to its end through the reference scheduler; check it against the dense pass."""
        scheduler = self.scheduler()
        request = scheduler.add(name, tokens, max_new_tokens)
        scheduler.run()
        self.oracle.check(request)
        return request

    def num_cached_tokens(self, tokens: list[int]) -> int:
        return self.manager.find_cache_hit(tokens)[0].num_cached_tokens

    def push_to_host(self, tokens: list[int]) -> None:
        """With a host tier: run other requests until every cached block of `tokens` lives only on the host."""
        if self.tier != "host":
            return
        for _ in range(40):
            hit, _ = self.manager.find_cache_hit(tokens)
            if hit.num_cached_tokens and hit.num_host_cached_tokens == hit.num_cached_tokens:
                return
            scheduler = self.scheduler()
            self.num_fillers += 1
            scheduler.add(f"filler-{self.num_fillers}", self.prompt(10_000 + self.num_fillers, 6 * BLOCK_SIZE), 1)
            scheduler.run()
        raise AssertionError("the prompt's blocks never moved to the host tier")

    def restart_worker(self, how: signal.Signals) -> None:
        """Stop the worker (SIGKILL: at once; SIGTERM: its clean shutdown), then start it again, same id."""
        old = self.stack.worker
        self.stack.worker_client.close()
        if how is signal.SIGKILL:
            old.kill()
        else:
            check_clean_exit(old)
        self.num_starts += 1
        worker = launch_worker(
            self.directory / f"worker-{self.num_starts}.log", self.stack.manager.address, MODEL, BACKEND, SEED,
            device=self.device,
        )  # fmt: skip
        self.processes[self.processes.index(old)] = worker
        self.stack = Stack(self.stack.manager, worker, self.stack.manager_client, WorkerClient(worker.address))

    def loss_counts(self) -> dict[KVLossCause, tuple[int, int, int]]:
        return {
            c.cause: (c.num_uncached_blocks, c.num_uncached_host_blocks, c.num_lost_requests)
            for c in self.manager.stats().kv_losses
        }

    def prompt(self, seed: int, length: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(self.vocab_size) for _ in range(length)]

    def stop(self) -> list[str]:
        return stop_stack(self.stack, self.processes)


@pytest.fixture(scope="module", params=["device", "host"])
def deployment(request, tmp_path_factory, device):
    deployment = Deployment(tmp_path_factory.mktemp(f"validity-{request.param}"), request.param, device)
    try:
        yield deployment
    finally:
        failures = deployment.stop()
        assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_after_a_worker_restart_the_same_prompt_generates_what_a_recompute_does(deployment, how):
    tokens = deployment.prompt(int(how), 3 * BLOCK_SIZE + 5)
    first = deployment.generate(f"restart-{how.name}-first", tokens)
    deployment.push_to_host(tokens)
    assert deployment.num_cached_tokens(tokens) == 3 * BLOCK_SIZE

    deployment.restart_worker(how)
    num_cached = deployment.num_cached_tokens(tokens)
    again = deployment.generate(f"restart-{how.name}-again", tokens)
    assert again.output == first.output
    # A new incarnation of worker-0 (SIGKILL), or a worker the manager no longer knows (its clean shutdown
    # unregistered it): either way its memory is empty, and nothing stayed cached.
    assert num_cached == 0
    cause = KVLossCause.WORKER_RESTARTED if how is signal.SIGKILL else KVLossCause.WORKER_JOINED
    num_blocks, num_host_blocks, _ = deployment.loss_counts()[cause]
    assert num_blocks + num_host_blocks > 0


def test_requests_running_when_the_worker_restarts_are_recomputed(deployment):
    tokens = deployment.prompt(7, 2 * BLOCK_SIZE + 3)
    scheduler = deployment.scheduler()
    running = scheduler.add("running-at-restart", tokens, 12)
    for _ in range(4):
        scheduler.step()
    assert 0 < running.num_output_tokens < 12

    deployment.restart_worker(signal.SIGKILL)
    scheduler.worker = deployment.stack.worker_client
    scheduler.run()
    assert scheduler.counters.num_kv_lost == 1  # told by its next Step, and recomputed
    deployment.oracle.check(running)


def test_a_worker_that_joins_late_reads_only_what_it_holds(deployment):
    computed_here = deployment.prompt(21, 3 * BLOCK_SIZE + 2)
    first = deployment.generate("late-computed-by-worker-0", computed_here)
    late: LaunchedProcess = launch_worker(
        deployment.directory / "late.log", deployment.stack.manager.address, MODEL, BACKEND, SEED,
        device=deployment.device, worker_id="worker-late",
    )  # fmt: skip
    try:
        # Ready means registered: joining (empty memory) has emptied the prefix cache already.
        assert "worker-late" in {w.worker_id for w in deployment.manager.workers()}
        num_cached = deployment.num_cached_tokens(computed_here)
        with WorkerClient(late.address) as late_client:
            scheduler = ReferenceScheduler(deployment.manager, late_client)
            again = scheduler.add("late-again", computed_here, 6)
            scheduler.run()
            deployment.oracle.check(again)
            assert again.output == first.output
            assert num_cached == 0  # it joined with empty memory
            assert deployment.loss_counts()[KVLossCause.WORKER_JOINED][0] > 0
            # What the late worker computed is cached now; worker-0 does not hold it, so it refuses to
            # read it and the request is recomputed there.
            computed_late = deployment.prompt(22, 3 * BLOCK_SIZE + 2)
            scheduler.add("late-computed-by-late-worker", computed_late, 2)
            scheduler.run()
        assert deployment.num_cached_tokens(computed_late) == 3 * BLOCK_SIZE
        deployment.generate("late-read-by-worker-0", computed_late)
        assert deployment.loss_counts()[KVLossCause.KV_MISSING][2] >= 1
    finally:
        check_clean_exit(late)


def test_a_refused_step_leaves_nothing_to_hit(deployment):
    tokens = deployment.prompt(31, 3 * BLOCK_SIZE + 4)
    scheduler = deployment.scheduler()
    refused = scheduler.add("refused", tokens + [deployment.vocab_size], 4)  # one token outside the vocabulary
    with pytest.raises((grpc.RpcError, KVCacheError)) as failure:
        scheduler.step()
    assert "outside the vocabulary" in str(failure.value)
    deployment.manager.step([FreeOp([refused.manager_id])])  # the scheduler gives up on it

    num_cached = deployment.num_cached_tokens(tokens + [5, 6, 7])
    deployment.generate("after-refusal", tokens + [5, 6, 7])
    assert num_cached == 0
    assert deployment.loss_counts()[KVLossCause.STEP_REFUSED][0] == 3


@pytest.mark.parametrize("freed", [True, False], ids=["freed", "left-live"])
def test_an_allocation_never_executed_leaves_nothing_to_read(deployment, freed):
    """A scheduler allocates a prompt and crashes (or its client goes away) before Execute; the same
    prompt then arrives from another scheduler. The hit is taken (as vLLM would), and the worker, which
    never filled those blocks, refuses to read them: the request is recomputed, and the blocks leave
    the cache. With a host tier the never-filled blocks were first offloaded to the host."""
    tokens = deployment.prompt(41 + freed, 3 * BLOCK_SIZE + 6)
    dropped = f"dropped-{freed}"
    deployment.manager.step([AllocateOp(dropped, tokens, len(tokens))])
    if freed:
        deployment.manager.step([FreeOp([dropped])])
        deployment.push_to_host(tokens)
    assert deployment.num_cached_tokens(tokens) == 3 * BLOCK_SIZE
    missing_before = deployment.loss_counts().get(KVLossCause.KV_MISSING, (0, 0, 0))

    again = deployment.generate(f"after-drop-{freed}", tokens)
    assert again.num_preemptions == 1  # refused by the worker once, then recomputed
    blocks, host_blocks, requests = deployment.loss_counts()[KVLossCause.KV_MISSING]
    assert (blocks, host_blocks) > missing_before[:2] and requests > missing_before[2]
    if deployment.tier == "host" and freed:
        assert host_blocks > missing_before[1]
    if not freed:
        lost = dict(deployment.manager.step([]).lost_requests)
        assert lost == {dropped: KVLossCause.KV_MISSING}  # it held the blocks it never computed
        deployment.manager.step([FreeOp([dropped])])


def test_a_scheduler_with_its_own_model_says_what_it_did_not_compute(deployment):
    tokens = deployment.prompt(51, 3 * BLOCK_SIZE + 1)
    deployment.manager.step([AllocateOp("own-runner", tokens, len(tokens))])
    assert deployment.num_cached_tokens(tokens) == 3 * BLOCK_SIZE
    deployment.manager.step([FreeOp(["own-runner"], [BLOCK_SIZE])])  # only the first block was computed
    assert deployment.num_cached_tokens(tokens) == BLOCK_SIZE
    assert deployment.loss_counts()[KVLossCause.NOT_COMPUTED][0] == 2  # the 2nd and 3rd (the 4th was never full)
