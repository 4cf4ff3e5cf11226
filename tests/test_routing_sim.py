"""The routing simulation's logic on tiny synthetic traces: routers, stale leases, and the Redis command count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench scripts import each other by their bare names

import routing_sim  # noqa: E402
from routing_ops import HEARTBEAT_COMMANDS, WRITES, RedisOps, lookup_commands, served  # noqa: E402
from routing_router import InFlightRouter, LeaseBoard, LeaseRouter, RoundRobinRouter  # noqa: E402

from kv_manager_service.mirror.lookup import ReplicaPrefix, choose_replica  # noqa: E402
from kv_manager_service.mirror.schema import Lease  # noqa: E402
from kv_tooling.workload import TraceRecord  # noqa: E402

NUM_REPLICAS = 4


def plan(**overrides) -> routing_sim.SimPlan:
    args = routing_sim.make_parser().parse_args(["--replicas", str(NUM_REPLICAS)])
    result = routing_sim.plan_from_args(args)
    return routing_sim.SimPlan(**{**result.__dict__, "sim_jobs": 1, **overrides})


def idle_lease(replica_id: str) -> Lease:
    return Lease(replica_id, 1, "", num_requests=0, usage=0.0, num_free_blocks=100)


def prefixes(cached_blocks: list[int]) -> list[ReplicaPrefix]:
    """The mirror's answer when every lease is as the last heartbeat left it: idle."""
    return [ReplicaPrefix(f"r{i}", n, idle_lease(f"r{i}")) for i, n in enumerate(cached_blocks)]


def route_burst(router, answer: list[ReplicaPrefix], num_requests: int) -> list[int]:
    """Requests routed back to back, none finished, the leases unchanged (stale): requests per replica."""
    counts = [0] * len(answer)
    for _ in range(num_requests):
        target = router.choose(answer)
        router.routed(target)
        counts[target] += 1
    return counts


def synthetic_trace(num_groups: int, num_turns: int, gap_ms: int) -> list[TraceRecord]:
    """`num_groups` conversations of `num_turns` turns, every turn repeating its group's 6-block prefix.

    Each turn takes the groups in an order rotated by one, so round-robin
    sends a group's turns to 4 different replicas before it repeats one.
    """
    records = []
    for turn in range(num_turns):
        for position in range(num_groups):
            group = (position + turn) % num_groups
            prefix = tuple(1000 * group + k for k in range(6))
            unique = 100_000 + turn * num_groups + position
            records.append(TraceRecord((turn * num_groups + position) * gap_ms, 7 * 512, 64, (*prefix, unique)))
    return records


def run(policy: str, records: list[TraceRecord], sim_plan: routing_sim.SimPlan, pool_blocks: int = 400):
    prompts, vocab_size = routing_sim.expand_trace(records, sim_plan.sim_scale)
    return prompts, routing_sim.simulate(policy, NUM_REPLICAS, pool_blocks, prompts, vocab_size, sim_plan)


def test_a_burst_on_stale_leases_piles_onto_one_replica_unless_the_router_counts_its_in_flight() -> None:
    answer = prefixes([0, 0, 0, 0])  # a burst of new prompts: nothing cached anywhere yet
    assert route_burst(LeaseRouter(["r0", "r1", "r2", "r3"]), answer, 8) == [8, 0, 0, 0]
    assert route_burst(InFlightRouter(NUM_REPLICAS, slack=2, share_slack=0.15), answer, 8) == [2, 2, 2, 2]


def test_an_identical_prefix_burst_prefers_its_holder_within_the_load_bounds() -> None:
    answer = prefixes([10, 0, 0, 0])  # r0 holds the burst's prefix
    assert route_burst(LeaseRouter(["r0", "r1", "r2", "r3"]), answer, 12) == [12, 0, 0, 0]
    counts = route_burst(InFlightRouter(NUM_REPLICAS, slack=2, share_slack=0.15), answer, 12)
    assert counts[0] == max(counts) and min(counts) >= 2 and sum(counts) == 12
    assert counts[0] <= 1.15 * 12 / NUM_REPLICAS + 1


def test_finished_requests_free_their_slot_in_the_routers_count() -> None:
    router = InFlightRouter(NUM_REPLICAS, slack=0, share_slack=10.0)
    answer = prefixes([5, 0, 0, 0])
    assert route_burst(router, answer, 2) == [1, 1, 0, 0]
    router.finished(0)
    assert router.in_flight == [0, 1, 0, 0] and router.choose(answer) == 0
    with pytest.raises(AssertionError, match="did not route"):
        router.finished(2)


def test_the_in_flight_router_ranks_prefixes_as_choose_replica_does_when_loads_are_equal() -> None:
    for cached in ([0, 3, 3, 1], [2, 2, 2, 2], [0, 0, 9, 0], [7, 1, 0, 7]):
        answer = prefixes(cached)
        expected = int(choose_replica(answer)[1:])
        assert InFlightRouter(NUM_REPLICAS, slack=0, share_slack=0.0).choose(answer) == expected


def test_round_robin_cycles() -> None:
    assert route_burst(RoundRobinRouter(3), prefixes([0, 0, 0]), 7) == [3, 2, 2]


def test_each_replica_beats_once_per_refresh_on_its_own_phase() -> None:
    board = LeaseBoard([idle_lease(f"r{i}") for i in range(4)], refresh_ticks=6)
    beats = [board.due(tick) for tick in range(12)]
    assert sorted(i for due in beats for i in due) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [t for t, due in enumerate(beats) if 2 in due] == [3, 9]
    with pytest.raises(ValueError, match="refresh_ticks must be >= 1, got 0"):
        LeaseBoard([], refresh_ticks=0)


