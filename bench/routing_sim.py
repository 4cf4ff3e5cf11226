"""A routing simulation on the Mooncake synthetic trace: cache-aware routing vs round-robin at 4, 16 and 64 replicas.

In-process (no Redis, no server): R KVCacheManager cores, each with its own
pool, and an in-process copy of the mirror: per replica the hash counts that
MirrorWriter would publish, kept from the same core events (BlockStored /
BlockRemoved) after every scheduler step, so the router sees the mirror with
zero lag and the same chained hashes. The trace (every request by default)
is scaled by --sim-scale (default 0.125: each 512-token trace block becomes
64 tokens, 4 whole 16-token blocks, so the trace's sharing lands on block
boundaries; outputs scale likewise). Time is simulated in ticks: every tick
each busy replica runs one iteration of the reference scheduler's loop
(`ReferenceScheduler`, chunked prefill under a token budget, preemption of
the newest request on NO_SPACE) over its core, as `kv-manager replay` does.

Load grows with the replicas: R replicas serve the trace at R / base times
its recorded rate (--sim-base-replicas, default 4: the arrival timestamps are
divided by R / 4), so every replica sees the same request rate at every
size, as a deployment that adds replicas for more users would.

Routers (`routing_router.py`), each run on the same arrivals: round-robin;
`lookup.choose_replica` on the mirror's answer with the leases the
heartbeats last wrote (every TTL/3, each replica on its own phase) or, as an
ideal, with fresh ones; and the in-flight router, which counts its own
in-flight requests per replica next to the lease's stale figure, takes the
longest prefix among the replicas within --sim-slack requests of the least
loaded, and keeps each replica's count of requests within --sim-share-slack
of the mean. The Redis commands the index needs are counted as it runs
(`routing_ops.py`), in real blocks.

Reported per size: prefix-hit tokens at first admission and the ratio to
round-robin, requests per replica (max / mean), queueing, and Redis
commands per second: writes, heartbeats and lookups. Deterministic; the
hit rate of one pool that never evicts is shown as the bound.

Section 4 of `bench/mirror_bench.py`, which runs it after the measurements
against servers.

    python bench/routing_sim.py                       # 4, 16 and 64 replicas, the whole trace
    python bench/routing_sim.py --replicas 4 --quick  # a smoke run: the first 400 requests
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bench_stats import percentile
from routing_ops import LOOKUP_DESIGNS, WRITES, RedisOps, served
from routing_router import InFlightRouter, LeaseBoard, LeaseRouter, RoundRobinRouter, Router
from kv_tooling.in_process import InProcessManager
from kv_tooling.replay import SampledTokenWorker
from kv_manager_service.core import BlockHasher, BlockRemoved, BlockStored, KVCacheConfig, KVCacheManager
from kv_manager_service.mirror.lookup import ReplicaPrefix
from kv_manager_service.mirror.schema import Lease
from kv_tooling.workload import DEFAULT_TRACE, TRACE_BLOCK_SIZE, TokenExpander, TraceRecord, load_trace
from reference_scheduler.scheduler import ReferenceScheduler, RequestTooLargeError, Sampling, SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16  # the server's default pool: one full-attention group of 16-token blocks
LEASE_TTL_S = 10.0  # the server's default --lease-ttl-s; the heartbeat beats 3 times per TTL
KV_BYTES_PER_TOKEN = 131_072  # Llama-3-8B: 32 layers x K and V x 8 KV heads x 128 x 2 bytes

POLICIES = {
    "round-robin": "round-robin",
    "lease": "cache-aware: choose_replica, leases as the last heartbeat (TTL/3) wrote them",
    "lease-fresh": "cache-aware: choose_replica, leases fresh at each decision (an ideal)",
    "in-flight": "cache-aware: in-flight router (own in-flight + lease load within {slack} of the least loaded, "
                 "requests within {share:.0%} of the mean + 1)",
}
DEFAULT_POLICIES = "round-robin,lease,in-flight"

now_ns = time.perf_counter_ns


@dataclass(frozen=True)
class SimPlan:
    """The simulation's flags (their names are the flags'), defaults resolved."""

    sim_requests: int | None  # None: the whole trace
    sim_scale: float
    sim_pool_blocks: tuple[int, ...]  # one simulation per pool size
    sim_token_budget: int
    sim_max_running: int
    sim_tick_ms: float
    sim_replicas: tuple[int, ...]  # one simulation per replica count
    sim_base_replicas: int
    sim_policies: tuple[str, ...]
    sim_slack: int
    sim_share_slack: float
    sim_jobs: int

    def __post_init__(self) -> None:
        for policy in self.sim_policies:
            if policy not in POLICIES:
                raise ValueError(f"--sim-policies: {policy!r} is not supported; choose from {', '.join(POLICIES)}")
        if min(self.sim_replicas, default=0) < 1:
            raise ValueError(f"--sim-replicas must be positive counts, got {self.sim_replicas}")
        if self.sim_base_replicas < 1:
            raise ValueError(f"--sim-base-replicas must be >= 1, got {self.sim_base_replicas}")
        if self.sim_slack < 0:
            raise ValueError(f"--sim-slack must be >= 0 requests, got {self.sim_slack}")
        if self.sim_share_slack < 0:
            raise ValueError(f"--sim-share-slack must be >= 0 (a fraction of the mean), got {self.sim_share_slack}")
        if self.sim_jobs < 1:
            raise ValueError(f"--sim-jobs must be >= 1 processes, got {self.sim_jobs}")

    @property
    def refresh_ticks(self) -> int:
        """Ticks between two heartbeats of one replica: TTL/3 of the default lease."""
        return max(1, round(LEASE_TTL_S * 1000 / 3 / self.sim_tick_ms))

    @property
    def window_ticks(self) -> int:
        """Ticks of the window the peak command rate is taken over: about one second."""
        return max(1, round(1000 / self.sim_tick_ms))


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The simulation's flags, in a group of their own (returned, for a caller's flags about it)."""
    sim = parser.add_argument_group("routing simulation (section 4)")
    sim.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (default: %(default)s)")
    sim.add_argument("--sim-requests", type=int, default=None,
                     help="first N trace requests (default: all 3,993; quick: 400)")
    sim.add_argument("--sim-replicas", "--replicas", type=_counts, default=(4, 16, 64),
                     help="replica counts, comma-separated: one simulation per count and policy (default 4,16,64)")
    sim.add_argument("--sim-base-replicas", type=int, default=4,
                     help="the replica count that serves the trace at its recorded rate; R replicas get R / BASE "
                          "times that rate, the same per replica (default %(default)s)")
    sim.add_argument("--sim-policies", default=DEFAULT_POLICIES,
                     help=f"routers, comma-separated, from {', '.join(POLICIES)} (default %(default)s)")
    sim.add_argument("--sim-slack", type=int, default=2,
                     help="in-flight router: candidates are the replicas within SLACK requests of the least loaded "
                          "(default %(default)s)")
    sim.add_argument("--sim-share-slack", type=float, default=0.15,
                     help="in-flight router: a replica takes a request only while its count of routed requests stays "
                          "within (1 + SHARE_SLACK) x the mean, plus one (default %(default)s)")
    sim.add_argument("--sim-jobs", type=int, default=min(2, os.cpu_count() or 1),
                     help="simulations run in parallel, one process each (default %(default)s: up to 2 cores)")
    sim.add_argument("--sim-scale", type=float, default=0.125,
                     help="trace scale: each 512-token block becomes round(512 * SCALE) tokens (default %(default)s: "
                          "64 tokens, 4 whole blocks of 16)")
    sim.add_argument("--sim-pool-blocks", type=_counts, default=(2000, 4000),
                     help="blocks per replica's pool, comma-separated: one simulation per size (default 2000,4000: "
                          "at scale 0.125 they stand for 256k and 512k real tokens, 31 and 62 GiB of Llama-3-8B KV)")
    sim.add_argument("--sim-token-budget", type=int, default=None,
                     help="tokens per scheduler step per replica (default round(8192 * scale))")
    sim.add_argument("--sim-max-running", type=int, default=64, help="running requests per replica (default %(default)s)")
    sim.add_argument("--sim-tick-ms", type=float, default=None,
                     help="trace milliseconds per scheduler step (default 30 / scale: a scaled step stands for "
                          "1/scale real ~30 ms steps)")
    return sim


