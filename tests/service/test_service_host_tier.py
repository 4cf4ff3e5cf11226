"""The host-memory tier as a worker and a scheduler meet it: `kv-manager serve --num-host-blocks`.

A prompt is cached, evicted from a small device pool by other prompts (an offload in that step's
delta), found again by FindCacheHit as host tokens, and allocated again (onloads in the delta, its
host tokens counted as computed). Each copy pins its host block until the registered worker
acknowledges the step. A manager killed with SIGKILL restarts from its journal, replayed or
compacted, with the same tier: the same hits and the same tier figures.
"""

from __future__ import annotations

from typing import Any

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import CacheHit
from kv_tooling.launch import LaunchedProcess
from kvcache.v1 import kv_manager_pb2 as pb
from processes import stop_all
from svc_support import alloc, connect, pool_config, read_steps, register_worker, stats
from test_service_compaction import entries
from test_service_journal import Manager
from test_service_metrics import metrics_url, scrape

BLOCK_SIZE = 16
NUM_BLOCKS = 9  # the null block and 8 usable: one 128-token prompt fills the pool
NUM_HOST_BLOCKS = 16
TIER_ARGS = ("--num-blocks", str(NUM_BLOCKS), "--num-host-blocks", str(NUM_HOST_BLOCKS))
WORKER = "gpu-0"

PROMPT = list(range(64))  # 4 full blocks
AGAIN = PROMPT + [5000]  # the prompt continued: its 4 blocks are a hit
FILLER = list(range(1000, 1128))  # 8 blocks: evicts every cached block of PROMPT

TIER_FIELDS = (
    "num_host_blocks", "num_free_host_blocks", "prefix_cache_host_hits", "num_offloaded_blocks",
    "num_onloaded_blocks", "num_host_evictions", "num_pending_tier_copies",
)  # fmt: skip


def tier_stats(stub: Any) -> dict[str, int]:
    s = stats(stub)
    return {name: getattr(s, name) for name in TIER_FIELDS}


def ack(stub: Any) -> None:
    stub.AckSteps(pb.AckStepsRequest(worker_id=WORKER, step_id=stats(stub).last_step_id))


def cache_hit(stub: Any, token_ids: list[int]) -> tuple[int, int, list[int]]:
    """(num_cached_tokens, num_host_cached_tokens, block ids of group 0)."""
    response = stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=token_ids))
    return response.num_cached_tokens, response.num_host_cached_tokens, list(response.groups[0].block_ids)


def offload_prompt(stub: Any) -> tuple[list[int], pb.StepDelta]:
    """Cache PROMPT, evict it to the host with FILLER; returns PROMPT's device blocks and the evicting delta."""
    prompt = stub.Allocate(alloc("prompt", PROMPT))
    device_ids = list(prompt.groups[0].new_block_ids)
    stub.Free(pb.FreeRequest(request_ids=["prompt"]))
    filler = stub.Allocate(alloc("filler", FILLER))
    assert filler.status == pb.ALLOCATE_STATUS_OK
    stub.Free(pb.FreeRequest(request_ids=["filler"]))
    (delta,) = read_steps(stub, WORKER, filler.step_id, 1)
    return device_ids, delta


def test_serve_reports_its_host_tier(server_factory):
    server = server_factory.start("--num-host-blocks", "32", config=pool_config(64))
    channel, stub = connect(server.address)
    with channel:
        assert stub.GetConfig(pb.GetConfigRequest()).num_host_blocks == 32
        assert tier_stats(stub) == dict.fromkeys(TIER_FIELDS, 0) | {"num_host_blocks": 32, "num_free_host_blocks": 32}


def test_the_config_file_sets_the_tier_and_the_flag_overrides_it(server_factory):
    from_file = server_factory.start(config=pool_config(64, num_host_blocks=8))
    overridden = server_factory.start("--num-host-blocks", "0", config=pool_config(64, num_host_blocks=8))
    for server, expected in ((from_file, 8), (overridden, 0)):
        channel, stub = connect(server.address)
        with channel:
            assert stub.GetConfig(pb.GetConfigRequest()).num_host_blocks == expected


