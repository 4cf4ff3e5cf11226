"""A routing simulation on the Mooncake synthetic trace: cache-aware routing vs round-robin over 4 replicas.

In-process (no Redis, no server): four KVCacheManager cores, each with its
own pool, and an in-process copy of the mirror: per replica the hash counts
that MirrorWriter would publish, kept from the same core events
(BlockStored / BlockRemoved) after every scheduler step, so the router sees
the mirror with zero lag and the same chained hashes. The first
--sim-requests (default 1000) requests, scaled by --sim-scale (default
0.125: each 512-token trace block becomes 64 tokens, 4 whole 16-token
blocks, so the trace's sharing lands on block boundaries; outputs scale
likewise). Time is simulated in ticks: requests arrive at their trace
timestamps, and every tick each busy replica runs one iteration of the
reference scheduler's loop (`ReferenceScheduler`, chunked prefill under a
token budget, preemption of the newest request on NO_SPACE) over its core,
as `kv-manager replay` does. Cache-aware routing builds one `ReplicaPrefix` per
replica (leading cached blocks of the prompt, a `Lease` from the core's
stats) and calls `lookup.choose_replica` (longest prefix, ties by usage,
then requests), with leases fresh at each decision or refreshed every TTL/3
as the heartbeat does; round-robin sends request i to replica i mod 4. One
run per policy and pool size (--sim-pool-blocks, default 6000 and 12000
blocks per replica: both evict). Reported: prefix-hit tokens at first
admission and the hit rate, the hits the router expected, and the load:
requests and prompt tokens per replica (max / min), peak usage, evictions,
preemptions, queueing. Deterministic; the hit rate of one pool that never
evicts is shown as the bound.

Section 4 of `bench/mirror_bench.py`, which runs it after the measurements
against servers.

    python bench/routing_sim.py            # seconds on 2 cores
    python bench/routing_sim.py --quick    # the first 200 requests
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bench_stats import percentile
from kv_manager_service.cli.in_process import InProcessManager
from kv_manager_service.cli.replay import SampledTokenWorker
from kv_manager_service.core import BlockHasher, BlockRemoved, BlockStored, KVCacheConfig, KVCacheManager
from kv_manager_service.mirror.lookup import ReplicaPrefix, choose_replica
from kv_manager_service.mirror.schema import Lease
from kv_manager_service.workload import TRACE_BLOCK_SIZE, TokenExpander, TraceRecord, load_trace
from reference_scheduler.scheduler import ReferenceScheduler, RequestTooLargeError, Sampling, SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_SIZE = 16  # the server's default pool: one full-attention group of 16-token blocks
NUM_REPLICAS = 4  # as many as the cluster of section 3

now_ns = time.perf_counter_ns


@dataclass
class SimPlan:
    """The simulation's flags (their names are the flags'), defaults resolved."""

    sim_requests: int
    sim_scale: float
    sim_pool_blocks: tuple[int, ...]  # one simulation per pool size
    sim_token_budget: int
    sim_max_running: int
    sim_tick_ms: float
    sim_replicas: int


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The simulation's flags, in a group of their own (returned, for a caller's flags about it)."""
    sim = parser.add_argument_group("routing simulation (section 4)")
    sim.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (default: %(default)s)")
    sim.add_argument("--sim-requests", type=int, default=None, help="first N trace requests (default 1000, quick 200)")
    sim.add_argument("--sim-scale", type=float, default=0.125,
                     help="trace scale: each 512-token block becomes round(512 * SCALE) tokens (default %(default)s: "
                          "64 tokens, 4 whole blocks of 16)")
    sim.add_argument("--sim-pool-blocks", default="6000,12000",
                     help="blocks per replica's pool, comma-separated: one simulation per size (default %(default)s: "
                          "both policies evict at both)")
    sim.add_argument("--sim-token-budget", type=int, default=None,
                     help="tokens per scheduler step per replica (default round(8192 * scale))")
    sim.add_argument("--sim-max-running", type=int, default=64, help="running requests per replica (default %(default)s)")
    sim.add_argument("--sim-tick-ms", type=float, default=None,
                     help="trace milliseconds per scheduler step (default 30 / scale: a scaled step stands for "
                          "1/scale real ~30 ms steps)")
    sim.add_argument("--sim-replicas", type=int, default=NUM_REPLICAS, help="replicas (default %(default)s)")
    return sim