def plan_from_args(args: argparse.Namespace) -> SimPlan:
    return SimPlan(
        sim_requests=args.sim_requests or (400 if args.quick else None),
        sim_scale=args.sim_scale,
        sim_pool_blocks=tuple(args.sim_pool_blocks),
        sim_token_budget=args.sim_token_budget or round(8192 * args.sim_scale),
        sim_max_running=args.sim_max_running,
        sim_tick_ms=args.sim_tick_ms or 30 / args.sim_scale,
        sim_replicas=tuple(args.sim_replicas),
        sim_base_replicas=args.sim_base_replicas,
        sim_policies=tuple(args.sim_policies.split(",")),
        sim_slack=args.sim_slack,
        sim_share_slack=args.sim_share_slack,
        sim_jobs=args.sim_jobs,
    )


class TracePrompt:
    """One trace request expanded once for every run: its tokens, the hashes a router looks up, its real size."""

    __slots__ = ("index", "timestamp_ms", "token_ids", "hashes", "num_output_tokens", "num_real_blocks")

    def __init__(self, index: int, record: TraceRecord, expander: TokenExpander, hasher: BlockHasher) -> None:
        self.index = index  # also its sampling seed
        self.timestamp_ms = record.timestamp_ms
        self.token_ids = expander.prompt_token_ids(record)
        self.num_output_tokens = expander.output_length(record)
        # What a router hashes: the prompt's full blocks a hit may cover (one token is left to compute).
        self.hashes = hasher.hash_blocks(hasher.root_hash, self.token_ids)[: (len(self.token_ids) - 1) // BLOCK_SIZE]
        self.num_real_blocks = (record.input_length - 1) // BLOCK_SIZE  # what the unscaled lookup reads


def expand_trace(records: Sequence[TraceRecord], scale: float) -> tuple[list[TracePrompt], int]:
    """The records as prompts, and the vocabulary size their tokens come from."""
    expander = TokenExpander(scale=scale)
    hasher = BlockHasher(BLOCK_SIZE)
    return [TracePrompt(i, r, expander, hasher) for i, r in enumerate(records)], expander.vocab_size


class SimRequest:
    """One trace request in one run: where it went, what the router expected, when it started."""

    __slots__ = ("prompt", "request_id", "arrival_tick", "first_hit", "expected_hit", "admit_tick",
                 "first_token_tick", "replica")

    def __init__(self, prompt: TracePrompt, arrival_tick: int) -> None:
        self.prompt = prompt
        self.request_id = f"sim-{prompt.index}"
        self.arrival_tick = arrival_tick
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
        prompt = request.prompt
        self.scheduler.add(request.request_id, prompt.token_ids, prompt.num_output_tokens, Sampling(seed=prompt.index))
        self.unstarted[request.request_id] = request
        self.num_routed += 1
        self.routed_tokens += len(prompt.token_ids)
        self.max_waiting = max(self.max_waiting, len(self.scheduler.waiting))

    def step(self, tick: int) -> tuple[int, int, int]:
        """One iteration of the scheduler's loop, at `tick`: (requests finished, HSETs, HDELs) of this step.

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
        num_hset, num_hdel = self._drain_events()
        return len(finished), num_hset, num_hdel

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

    def _drain_events(self) -> tuple[int, int]:
        """Apply the step's events to the mirror; the hashes it gained (HSETs) and lost (HDELs), net over the step."""
        mirror = self.mirror
        was_cached: dict[bytes, bool] = {}
        for event in self.manager.take_events():
            if type(event) is BlockStored:
                for block_hash in event.block_hashes:
                    if block_hash not in was_cached:
                        was_cached[block_hash] = block_hash in mirror
                    mirror[block_hash] += 1
            elif type(event) is BlockRemoved:
                for block_hash in event.block_hashes:
                    if block_hash not in was_cached:
                        was_cached[block_hash] = block_hash in mirror
                    count = mirror[block_hash] - 1
                    if count:
                        mirror[block_hash] = count
                    else:
                        del mirror[block_hash]
            else:  # AllBlocksCleared: the simulation never resets the cache
                raise AssertionError(f"unexpected event {event!r}")
        num_hset = sum(1 for h, cached in was_cached.items() if not cached and h in mirror)
        num_hdel = sum(1 for h, cached in was_cached.items() if cached and h not in mirror)
        return num_hset, num_hdel


@dataclass
class SimResult:
    """One run's figures (no cores: results cross process boundaries). Per-replica lists are in replica order."""

    policy: str
    num_replicas: int
    pool_blocks: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int  # at each request's first admission
    expected_hit_tokens: int  # what the router saw in the mirror when it routed
    num_routed: list[int]
    routed_tokens: list[int]
    in_flight_ticks: list[int]  # the router's in-flight count there, summed over ticks
    num_evictions: int
    num_preemptions: int
    num_cached_hashes: int  # in the replicas' mirrors at the end, summed: what the HSETs minus the HDELs left
    ttft_ticks: list[int]
    queue_ticks: list[int]
    ops: RedisOps
    wall_s: float
    num_ticks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens

    @property
    def load_max_over_mean(self) -> float:
        """Requests routed to the busiest replica over the mean: the balance target."""
        return max(self.num_routed) * self.num_replicas / sum(self.num_routed)


def make_router(policy: str, replica_ids: Sequence[str], plan: SimPlan) -> Router:
    if policy == "round-robin":
        return RoundRobinRouter(len(replica_ids))
    if policy in ("lease", "lease-fresh"):
        return LeaseRouter(replica_ids)
    return InFlightRouter(len(replica_ids), plan.sim_slack, plan.sim_share_slack)


def simulate(policy: str, num_replicas: int, pool_blocks: int, prompts: Sequence[TracePrompt], vocab_size: int,
             plan: SimPlan) -> SimResult:
    """One run: the prompts arrive at their (rate-scaled) timestamps, `policy` routes them over `num_replicas`."""
    started = now_ns()
    replicas = [SimReplica(f"r{i}", plan, pool_blocks, vocab_size) for i in range(num_replicas)]
    router = make_router(policy, [r.replica_id for r in replicas], plan)
    board = LeaseBoard([r.lease() for r in replicas], plan.refresh_ticks)
    blocks_per_sim_block = 1 / plan.sim_scale
    ops = RedisOps(plan.sim_tick_ms / 1000, plan.window_ticks)
    ms_per_tick = plan.sim_tick_ms * num_replicas / plan.sim_base_replicas  # in trace time
    requests = [SimRequest(p, int(p.timestamp_ms // ms_per_tick)) for p in prompts]
    in_flight_ticks = [0] * num_replicas
    tick = next_index = 0
    while next_index < len(requests) or any(r.busy for r in replicas):
        beating = board.due(tick)  # idle ticks too: heartbeats never pause
        for i in beating:
            board.publish(i, replicas[i].lease())
        ops.add_heartbeats(tick, len(beating))
        while next_index < len(requests) and requests[next_index].arrival_tick <= tick:
            request = requests[next_index]
            hashes = request.prompt.hashes
            if router.reads_prefixes:
                leases = [r.lease() for r in replicas] if policy == "lease-fresh" else board.leases
                prefixes = [ReplicaPrefix(r.replica_id, r.cached_prefix(hashes), lease)
                            for r, lease in zip(replicas, leases)]
                target = router.choose(prefixes)
                request.expected_hit = prefixes[target].num_cached_blocks * BLOCK_SIZE
                longest = max(p.num_cached_blocks for p in prefixes)
                ops.add_lookup(tick, request.prompt.num_real_blocks, num_replicas, longest * blocks_per_sim_block)
            else:
                target = router.choose(())
                request.expected_hit = replicas[target].cached_prefix(hashes) * BLOCK_SIZE
            router.routed(target)
            request.replica = target
            replicas[target].route(request)
            next_index += 1
        for index, replica in enumerate(replicas):
            if replica.busy:
                num_finished, num_hset, num_hdel = replica.step(tick)
                for _ in range(num_finished):
                    router.finished(index)
                if num_hset or num_hdel:
                    ops.add_writes(tick, num_hset * blocks_per_sim_block, num_hdel * blocks_per_sim_block)
        in_flight_ticks = [t + n for t, n in zip(in_flight_ticks, router.in_flight)]
        tick += 1
    ops.span_ticks = requests[-1].arrival_tick + 1 if requests else 0
    return SimResult(
        policy=policy,
        num_replicas=num_replicas,
        pool_blocks=pool_blocks,
        num_requests=len(requests),
        prompt_tokens=sum(len(p.token_ids) for p in prompts),
        hit_tokens=sum(r.first_hit for r in requests),
        expected_hit_tokens=sum(r.expected_hit for r in requests),
        num_routed=[r.num_routed for r in replicas],
        routed_tokens=[r.routed_tokens for r in replicas],
        in_flight_ticks=in_flight_ticks,
        num_evictions=sum(r.manager.stats().num_evictions for r in replicas),
        num_preemptions=sum(r.num_preemptions for r in replicas),
        num_cached_hashes=sum(len(r.mirror) for r in replicas),
        ttft_ticks=[r.first_token_tick - r.arrival_tick for r in requests],
        queue_ticks=[r.admit_tick - r.arrival_tick for r in requests],
        ops=ops,
        wall_s=(now_ns() - started) / 1e9,
        num_ticks=tick,
    )


def unbounded_hits(prompts: Sequence[TracePrompt]) -> tuple[int, int, int]:
    """The bound: hit tokens of one pool that never evicts and sees every prompt in trace order; the prompt
    tokens; and the distinct blocks that pool would hold."""
    seen: set[bytes] = set()
    hit = total = 0
    for prompt in prompts:
        n = 0
        for block_hash in prompt.hashes:
            if block_hash not in seen:
                break
            n += 1
        hit += n * BLOCK_SIZE
        total += len(prompt.token_ids)
        seen.update(prompt.hashes)
    return hit, total, len(seen)


_shared_prompts: tuple[list[TracePrompt], int] = ([], 0)  # the expanded trace, inherited by forked workers


def _simulate_shared(policy: str, num_replicas: int, pool_blocks: int, plan: SimPlan) -> SimResult:
    prompts, vocab_size = _shared_prompts
    return simulate(policy, num_replicas, pool_blocks, prompts, vocab_size, plan)


def run_simulations(plan: SimPlan, trace: Path) -> tuple[list[SimResult], tuple[int, int, int]]:
    """One simulation per pool size, replica count and policy, in that order, `plan.sim_jobs` at a time
    (progress on stderr as they finish); and the bound (`unbounded_hits`)."""
    global _shared_prompts
    records = load_trace(trace, limit=plan.sim_requests)
    print(f"routing simulation: expanding {len(records):,} trace requests", file=sys.stderr, flush=True)
    _shared_prompts = expand_trace(records, plan.sim_scale)
    runs = [(p, n, b) for b in plan.sim_pool_blocks for n in plan.sim_replicas for p in plan.sim_policies]
    results: dict[int, SimResult] = {}

    def report(index: int, result: SimResult) -> None:
        results[index] = result
        print(f"simulation {len(results)}/{len(runs)} done: {result.num_replicas} replicas, {result.policy}, "
              f"{result.pool_blocks} blocks: {result.wall_s:.1f} s, hit rate {result.hit_rate:.1%}, requests "
              f"max/mean {result.load_max_over_mean:.2f}", file=sys.stderr, flush=True)

    if plan.sim_jobs == 1:
        for index, run in enumerate(runs):
            report(index, _simulate_shared(*run, plan))
    else:
        # Forked workers inherit the expanded trace; the longest runs (most replicas) start first.
        order = sorted(range(len(runs)), key=lambda i: -runs[i][1])
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(plan.sim_jobs, mp_context=context) as pool:
            futures = {pool.submit(_simulate_shared, *runs[i], plan): i for i in order}
            for future in as_completed(futures):
                report(futures[future], future.result())
    return [results[i] for i in range(len(runs))], unbounded_hits(_shared_prompts[0])


def _ratio(values: Sequence[float]) -> str:
    mean = sum(values) / len(values)
    return f"{max(values) / mean:.2f} / {min(values) / mean:.2f}" if mean else "-"


def render_sim(sims: Sequence[SimResult], bound: tuple[int, int, int], plan: SimPlan, trace: Path) -> list[str]:
    """The section's markdown: the setup, per pool size a routing table and a Redis table, and the targets."""
    scaled_block = round(TRACE_BLOCK_SIZE * plan.sim_scale)
    labels = {k: v.format(slack=plan.sim_slack, share=plan.sim_share_slack) for k, v in POLICIES.items()}
    first = sims[0]
    sizes = ", ".join(str(n) for n in plan.sim_replicas)
    pools = " and ".join(f"{n:,}" for n in plan.sim_pool_blocks)
    real_tokens = [n * BLOCK_SIZE / plan.sim_scale for n in plan.sim_pool_blocks]
    real_text = " and ".join(f"{t / 1e3:,.0f}k" for t in real_tokens)
    gib_text = " and ".join(f"{t * KV_BYTES_PER_TOKEN / 2**30:,.0f}" for t in real_tokens)
    largest = max(plan.sim_replicas)
    aggregate = " and ".join(f"{largest * n:,}" for n in plan.sim_pool_blocks)
    lines = [
        "",
        f"## 4. Routing simulation: {first.num_requests:,} Mooncake requests over {sizes} replicas",
        "",
        f"Trace `{trace.name}` scaled by {plan.sim_scale} (every 512-token trace block becomes {scaled_block} "
        f"tokens, outputs likewise: {first.prompt_tokens:,} prompt tokens); block {BLOCK_SIZE}. Per replica an "
        f"in-process KVCacheManager with its own pool, the reference scheduler's loop as `kv-manager replay` runs it "
        f"(token budget {plan.sim_token_budget} per step, <= {plan.sim_max_running} running, chunked prefill, "
        "preemption of the newest request on NO_SPACE; finished requests are freed with the next step), one step "
        f"per busy replica per tick, one tick = {plan.sim_tick_ms:g} ms (a scaled step stands for 1/scale real "
        f"steps of ~30 ms). R replicas serve the trace at R/{plan.sim_base_replicas} times its recorded rate "
        "(timestamps divided by that), so each replica sees the same request rate at every size. Pools of "
        f"{pools} blocks per replica stand for {real_text} real tokens ({gib_text} GiB of Llama-3-8B KV at "
        "128 KiB per token: what a 40-48 GB and an 80 GB GPU hold next to the weights). The trace's distinct "
        f"prefix blocks would need {bound[2]:,} blocks; {largest} replicas hold {aggregate} in all, so the "
        "working set never fits one replica, and fits all of them only where the sum exceeds it. "
        "The router reads an in-process copy of the "
        "mirror (per replica the cached hash counts kept from its core's BlockStored / BlockRemoved events after "
        f"every step, what MirrorWriter publishes, with zero lag) and the leases as each replica's heartbeat "
        f"last wrote them, every {plan.refresh_ticks} ticks (TTL/3 of the default 10 s lease), each replica on its "
        f"own phase. Routers: {'; '.join(f'`{p}`: {labels[p]}' for p in plan.sim_policies)}. Deterministic: one "
        f"run each. Bound: one pool that never evicts and sees every prompt in trace order hits {bound[0]:,} "
        f"tokens ({bound[0] / bound[1]:.1%}).",
    ]
    for pool_blocks in plan.sim_pool_blocks:
        lines += _routing_table([r for r in sims if r.pool_blocks == pool_blocks], labels)
        lines += _redis_table([r for r in sims if r.pool_blocks == pool_blocks], plan)
    lines += _targets(sims)
    lines += ["", f"Simulation wall time: {sum(r.wall_s for r in sims):.1f} s summed over {len(sims)} runs, "
                  f"{plan.sim_jobs} at a time."]
    return lines


def _routing_table(sims: Sequence[SimResult], labels: dict[str, str]) -> list[str]:
    pool_blocks = sims[0].pool_blocks
    lines = [
        "",
        f"Routing, {pool_blocks:,}-block pools. Hits are counted at each request's first admission; 'router saw' is "
        "the prefix the mirror showed for the chosen replica; requests and prompt tokens per replica as max / mean "
        "and min / mean.",
        "",
        "| replicas | policy | prefix-hit tokens | hit rate | vs round-robin | router saw | requests per replica, "
        "max / min over mean | in-flight per replica (time average), max / min over mean | prompt tokens per "
        "replica, max / min over mean | evictions | preemptions | queue p50 / p99 | first token p50 / p99 |",
        "|---:|---|---:|---:|---:|---:|---|---|---|---:|---:|---|---|",
    ]
    rr_hits = {r.num_replicas: r.hit_tokens for r in sims if r.policy == "round-robin"}
    for r in sims:
        base = rr_hits.get(r.num_replicas)
        lines.append(
            f"| {r.num_replicas} | {labels[r.policy]} | {r.hit_tokens:,} | {r.hit_rate:.1%} | "
            f"{f'{r.hit_tokens / base:.2f}x' if base else ''} | {r.expected_hit_tokens:,} | "
            f"{_ratio(r.num_routed)} | {_ratio(r.in_flight_ticks)} | {_ratio(r.routed_tokens)} | "
            f"{r.num_evictions:,} | {r.num_preemptions} | "
            f"{percentile(r.queue_ticks, 50):,} / {percentile(r.queue_ticks, 99):,} ticks | "
            f"{percentile(r.ttft_ticks, 50):,} / {percentile(r.ttft_ticks, 99):,} ticks |"
        )
    return lines


def _redis_table(sims: Sequence[SimResult], plan: SimPlan) -> list[str]:
    window_s = plan.window_ticks * plan.sim_tick_ms / 1000
    lines = [
        "",
        f"Redis commands per second the index needs, {sims[0].pool_blocks:,}-block pools, in real blocks (each "
        f"simulated block counts as 1/scale = {1 / plan.sim_scale:g}). Writes: HSET when a "
        "hash becomes cached on a replica, HDEL when it stops (net per step). Heartbeats: 2 commands per replica "
        "per TTL/3. Lookup: one per routed request, SMEMBERS + one lease GET per replica + one command per block "
        "entry read: `per-block` reads every prompt block (one pipelined round trip), `chunked` reads "
        "chunks ending at 64, 512, 4096 blocks and stops after the chunk where the last replica stopped matching, "
        "`early-stop` reads up to the longest cached prefix + 1 (the floor for one entry per block). Rates are "
        "over the arrival span (first to last arrival); all = writes + heartbeats + lookups of the design; peak = "
        f"the busiest {window_s:.2f} s window.",
        "",
        "| replicas | policy | requests/s | writes/s (HSET + HDEL) | heartbeats/s | lookup commands per request, "
        "per-block / chunked / early-stop | lookup commands/s, per-block / chunked / early-stop | all commands/s, "
        "per-block / chunked | peak commands/s, per-block / chunked |",
        "|---:|---|---:|---:|---:|---|---|---|---|",
    ]
    for r in sims:
        ops = r.ops
        lookups = [f"lookup {d}" for d in LOOKUP_DESIGNS]
        per_request = [ops.total(k) / ops.num_lookups if ops.num_lookups else 0 for k in lookups]
        designs = ("per-block", "chunked")
        lines.append(
            f"| {r.num_replicas} | {r.policy} | {r.num_requests / ops.span_s:,.1f} | {ops.rate(*WRITES):,.0f} | "
            f"{ops.rate('heartbeat'):,.1f} | {' / '.join(f'{x:,.0f}' for x in per_request)} | "
            f"{' / '.join(f'{ops.rate(k):,.0f}' for k in lookups)} | "
            f"{' / '.join(f'{ops.rate(*served(d)):,.0f}' for d in designs)} | "
            f"{' / '.join(f'{ops.peak_rate(*served(d)):,.0f}' for d in designs)} |"
        )
    return lines


def _targets(sims: Sequence[SimResult]) -> list[str]:
    rr = {(r.pool_blocks, r.num_replicas): r.hit_tokens for r in sims if r.policy == "round-robin"}
    lines = [
        "",
        "Targets: cache-aware >= 3x round-robin's prefix-hit tokens, requests per replica max / mean <= 1.2.",
        "",
        "| pool | replicas | policy | vs round-robin | requests max / mean | met |",
        "|---:|---:|---|---:|---:|---|",
    ]
    for r in sims:
        base = rr.get((r.pool_blocks, r.num_replicas))
        if r.policy == "round-robin" or not base:
            continue
        ratio = r.hit_tokens / base
        met = "yes" if ratio >= 3 and r.load_max_over_mean <= 1.2 else "no"
        lines.append(f"| {r.pool_blocks:,} | {r.num_replicas} | {r.policy} | {ratio:.2f}x | "
                     f"{r.load_max_over_mean:.2f} | {met} |")
    return lines


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: the first 400 requests")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        plan = plan_from_args(args)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    sims, bound = run_simulations(plan, args.trace)
    command = shlex.join(["python", *sys.argv])
    print("\n".join(["# Routing simulation", "", f"Command: `{command}`", *render_sim(sims, bound, plan, args.trace)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