def test_the_simulated_burst_spreads_with_the_in_flight_router_and_piles_up_without() -> None:
    records = [TraceRecord(0, 3 * 512, 64, (1, 2, 3)) for _ in range(8)]  # one identical-prefix burst, tick 0
    sim_plan = plan()
    assert run("lease", records, sim_plan)[1].num_routed == [8, 0, 0, 0]
    spread = run("in-flight", records, sim_plan)[1]
    assert max(spread.num_routed) <= 1.15 * 8 / NUM_REPLICAS + 1 and min(spread.num_routed) >= 1


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    records = synthetic_trace(num_groups=8, num_turns=5, gap_ms=500)
    sim_plan = plan()
    _, round_robin = run("round-robin", records, sim_plan)
    _, in_flight = run("in-flight", records, sim_plan)
    assert in_flight.hit_tokens >= 3 * round_robin.hit_tokens > 0
    assert in_flight.load_max_over_mean <= 1.2
    assert in_flight.prompt_tokens == round_robin.prompt_tokens == 40 * 7 * 64


def test_the_redis_command_count_adds_up() -> None:
    sim_plan = plan()
    prompts, result = run("in-flight", synthetic_trace(num_groups=8, num_turns=5, gap_ms=300), sim_plan, 64)
    ops = result.ops
    per_sim_block = 1 / sim_plan.sim_scale
    assert result.num_evictions > 0  # the small pools evict: HDELs happen
    # Writes: what the HSETs added and the HDELs did not take back is what the mirrors hold at the end.
    assert ops.total("hset") - ops.total("hdel") == pytest.approx(result.num_cached_hashes * per_sim_block)
    assert ops.total("hdel") > 0
    # Lookups: SMEMBERS, a lease GET per replica, an HGETALL per real prompt block, per request.
    assert ops.num_lookups == len(prompts)
    assert ops.total("lookup per-block") == sum(1 + NUM_REPLICAS + p.num_real_blocks for p in prompts)
    assert ops.total("lookup early-stop") <= ops.total("lookup chunked") <= ops.total("lookup per-block")
    assert ops.total("lookup early-stop") < ops.total("lookup per-block")
    # Heartbeats: every replica once per refresh, idle ticks included.
    board = LeaseBoard([idle_lease(f"r{i}") for i in range(NUM_REPLICAS)], sim_plan.refresh_ticks)
    beats = sum(len(board.due(t)) for t in range(result.num_ticks))
    assert ops.total("heartbeat") == HEARTBEAT_COMMANDS * beats
    # Rates: the kinds add up, over the span of the arrivals.
    assert ops.span_ticks == int(prompts[-1].timestamp_ms // sim_plan.sim_tick_ms) + 1
    for design in ("per-block", "chunked"):
        assert ops.rate(*served(design)) == pytest.approx(sum(ops.rate(kind) for kind in served(design)))
        assert ops.peak_rate(*served(design)) >= ops.rate(*served(design)) > ops.rate(*WRITES) > 0


def test_rates_and_peaks_by_hand() -> None:
    ops = RedisOps(tick_s=0.5, window_ticks=2)
    ops.add_writes(0, 10, 2)
    ops.add_writes(3, 6, 0)
    ops.add_heartbeats(1, 4)
    ops.add_lookup(2, num_prompt_blocks=100, num_replicas=4, longest_prefix_blocks=9)
    ops.span_ticks = 4  # 2 s
    assert ops.total(*WRITES) == 18 and ops.total("heartbeat") == 8
    assert ops.total("lookup per-block") == 105 and ops.total("lookup early-stop") == 15
    assert ops.total("lookup chunked") == 1 + 4 + 64
    assert ops.rate(*served("per-block")) == (18 + 8 + 105) / 2
    assert ops.peak_rate(*served("per-block")) == (105 + 6) / 1.0  # ticks 2 and 3, one second


def test_lookup_designs() -> None:
    assert lookup_commands("per-block", 512, 64, 0) == 1 + 64 + 512
    assert lookup_commands("early-stop", 512, 64, 40) == 1 + 64 + 41
    assert lookup_commands("early-stop", 512, 64, 512) == 1 + 64 + 512
    # Chunks end at 64, 512, 4096 blocks: a chunk is read while some replica matched all blocks before it.
    assert lookup_commands("chunked", 958, 4, 0) == 1 + 4 + 64
    assert lookup_commands("chunked", 958, 4, 63) == 1 + 4 + 64
    assert lookup_commands("chunked", 958, 4, 64) == 1 + 4 + 512
    assert lookup_commands("chunked", 958, 4, 512) == 1 + 4 + 958
    assert lookup_commands("chunked", 40, 4, 40) == 1 + 4 + 40
    with pytest.raises(ValueError, match="lookup design 'bulk' is not supported; choose one of per-block, chunked"):
        lookup_commands("bulk", 1, 1, 0)


def test_the_flags() -> None:
    help_text = routing_sim.make_parser().format_help()
    for flag in ("--replicas", "--sim-policies", "--sim-slack", "--sim-share-slack", "--sim-pool-blocks", "--sim-jobs"):
        assert flag in help_text
    args = routing_sim.make_parser().parse_args(["--replicas", "4,16,64", "--sim-policies", "round-robin,in-flight"])
    parsed = routing_sim.plan_from_args(args)
    assert parsed.sim_replicas == (4, 16, 64) and parsed.sim_policies == ("round-robin", "in-flight")
    with pytest.raises(ValueError, match="--sim-policies: 'random' is not supported; choose from round-robin, lease"):
        plan(sim_policies=("random",))