def test_an_evicted_prompt_is_offloaded_found_on_the_host_and_onloaded(server_factory):
    server = server_factory.start(*TIER_ARGS, "--worker-timeout-s", "3600", config=pool_config(NUM_BLOCKS))
    channel, stub = connect(server.address)
    with channel:
        register_worker(stub, WORKER)
        device_ids, evicting = offload_prompt(stub)

        # The filler's admission evicted the prompt's 4 cached blocks, tail first (a free puts a
        # table's blocks in the free queue in reverse): each was offloaded before its reuse.
        assert [c.device_block_id for c in evicting.offloads] == device_ids[::-1]
        host_of = {c.device_block_id: c.host_block_id for c in evicting.offloads}
        host_ids = [host_of[device_id] for device_id in device_ids]  # the prompt's blocks, in order
        assert len(set(host_ids)) == 4 and not evicting.onloads
        assert tier_stats(stub)["num_offloaded_blocks"] == 4
        assert tier_stats(stub)["num_pending_tier_copies"] == 4  # pinned until the worker acknowledges
        ack(stub)
        assert tier_stats(stub)["num_pending_tier_copies"] == 0

        # Found again, on the host only: the null block stands for the device block not chosen yet;
        # the client gives the core's CacheHit again (-1 there).
        assert cache_hit(stub, AGAIN) == (64, 64, [0, 0, 0, 0])
        with KVManagerClient(server.address) as client:
            assert client.find_cache_hit(AGAIN)[0] == CacheHit(64, ((-1, -1, -1, -1),), 64)

        again = stub.Allocate(alloc("again", AGAIN))
        assert again.status == pb.ALLOCATE_STATUS_OK
        assert again.num_computed_tokens == 64 and again.num_scheduled_tokens == 1
        (delta,) = read_steps(stub, WORKER, again.step_id, 1)
        table = list(delta.rows_added[0].groups[0].block_ids)
        assert [(c.device_block_id, c.host_block_id) for c in delta.onloads] == list(zip(table[:4], host_ids))
        # Its 5 new blocks evicted 5 of the filler's: offloaded in the same step, before the onloads.
        assert len(delta.offloads) == 5
        assert {c.device_block_id for c in delta.offloads} & set(table)
        figures = tier_stats(stub)
        assert figures["num_onloaded_blocks"] == 4 and figures["prefix_cache_host_hits"] == 64
        assert figures["num_offloaded_blocks"] == 9 and figures["num_pending_tier_copies"] == 9
        ack(stub)
        assert tier_stats(stub)["num_pending_tier_copies"] == 0
        # Now on the device too: a device hit again.
        assert cache_hit(stub, AGAIN)[:2] == (64, 0)


def test_the_metrics_show_the_tier_as_get_stats_does(server_factory):
    server = server_factory.start(
        *TIER_ARGS, "--worker-timeout-s", "3600", "--metrics-port", "0", config=pool_config(NUM_BLOCKS)
    )
    channel, stub = connect(server.address)
    with channel:
        register_worker(stub, WORKER)
        offload_prompt(stub)
        stub.Allocate(alloc("again", AGAIN))
        figures, samples = tier_stats(stub), scrape(metrics_url(server))
    assert samples.types["kvcache_offloaded_blocks"] == "counter"
    assert samples.get("kvcache_host_num_blocks") == figures["num_host_blocks"] == NUM_HOST_BLOCKS
    assert samples.get("kvcache_host_num_free_blocks") == figures["num_free_host_blocks"]
    assert samples.get("kvcache_prefix_cache_host_hit_tokens_total") == figures["prefix_cache_host_hits"] == 64
    assert samples.get("kvcache_offloaded_blocks_total") == figures["num_offloaded_blocks"] == 9
    assert samples.get("kvcache_onloaded_blocks_total") == figures["num_onloaded_blocks"] == 4
    assert samples.get("kvcache_host_evictions_total") == figures["num_host_evictions"]
    num_pending = figures["num_pending_tier_copies"]
    assert samples.get("kvcache_num_pending_tier_copies") == num_pending == 13  # none acknowledged
    num_pinned = NUM_HOST_BLOCKS - figures["num_free_host_blocks"]
    assert samples.get("kvcache_host_usage_ratio") == num_pinned / NUM_HOST_BLOCKS > 0
    assert samples.has("kvcache_dropped_offloads_total")