def plan_from_args(args: argparse.Namespace) -> SimPlan:
    return SimPlan(
        sim_requests=args.sim_requests or (200 if args.quick else 1000),
        sim_scale=args.sim_scale,
        sim_pool_blocks=tuple(int(x) for x in args.sim_pool_blocks.split(",")),
        sim_token_budget=args.sim_token_budget or round(8192 * args.sim_scale),
        sim_max_running=args.sim_max_running,
        sim_tick_ms=args.sim_tick_ms or 30 / args.sim_scale,
        sim_replicas=args.sim_replicas,
    )


class SimRequest:
    """One trace request as the simulation follows it: where it went, what the router expected, when it started."""

    __slots__ = ("index", "request_id", "arrival_tick", "prompt_len", "num_output_tokens", "token_ids", "hashes",
                 "first_hit", "expected_hit", "admit_tick", "first_token_tick", "replica")

    def __init__(self, index: int, record: TraceRecord, tick_ms: float, expander: TokenExpander,
                 hasher: BlockHasher) -> None:
        self.index = index  # also its sampling seed
        self.request_id = f"sim-{index}"
        self.arrival_tick = int(record.timestamp_ms // tick_ms)
        self.token_ids = expander.prompt_token_ids(record)
        self.prompt_len = len(self.token_ids)
        self.num_output_tokens = expander.output_length(record)
        # What a router hashes: the prompt's full blocks a hit may cover (one token is left to compute).
        self.hashes = hasher.hash_blocks(hasher.root_hash, self.token_ids)[: (self.prompt_len - 1) // BLOCK_SIZE]
        self.first_hit: int | None = None  # cached prompt tokens at its first admission
        self.expected_hit = 0
        self.admit_tick = self.first_token_tick = -1
        self.replica = -1


class SimReplica:
    """One replica: the reference scheduler's loop over a core and pool of its own (`kv-manager replay`'s
    in-process manager and synthetic worker), one step at a time, and the mirror's view of it (hash -> count
    of cached blocks carrying it, from the core's events)."""

    def __init__(self, replica_id: str, plan: SimPlan, num_blocks: int, vocab_size: int) -> None:
        self.replica_id = replica_id
        self.manager = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, enable_events=True))
        self.scheduler = ReferenceScheduler(
            InProcessManager(self.manager),
            SampledTokenWorker(vocab_size),
            SchedulerConfig(plan.sim_token_budget, plan.sim_max_running),
        )
        self.mirror: Counter[bytes] = Counter()
        self.unstarted: dict[str, SimRequest] = {}  # routed here, no token sampled yet
        self.num_routed = self.routed_tokens = self.max_waiting = 0
        self.peak_usage = 0.0

    @property
    def busy(self) -> bool:
        """Requests to run, or finished ones still to free (the next step frees them)."""
        return self.scheduler.has_work or bool(self.scheduler.to_free)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def lease(self) -> Lease:
        stats = self.manager.stats()
        return Lease(self.replica_id, 1, "", stats.num_requests, stats.usage, stats.num_free_blocks)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` in the mirror: what ClusterIndex.lookup would report."""
        mirror = self.mirror
        n = 0
        for block_hash in hashes:
            if block_hash not in mirror:
                break
            n += 1
        return n

    def route(self, request: SimRequest) -> None:
        """Queue `request` at the back of this replica's waiting requests."""
        self.scheduler.add(request.request_id, request.token_ids, request.num_output_tokens,
                           Sampling(seed=request.index))
        self.unstarted[request.request_id] = request
        self.num_routed += 1
        self.routed_tokens += request.prompt_len
        self.max_waiting = max(self.max_waiting, len(self.scheduler.waiting))

    def step(self, tick: int) -> None:
        """One iteration of the scheduler's loop, at `tick`.

        Records first admissions and first tokens on the requests, forgets
        the finished ones (the next step frees their blocks) and brings the
        mirror up to date. Exits if a request cannot fit in the pool even
        alone.
        """
        scheduler = self.scheduler
        try:
            finished = scheduler.step()
        except RequestTooLargeError as error:
            index = scheduler.sequences[error.request_id].sampling.seed
            raise SystemExit(f"sim request {index}: {error} (--sim-pool-blocks, --sim-token-budget)") from error
        self._record_starts(tick)
        self.peak_usage = max(self.peak_usage, self.manager.stats().usage)
        for request in finished:
            scheduler.discard(request.request_id)
        self._drain_events()

    def _record_starts(self, tick: int) -> None:
        """Stamp `tick` on the requests first admitted (with their prefix hit) or first sampled in this step."""
        sequences = self.scheduler.sequences
        for request_id, request in list(self.unstarted.items()):
            held = sequences[request_id]
            if request.first_hit is None and (held.running or held.num_preemptions or held.num_output_tokens):
                request.first_hit = held.num_cached_prompt_tokens
                request.admit_tick = tick
            if held.num_output_tokens:
                request.first_token_tick = tick
                del self.unstarted[request_id]

    def _drain_events(self) -> None:
        mirror = self.mirror
        for event in self.manager.take_events():
            if type(event) is BlockStored:
                for block_hash in event.block_hashes:
                    mirror[block_hash] += 1
            elif type(event) is BlockRemoved:
                for block_hash in event.block_hashes:
                    count = mirror[block_hash] - 1
                    if count:
                        mirror[block_hash] = count
                    else:
                        del mirror[block_hash]
            else:  # AllBlocksCleared: the simulation never resets the cache
                mirror.clear()


POLICIES = (
    ("cache-aware", "cache-aware: choose_replica, leases fresh at each decision"),
    ("cache-aware-stale", "cache-aware: choose_replica, leases refreshed every TTL/3 (3.33 s), as the heartbeat does"),
    ("round-robin", "round-robin"),
)
LEASE_REFRESH_MS = 10_000 / 3  # the default --lease-ttl-s 10 over the heartbeat's 3 beats per TTL


@dataclass
class SimResult:
    policy: str
    pool_blocks: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int  # at each request's first admission
    expected_hit_tokens: int  # what the router saw in the mirror when it routed
    manager_queries: int  # readmissions after preemption included
    manager_hits: int
    replicas: list[SimReplica]
    ttft_ticks: list[int]
    queue_ticks: list[int]
    route_us: list[float]
    wall_s: float
    num_ticks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens


def simulate(policy: str, pool_blocks: int, records: Sequence[TraceRecord], plan: SimPlan) -> SimResult:
    started = now_ns()
    expander = TokenExpander(scale=plan.sim_scale)
    hasher = BlockHasher(BLOCK_SIZE)
    replicas = [SimReplica(f"r{i}", plan, pool_blocks, expander.vocab_size) for i in range(plan.sim_replicas)]
    requests = [SimRequest(i, r, plan.sim_tick_ms, expander, hasher) for i, r in enumerate(records)]
    refresh_ticks = max(1, round(LEASE_REFRESH_MS / plan.sim_tick_ms))
    leases = [r.lease() for r in replicas]
    leases_tick = 0
    route_us = []
    tick = next_index = 0
    while next_index < len(requests) or any(r.busy for r in replicas):
        if not any(r.busy for r in replicas) and requests[next_index].arrival_tick > tick:
            tick = requests[next_index].arrival_tick  # idle: skip to the next arrival
        while next_index < len(requests) and requests[next_index].arrival_tick <= tick:
            request = requests[next_index]
            start = now_ns()
            if policy == "round-robin":
                target = request.index % len(replicas)
                request.expected_hit = replicas[target].cached_prefix(request.hashes) * BLOCK_SIZE
            else:
                if policy == "cache-aware":
                    leases = [r.lease() for r in replicas]
                elif tick - leases_tick >= refresh_ticks:
                    leases, leases_tick = [r.lease() for r in replicas], tick
                prefixes = [ReplicaPrefix(r.replica_id, r.cached_prefix(request.hashes), lease)
                            for r, lease in zip(replicas, leases)]
                chosen = choose_replica(prefixes)
                target = next(i for i, r in enumerate(replicas) if r.replica_id == chosen)
                request.expected_hit = prefixes[target].num_cached_blocks * BLOCK_SIZE
            route_us.append((now_ns() - start) / 1e3)
            request.replica = target
            replicas[target].route(request)
            next_index += 1
        for replica in replicas:
            if replica.busy:
                replica.step(tick)
        tick += 1
    stats = [r.manager.stats() for r in replicas]
    return SimResult(
        policy=policy,
        pool_blocks=pool_blocks,
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        hit_tokens=sum(r.first_hit for r in requests),
        expected_hit_tokens=sum(r.expected_hit for r in requests),
        manager_queries=sum(s.prefix_cache_queries for s in stats),
        manager_hits=sum(s.prefix_cache_hits for s in stats),
        replicas=replicas,
        ttft_ticks=[r.first_token_tick - r.arrival_tick for r in requests],
        queue_ticks=[r.admit_tick - r.arrival_tick for r in requests],
        route_us=route_us,
        wall_s=(now_ns() - started) / 1e9,
        num_ticks=tick,
    )


def unbounded_hits(records: Sequence[TraceRecord], plan: SimPlan) -> tuple[int, int]:
    """Hit tokens of one pool that never evicts and sees every prompt in trace order (the bound)."""
    expander = TokenExpander(scale=plan.sim_scale)
    hasher = BlockHasher(BLOCK_SIZE)
    seen: set[bytes] = set()
    hit = total = 0
    for record in records:
        tokens = expander.prompt_token_ids(record)
        hashes = hasher.hash_blocks(hasher.root_hash, tokens)
        n = 0
        for block_hash in hashes[: (len(tokens) - 1) // BLOCK_SIZE]:
            if block_hash not in seen:
                break
            n += 1
        hit += n * BLOCK_SIZE
        total += len(tokens)
        seen.update(hashes)
    return hit, total


def run_simulations(plan: SimPlan, trace: Path) -> tuple[list[SimResult], tuple[int, int]]:
    """One simulation per pool size and policy, in that order (progress on stderr); and the bound."""
    records = load_trace(trace, limit=plan.sim_requests)
    sims = []
    for pool_blocks in plan.sim_pool_blocks:
        for policy, _ in POLICIES:
            sims.append(simulate(policy, pool_blocks, records, plan))
            print(f"simulation {policy}, {pool_blocks} blocks: {sims[-1].wall_s:.1f} s, hit rate "
                  f"{sims[-1].hit_rate:.1%}", file=sys.stderr, flush=True)
    return sims, unbounded_hits(records, plan)


def render_sim(sims: Sequence[SimResult], bound: tuple[int, int], plan: SimPlan, trace: Path) -> list[str]:
    scaled_block = round(TRACE_BLOCK_SIZE * plan.sim_scale)
    labels = dict(POLICIES)

    def spread(values: Sequence[float], percent: bool = False) -> str:
        body = " / ".join(f"{v:.0%}" if percent else f"{v:,}" for v in values)
        low, high = min(values), max(values)
        return f"{body} ({high / low:.2f})" if low else f"{body} (inf)"

    first = sims[0]
    refresh_ticks = max(1, round(LEASE_REFRESH_MS / plan.sim_tick_ms))
    lines = [
        "",
        f"## 4. Routing simulation: the first {first.num_requests} Mooncake requests over {plan.sim_replicas} replicas",
        "",
        f"Trace `{trace.name}` scaled by {plan.sim_scale} (every 512-token trace block becomes {scaled_block} "
        f"tokens, outputs likewise: {first.prompt_tokens:,} prompt tokens); block {BLOCK_SIZE}. Per replica an "
        f"in-process KVCacheManager with its own pool, the reference scheduler's loop as `kv-manager replay` runs it "
        f"(token budget {plan.sim_token_budget} per step, <= {plan.sim_max_running} running, chunked prefill, "
        "preemption of the newest request on NO_SPACE; finished requests are freed with the next step), one step "
        f"per busy replica per tick; requests arrive at their trace timestamps, one tick = {plan.sim_tick_ms:g} ms "
        "(a scaled step stands for 1/scale real steps of ~30 ms). The router reads an in-process copy of the "
        "mirror: per replica the cached hash counts kept from its core's BlockStored / BlockRemoved events after "
        "every step (what MirrorWriter publishes, with zero lag), and Leases from each core's stats (num_requests, "
        f"usage) either fresh at each decision or refreshed every {refresh_ticks} ticks (TTL/3 of the default 10 s "
        "lease, like the heartbeat). It calls `lookup.choose_replica` on ReplicaPrefix values (longest cached "
        "prefix, ties to the lowest usage, then fewest requests, then replica id). Round-robin sends request i to "
        f"replica i mod {plan.sim_replicas}. Deterministic: one run each. Bound: one pool that never evicts and sees "
        f"every prompt in trace order hits {bound[0]:,} tokens ({bound[0] / bound[1]:.1%}).",
        "",
        "Per-replica columns list r0 / r1 / r2 / r3, then (max / min). Hits are counted at each request's first "
        "admission; 'router saw' is the prefix the mirror showed for the chosen replica when routing.",
        "",
        "| pool / replica | policy | prefix-hit tokens | hit rate | vs round-robin | router saw | requests per "
        "replica | prompt tokens per replica | peak usage per replica | evictions | preemptions | longest queue "
        "| queue p50 / p99 | first token p50 / p99 | route p50 / p99 |",
        "|---:|---|---:|---:|---:|---:|---|---|---|---:|---:|---|---|---|---|",
    ]
    rr_hits = {r.pool_blocks: r.hit_tokens for r in sims if r.policy == "round-robin"}
    for r in sims:
        reps = r.replicas
        base = rr_hits.get(r.pool_blocks)
        vs = f"{r.hit_tokens / base:.2f}x" if base else ""
        lines.append(
            f"| {r.pool_blocks:,} | {labels[r.policy]} | {r.hit_tokens:,} | {r.hit_rate:.1%} | {vs} | "
            f"{r.expected_hit_tokens:,} | {spread([x.num_routed for x in reps])} | "
            f"{spread([x.routed_tokens for x in reps])} | {spread([x.peak_usage for x in reps], True)} | "
            f"{sum(x.manager.stats().num_evictions for x in reps):,} | {sum(x.num_preemptions for x in reps)} | "
            f"{' / '.join(str(x.max_waiting) for x in reps)} | "
            f"{percentile(r.queue_ticks, 50):,} / {percentile(r.queue_ticks, 99):,} ticks | "
            f"{percentile(r.ttft_ticks, 50):,} / {percentile(r.ttft_ticks, 99):,} ticks | "
            f"{statistics.median(r.route_us):.1f} / {percentile(r.route_us, 99):.1f} us |"
        )
    lines += [
        "",
        f"Simulation wall time: {sum(r.wall_s for r in sims):.1f} s for {len(sims)} runs; the route column times "
        "the router in-process (prefix count per replica over the in-process mirror, leases, choose_replica), "
        "not a Redis read (section 3 times that).",
    ]
    return lines


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: fewer requests")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    plan = plan_from_args(args)
    sims, bound = run_simulations(plan, args.trace)
    command = shlex.join(["python", *sys.argv])
    print("\n".join(["# Routing simulation", "", f"Command: `{command}`", *render_sim(sims, bound, plan, args.trace)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