def test_a_server_without_a_tier_exports_no_tier_series(server_factory):
    server = server_factory.start("--metrics-port", "0", config=pool_config(64))
    assert not scrape(metrics_url(server)).has("kvcache_host_num_blocks")


def test_a_dropped_worker_releases_its_tier_copies(server_factory):
    server = server_factory.start(*TIER_ARGS, "--worker-timeout-s", "3600", config=pool_config(NUM_BLOCKS))
    channel, stub = connect(server.address)
    with channel:
        register_worker(stub, WORKER)
        offload_prompt(stub)
        assert tier_stats(stub)["num_pending_tier_copies"] == 4
        stub.UnregisterWorker(pb.UnregisterWorkerRequest(worker_id=WORKER))
        assert tier_stats(stub)["num_pending_tier_copies"] == 0


def restart_state(stub: Any) -> dict[str, Any]:
    """What a restart must keep of the tier: its figures and the hits it answers."""
    return {
        "tier": tier_stats(stub),
        "prompt": cache_hit(stub, AGAIN),
        "filler": cache_hit(stub, FILLER + [1]),
        "last_step_id": stats(stub).last_step_id,
    }


def tier_history(stub: Any) -> None:
    """Offloads, a host hit with onloads, host evictions, and copies left pending."""
    register_worker(stub, WORKER)
    offload_prompt(stub)
    ack(stub)
    stub.Allocate(alloc("again", AGAIN))
    for i in range(3):  # host evictions: 4 more 128-token prompts through a 16-block host
        stub.Free(pb.FreeRequest(request_ids=["again"] if i == 0 else [f"other-{i - 1}"]))
        ack(stub)
        stub.Allocate(alloc(f"other-{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 128))))
    # The last step's copies stay pending: the worker has not acknowledged it.


def test_a_journal_restart_restores_the_same_tier(tmp_path):
    manager = Manager(tmp_path, *TIER_ARGS, "--worker-timeout-s", "600")
    try:
        before = journaled_history(manager)
        manager.kill()
        channel, stub = connect(manager.start().address)
        with channel:
            assert restart_state(stub) == before
            ack(stub)
            assert tier_stats(stub)["num_pending_tier_copies"] == 0
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def continue_history(stub: Any) -> pb.AllocateResponse:
    """One more admission after `tier_history`: it evicts, offloads and hits the host."""
    stub.Free(pb.FreeRequest(request_ids=["other-2"]))
    return stub.Allocate(alloc("again-2", AGAIN))


def test_a_compacted_journal_restores_the_same_tier(tmp_path, server_factory):
    # The reference: the same calls on a manager never restarted.
    reference = server_factory.start(*TIER_ARGS, "--worker-timeout-s", "600", config=pool_config(48))
    channel, stub = connect(reference.address)
    with channel:
        tier_history(stub)
        reference_before = restart_state(stub)
        reference_allocate = continue_history(stub)
        reference_after = restart_state(stub)

    manager = Manager(tmp_path, *TIER_ARGS, "--worker-timeout-s", "600", "--journal-compact-bytes", "1")
    try:
        before = journaled_history(manager)
        assert "snapshot" in entries(manager)
        assert before == reference_before
        manager.kill()
        channel, stub = connect(manager.start().address)
        with channel:
            assert restart_state(stub) == before
            # The restored tier goes on exactly as the reference's: the same blocks, copies and hits.
            assert continue_history(stub) == reference_allocate
            after_restore = restart_state(stub)
            assert after_restore == reference_after
        manager.kill()
        channel, stub = connect(manager.start().address)
        with channel:
            assert restart_state(stub) == after_restore
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def journaled_history(manager: Manager) -> dict[str, Any]:
    server: LaunchedProcess = manager.start()
    channel, stub = connect(server.address)
    with channel:
        tier_history(stub)
        state = restart_state(stub)
    figures = state["tier"]
    assert figures["num_host_evictions"] and figures["num_onloaded_blocks"] and figures["num_pending_tier_copies"]
    return state
