"""The Redis mirror's writer, against real servers: Step latency with the mirror on vs off, and mirror lag.

Starts its own `redis-server` on a free port (no persistence) and two
`python -m kv_manager_service.cli serve --port 0` processes, as a user
would: "off" (no mirror) and "on" (`--redis-url`). The client stays in the
bench process. It measures in one run:

1. Step latency, mirror on vs off. The same workload on each server: N
   requests (default 256) admitted in one Step, 1000-token prompts whose
   first 512 tokens are shared by groups of 8 (prefix sharing), then
   columnar decode Steps (`StepRequest.decode`, prebuilt requests): every
   16th Step fills a block in every request (N BlockStored events), and the
   pool is sized so that later rounds evict the earlier rounds' cached
   blocks (BlockRemoved events on the same Steps). Both servers hold the
   same requests at once and their Steps alternate in chunks of 16 (one
   fill in the middle of each; the first server swaps every chunk), so both
   see the same moments of a noisy machine, while the on-server's writer
   publishes each fill within its own chunk. Two modes: back to back (the
   worst case: the writer's CPU must overlap some Step) and paced (the
   client sleeps --gap-ms before each Step, standing for the model's
   forward pass). p50 / p99 of the Step round trips, split into the Steps
   that fill blocks, the Step right after a fill and the rest; the
   admission Step; each process's CPU per Step (/proc/PID/stat). The ratio
   on / off is taken within each round. After the on-server's admission the
   bench waits until its last block is in Redis (reported in section 2).
2. Mirror lag on the "on" server: admit a request with a fresh 64-token
   prompt (4 blocks, one BlockStored event logged inside the RPC), then poll
   Redis in a tight loop (HGET of the last block's key, computed with
   BlockHasher and KeySchema.block, until it names the server's
   incarnation). Lag is measured from the RPC's return (a lower bound of
   event-to-visible: the event is logged before the response is sent) and
   from its send (an upper bound). Also a burst: one Step admitting 4 fresh
   2048-token prompts (512 new blocks, an 8192-token prefill step), polled
   on its last block. After each sample GetStats.mirror_lag_ms (the
   writer's own figure: age of the newest event of the batch it last wrote,
   taken when the pipeline returned) is read.

Both sections run every round (section 1 alternates which server goes
first, chunk by chunk); each figure is the median over rounds of the
per-round figure; ratios are per round, then the median. The spread shows
the lowest and highest round's p50. `bench/mirror_bench.py` runs these
sections together with the others.

`--topology cluster` mirrors into a Redis Cluster of 3 masters instead of
one redis-server (the Redis CPU figure then sums every node).

    python bench/mirror_writer_bench.py            # full run
    python bench/mirror_writer_bench.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import redis

from bench_stats import alternating, fmt, med, row
from mirror_report import Results, RunStart, header
from mirror_rig import (
    BLOCK_SIZE,
    OK,
    MirrorServer,
    Rig,
    add_redis_argument,
    add_run_arguments,
    now_ns,
    num_rounds,
    random_tokens,
    run_rounds,
    server_argv,
    server_hasher,
    server_schema,
    wait_visible,
)
from process_cpu import cpu_s
from kv_manager_service.core import BlockHasher
from kv_manager_service.mirror.schema import KeySchema
from kvcache.v1 import kv_manager_pb2 as pb

PROMPT_LEN = 1000
SHARED_LEN = 512  # leading tokens shared by each group of requests
SHARE_GROUP = 8  # requests per shared prefix
NUM_PREBUILT = 16  # distinct prebuilt decode requests, cycled
LAG_PROMPT_LEN = 64  # 4 blocks
BURST_REQUESTS, BURST_PROMPT_LEN = 4, 2048  # 512 new blocks in one Step
MODEL_ON = "mirror-bench"

# Targets of the Redis mirror.
TARGET_STEP_RATIO = 1.10
TARGET_LAG_P99_MS = 50.0


@dataclass
class WriterPlan:
    rounds: int
    num_requests: int  # section 1's requests per Step
    warmup: int
    steps: int  # timed back-to-back decode Steps per server and round
    paced_steps: int  # timed decode Steps with a gap before each
    gap_ms: float
    lag_samples: int  # single fresh-prompt admissions per round
    burst_samples: int  # 512-block bursts per round
    redis_writer: str = "thread"  # the "on" server's --redis-writer

    @property
    def blocks_per_request(self) -> int:
        return -(-(PROMPT_LEN + self.warmup + self.steps + self.paced_steps + BLOCK_SIZE) // BLOCK_SIZE) + 1

    @property
    def step_pool_blocks(self) -> int:
        """Half again what one round holds live: from the second round on, admissions evict cached blocks."""
        live = self.num_requests * self.blocks_per_request
        return live * 3 // 2 + BURST_REQUESTS * BURST_PROMPT_LEN // BLOCK_SIZE + 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=None, help="section 1's requests per Step (default 256, quick 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode Steps per server and round (default 400, quick 64)")
    parser.add_argument("--paced-steps", type=int, default=None,
                        help="timed decode Steps per server and round with --gap-ms before each (default 320, quick 32; "
                             "0: none)")
    parser.add_argument("--gap-ms", type=float, default=5.0,
                        help="client sleep before each paced Step, standing for the model's forward pass "
                             "(default %(default)s)")
    parser.add_argument("--lag-samples", type=int, default=None, help="fresh-prompt lag samples per round (default 200, quick 30)")
    parser.add_argument("--burst-samples", type=int, default=None, help="512-block bursts per round (default 20, quick 4)")
    parser.add_argument("--redis-writer", choices=("thread", "process"), default="thread",
                        help="the mirrored server's --redis-writer (default %(default)s)")


def plan_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> WriterPlan:
    quick = args.quick
    if args.steps is not None and args.steps < BLOCK_SIZE:
        parser.error(f"--steps must be >= {BLOCK_SIZE} (Steps alternate between the servers in chunks of {BLOCK_SIZE})")
    return WriterPlan(
        rounds=num_rounds(args),
        num_requests=args.requests or (64 if quick else 256),
        warmup=16 if quick else 32,
        steps=(args.steps or (64 if quick else 400)) // BLOCK_SIZE * BLOCK_SIZE,
        paced_steps=(args.paced_steps if args.paced_steps is not None else (32 if quick else 320)) // BLOCK_SIZE
        * BLOCK_SIZE,
        gap_ms=args.gap_ms,
        lag_samples=args.lag_samples or (30 if quick else 200),
        burst_samples=args.burst_samples or (4 if quick else 20),
        redis_writer=args.redis_writer,
    )


def redis_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds of every Redis node so far."""
    return sum(cpu_s(pid) for pid in pids)


def server_commands(plan: WriterPlan, redis_url: str) -> dict[str, list[str]]:
    """The "off" server (no mirror) and the "on" server (mirrored into `redis_url`), the same pool."""
    return {
        "off": server_argv("off", plan.step_pool_blocks),
        "on": server_argv("on", plan.step_pool_blocks, redis_url, MODEL_ON) + ["--redis-writer", plan.redis_writer],
    }


# -- section 1: Step latency, mirror on vs off ---------------------------------------


class StepWork:
    """Prompts with shared prefixes and prebuilt columnar decode Steps for `n` requests."""

    def __init__(self, tag: str, n: int, rng: random.Random, hasher: BlockHasher) -> None:
        self.request_ids = [f"{tag}-{i}" for i in range(n)]
        prefixes = [random_tokens(rng, SHARED_LEN) for _ in range(-(-n // SHARE_GROUP))]
        self.prompts = [prefixes[i // SHARE_GROUP] + random_tokens(rng, PROMPT_LEN - SHARED_LEN) for i in range(n)]
        self.last_block_hash = hasher.hash_blocks(hasher.root_hash, self.prompts[-1])[-1]
        self.admit = pb.StepRequest(
            ops=[pb.StepOp(allocate=pb.AllocateRequest(request_id=r, token_ids=p, num_new_tokens=len(p)))
                 for r, p in zip(self.request_ids, self.prompts)]
        )
        self.decode = [
            pb.StepRequest(decode=pb.DecodeBatch(request_ids=self.request_ids, token_ids=random_tokens(rng, n)))
            for _ in range(NUM_PREBUILT)
        ]
        self.free = pb.FreeRequest(request_ids=self.request_ids)


def admit(server: MirrorServer, work: StepWork, results: Results, tag: str, poller: redis.Redis,
          schema: KeySchema) -> None:
    """One admission Step of every prompt; on a mirrored server, also wait until its last block is in Redis."""
    start = now_ns()
    response = server.stub.Step(work.admit, timeout=120)
    returned = now_ns()
    results.get_series(f"{tag}:admit").add_value((returned - start) / 1e6)
    assert all(r.allocate.status == OK for r in response.results), "admission failed: pool too small?"
    if tag == "on":
        # Let the writer finish before anything else is timed: it is the biggest job it gets.
        seen = wait_visible(poller, schema.block(0, work.last_block_hash), server.name, str(server.incarnation).encode())
        results.get_series("admit:visible").add_value((seen - returned) / 1e6)


def decode_chunks(plan: WriterPlan, servers: dict[str, MirrorServer], stubs: dict, work: StepWork, order: list[str],
                  first_step: int, num_steps: int, gap_s: float, redis_pids: Sequence[int], results: Results, prefix: str) -> None:
    """`num_steps` decode Steps on each server, alternating in chunks of BLOCK_SIZE (one fill each), the first
    server swapping every chunk; with `gap_s`, the client sleeps that long before each Step (a model's forward
    pass), so a background thread of the server can run between Steps."""
    n = plan.num_requests
    samples: dict[str, list[int]] = {"off": [], "on": []}
    filled: dict[str, list[bool]] = {"off": [], "on": []}
    cpu = {"off": 0.0, "on": 0.0}
    redis_cpu = {"off": 0.0, "on": 0.0}
    num_chunks = num_steps // BLOCK_SIZE
    for chunk in range(num_chunks):
        for tag in (order if chunk % 2 == 0 else order[::-1]):
            stub, server = stubs[tag], servers[tag]
            own_samples, own_filled = samples[tag], filled[tag]
            cpu0, redis0 = server.cpu_s(), redis_cpu_s(redis_pids)
            for i in range(first_step + chunk * BLOCK_SIZE, first_step + (chunk + 1) * BLOCK_SIZE):
                if gap_s:
                    time.sleep(gap_s)
                request = work.decode[i % NUM_PREBUILT]
                start = now_ns()
                response = stub.Step(request, timeout=30)
                own_samples.append(now_ns() - start)
                statuses = response.decode.statuses
                assert len(statuses) == n and all(x == OK for x in statuses), "a decode op got NO_SPACE"
                own_filled.append(len(response.decode.changes) > 0)
            cpu[tag] += server.cpu_s() - cpu0
            redis_cpu[tag] += redis_cpu_s(redis_pids) - redis0
    steps = num_chunks * BLOCK_SIZE
    s = results.get_series
    for tag in ("off", "on"):
        t, f = samples[tag], filled[tag]
        s(f"{prefix}{tag}:step").add_samples(t)
        s(f"{prefix}{tag}:fill").add_samples([x for x, y in zip(t, f) if y])
        s(f"{prefix}{tag}:nofill").add_samples([x for x, y in zip(t, f) if not y])
        s(f"{prefix}{tag}:after_fill").add_samples([x for j, x in enumerate(t) if j > 0 and f[j - 1]])
        s(f"{prefix}{tag}:server_cpu").add_value(cpu[tag] / steps * 1e3)
        s(f"{prefix}{tag}:redis_cpu").add_value(redis_cpu[tag] / steps * 1e3)
        s(f"{prefix}{tag}:mean").add_value(statistics.fmean(t) / 1e6)
    for key in ("step", "fill", "after_fill", "nofill"):
        s(f"{prefix}ratio:{key}_p50").add_value(s(f"{prefix}on:{key}").p50[-1] / s(f"{prefix}off:{key}").p50[-1])
        s(f"{prefix}ratio:{key}_p99").add_value(s(f"{prefix}on:{key}").p99[-1] / s(f"{prefix}off:{key}").p99[-1])
    for key in ("server_cpu", "mean"):
        s(f"{prefix}ratio:{key}").add_value(s(f"{prefix}on:{key}").p50[-1] / s(f"{prefix}off:{key}").p50[-1])


def section_step(index: int, plan: WriterPlan, servers: dict[str, MirrorServer], redis_pids: Sequence[int], poller: redis.Redis,
                 schema: KeySchema, hasher: BlockHasher, results: Results) -> None:
    """Both servers hold the same requests and run the same Steps, interleaved in chunks (decode_chunks), so
    both see the same moments of a noisy machine while the on-server's writer has its own chunk to publish in."""
    work = StepWork(f"r{index}", plan.num_requests, random.Random(index), hasher)
    order = alternating(["off", "on"], index)
    for tag in order:
        admit(servers[tag], work, results, tag, poller, schema)
    stubs = {tag: servers[tag].stub for tag in order}
    for tag in order:
        for i in range(plan.warmup):
            stubs[tag].Step(work.decode[i % NUM_PREBUILT], timeout=30)
    decode_chunks(plan, servers, stubs, work, order, plan.warmup, plan.steps, 0.0, redis_pids, results, "")
    if plan.paced_steps:
        decode_chunks(plan, servers, stubs, work, order, plan.warmup + plan.steps, plan.paced_steps,
                      plan.gap_ms / 1e3, redis_pids, results, "paced:")
    for tag in order:
        stubs[tag].Free(work.free, timeout=30)
    s = results.get_series
    s("ratio:admit").add_value(s("on:admit").p50[-1] / s("off:admit").p50[-1])


# -- section 2: mirror lag ------------------------------------------------------------


def section_lag(index: int, plan: WriterPlan, on: MirrorServer, poller: redis.Redis, hasher: BlockHasher, schema: KeySchema,
                results: Results) -> None:
    rng = random.Random(10_000 + index)
    stub = on.stub
    field_name, value = on.name, str(on.incarnation).encode()
    stats_request = pb.GetStatsRequest()
    from_return, from_send, writer_lag, polls = [], [], [], []
    for i in range(plan.lag_samples):
        prompt = random_tokens(rng, LAG_PROMPT_LEN)
        key = schema.block(0, hasher.hash_blocks(hasher.root_hash, prompt)[-1])
        request = pb.AllocateRequest(request_id=f"lag-{index}-{i}", token_ids=prompt, num_new_tokens=len(prompt))
        sent = now_ns()
        response = stub.Allocate(request, timeout=10)
        returned = now_ns()
        hget, count = poller.hget, 1
        while hget(key, field_name) != value:
            count += 1
            if now_ns() - returned > 30e9:
                raise SystemExit(f"lag sample {i}: {key} never appeared")
        seen = now_ns()
        assert response.status == OK
        from_return.append(seen - returned)
        from_send.append(seen - sent)
        polls.append(count)
        writer_lag.append(stub.GetStats(stats_request, timeout=10).mirror_lag_ms)
        stub.Free(pb.FreeRequest(request_ids=[request.request_id]), timeout=10)
    s = results.get_series
    s("lag:return").add_samples(from_return)
    s("lag:send").add_samples(from_send)
    s("lag:writer").add_samples(writer_lag, 1)
    s("lag:polls").add_samples(polls, 1)

    from_return, from_send, writer_lag = [], [], []
    for i in range(plan.burst_samples):
        prompts = [random_tokens(rng, BURST_PROMPT_LEN) for _ in range(BURST_REQUESTS)]
        ids = [f"burst-{index}-{i}-{j}" for j in range(BURST_REQUESTS)]
        key = schema.block(0, hasher.hash_blocks(hasher.root_hash, prompts[-1])[-1])
        request = pb.StepRequest(ops=[
            pb.StepOp(allocate=pb.AllocateRequest(request_id=r, token_ids=p, num_new_tokens=len(p)))
            for r, p in zip(ids, prompts)
        ])
        sent = now_ns()
        response = stub.Step(request, timeout=30)
        returned = now_ns()
        seen = wait_visible(poller, key, field_name, value)
        assert all(r.allocate.status == OK for r in response.results)
        from_return.append(seen - returned)
        from_send.append(seen - sent)
        writer_lag.append(stub.GetStats(stats_request, timeout=10).mirror_lag_ms)
        stub.Free(pb.FreeRequest(request_ids=ids), timeout=10)
    s("burst:return").add_samples(from_return)
    s("burst:send").add_samples(from_send)
    s("burst:writer").add_samples(writer_lag, 1)
    stats = stub.GetStats(stats_request, timeout=10)
    s("mirror:failures").add_value(stats.mirror_failures)
    s("mirror:resyncs").add_value(stats.mirror_resyncs)
    s("mirror:queue_depth").add_value(stats.mirror_queue_depth)


def run_round(index: int, plan: WriterPlan, servers: dict[str, MirrorServer], redis_pids: Sequence[int], poller: redis.Redis,
              schema: KeySchema, hasher: BlockHasher, results: Results) -> None:
    """Sections 1 and 2, one round."""
    section_step(index, plan, servers, redis_pids, poller, schema, hasher, results)
    section_lag(index, plan, servers["on"], poller, hasher, schema, results)


def progress(results: Results) -> str:
    """This round's headline figures, for the progress line."""
    s = results.get_series
    return (f"Step p50 off {s('off:step').p50[-1]:.2f} on {s('on:step').p50[-1]:.2f} ms "
            f"(x{s('ratio:step_p50').p50[-1]:.3f}); lag p50/p99 {s('lag:return').p50[-1]:.2f}/"
            f"{s('lag:return').p99[-1]:.2f} ms")  # fmt: skip


# -- report ------------------------------------------------------------------------


def servers_text(servers: dict[str, MirrorServer], topology: str = "single") -> str:
    on_argv = shlex.join(["python", *servers["on"].argv[1:]])
    redis_text = "one redis-server" if topology == "single" else "a Redis Cluster of 3 masters, the URL naming its first"
    return f"`{on_argv}` (\"on\", {redis_text}), the same without `--redis-url` (\"off\")"


def each_round_text(plan: WriterPlan) -> str:
    return (f"both servers hold the same requests and run the same decode Steps, interleaved in chunks of "
            f"{BLOCK_SIZE} (one fill each; the first server swaps every chunk): {plan.steps} back to back and "
            f"{plan.paced_steps} paced (the client sleeps {plan.gap_ms:g} ms before each, standing for the model's "
            f"forward pass) per server after {plan.warmup} warm-up; {plan.lag_samples} lag samples + "
            f"{plan.burst_samples} bursts")  # fmt: skip


def rows(results: Results, plan: WriterPlan) -> list[str]:
    """The table rows of sections 1 and 2."""
    s = results.get_series
    lag_p99 = med(s("lag:return"), "p99")
    lag_send_p99 = med(s("lag:send"), "p99")
    burst_p99 = med(s("burst:send"), "p99")
    n = plan.num_requests
    # Blocks the admission caches: each group's shared prefix once, then every prompt's own full blocks.
    cached_blocks = -(-n // SHARE_GROUP) * (SHARED_LEN // BLOCK_SIZE) + n * (PROMPT_LEN - SHARED_LEN) // BLOCK_SIZE
    lines: list[str] = []
    for prefix, mode in (("", "back to back"), ("paced:", f"paced, {plan.gap_ms:g} ms gap")):
        if not s(f"{prefix}off:step").p50:
            continue
        ratio_p50, ratio_p99 = med(s(f"{prefix}ratio:step_p50")), med(s(f"{prefix}ratio:step_p99"))
        steps = plan.steps if not prefix else plan.paced_steps
        lines += [
            row("1", f"Step, {n} decode ops (columnar), {mode}, mirror off", s(f"{prefix}off:step"), "ms",
                note=f"{steps} Steps per round; {n} requests, {PROMPT_LEN}-token prompts, {SHARED_LEN} shared per "
                     f"{SHARE_GROUP}"),
            row("1", f"Step, {n} decode ops (columnar), {mode}, mirror on", s(f"{prefix}on:step"), "ms"),
            row("1", f"**ratio on / off, Step p50, {mode}**", s(f"{prefix}ratio:step_p50"), "x",
                f"<= {TARGET_STEP_RATIO}", "per round, same workload", met=ratio_p50 <= TARGET_STEP_RATIO),
            row("1", f"**ratio on / off, Step p99, {mode}**", s(f"{prefix}ratio:step_p99"), "x",
                f"<= {TARGET_STEP_RATIO}", met=ratio_p99 <= TARGET_STEP_RATIO),
            row("1", "  ratio on / off, mean Step", s(f"{prefix}ratio:mean"), "x"),
            row("1", "  Steps that fill a block in every request, off", s(f"{prefix}off:fill"), "ms",
                note=f"1 in {BLOCK_SIZE}: {n} BlockStored (+ BlockRemoved once evicting)"),
            row("1", "  Steps that fill a block in every request, on", s(f"{prefix}on:fill"), "ms"),
            row("1", "  ratio on / off, fill Steps p50", s(f"{prefix}ratio:fill_p50"), "x"),
            row("1", "  ratio on / off, fill Steps p99", s(f"{prefix}ratio:fill_p99"), "x"),
            row("1", "  the Step right after a fill, off", s(f"{prefix}off:after_fill"), "ms",
                note="may run while the writer publishes the fill"),
            row("1", "  the Step right after a fill, on", s(f"{prefix}on:after_fill"), "ms"),
            row("1", "  ratio on / off, Step after a fill p50", s(f"{prefix}ratio:after_fill_p50"), "x"),
            row("1", "  ratio on / off, Step after a fill p99", s(f"{prefix}ratio:after_fill_p99"), "x"),
            row("1", "  Steps that fill nothing, off", s(f"{prefix}off:nofill"), "ms"),
            row("1", "  Steps that fill nothing, on", s(f"{prefix}on:nofill"), "ms"),
            row("1", "  ratio on / off, Steps that fill nothing p50", s(f"{prefix}ratio:nofill_p50"), "x"),
            row("1", "  server process CPU per Step, off", s(f"{prefix}off:server_cpu"), "ms", note="/proc/PID/stat"),
            row("1", "  server process CPU per Step, on", s(f"{prefix}on:server_cpu"), "ms",
                note="the writer included: its thread, or its process (--redis-writer)"),
            row("1", "  ratio on / off, server CPU", s(f"{prefix}ratio:server_cpu"), "x"),
            row("1", "  redis-server CPU per Step, during the on-server's Steps", s(f"{prefix}on:redis_cpu"), "ms",
                note="every node of a cluster"),
        ]
    lines += [
        row("1", f"admission Step ({n} prompts, {n * (PROMPT_LEN // BLOCK_SIZE):,} blocks, {cached_blocks:,} newly "
                 "cached), off", s("off:admit"), "ms", note="one sample per round"),
        row("1", "admission Step, on", s("on:admit"), "ms"),
        row("1", "  ratio on / off, admission", s("ratio:admit"), "x"),
        row("2", f"mirror lag, fresh {LAG_PROMPT_LEN}-token prompt: RPC return -> visible", s("lag:return"), "ms",
            f"p99 <= {TARGET_LAG_P99_MS:g}", "lower bound (event logged before the reply)",
            met=lag_p99 <= TARGET_LAG_P99_MS),
        row("2", "  the same from RPC send -> visible", s("lag:send"), "ms", f"p99 <= {TARGET_LAG_P99_MS:g}",
            "upper bound (includes the whole Allocate)", met=lag_send_p99 <= TARGET_LAG_P99_MS),
        row("2", "  HGET polls until visible", s("lag:polls"), "", note="tight loop, one connection"),
        row("2", "  GetStats.mirror_lag_ms after each sample", s("lag:writer"), "ms",
            note="writer's figure: event logged -> pipeline returned (read just after the poll saw the key)"),
        row("2", f"mirror lag, burst ({BURST_REQUESTS} x {BURST_PROMPT_LEN}-token prompts in one Step, "
                 f"{BURST_REQUESTS * BURST_PROMPT_LEN // BLOCK_SIZE} blocks): return -> visible", s("burst:return"),
            "ms", note="last block of the last prompt polled"),
        row("2", "  the same from RPC send -> visible", s("burst:send"), "ms", f"p99 <= {TARGET_LAG_P99_MS:g}",
            met=burst_p99 <= TARGET_LAG_P99_MS),
        row("2", "  GetStats.mirror_lag_ms after each burst", s("burst:writer"), "ms"),
        row("2", f"mirror lag, section 1's admission ({cached_blocks:,} new block hashes): return -> visible",
            s("admit:visible"), "ms", note="one sample per round; its last block polled"),
        row("2", "mirror failures / resyncs / queue depth at round end", s("mirror:failures"), "",
            note=f"resyncs {fmt(med(s('mirror:resyncs')))}, queue depth {fmt(med(s('mirror:queue_depth')))}"),
    ]
    return lines


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    add_arguments(parser)
    add_redis_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    plan = plan_from_args(args, parser)
    start = RunStart.now()
    hasher, schema = server_hasher(), server_schema(MODEL_ON)
    results = Results()
    with Rig(args.redis_server, args.topology) as rig:
        rig.start_servers(server_commands(plan, rig.redis_url))
        poller = rig.redis_client()

        def one_round(index: int) -> list[str]:
            run_round(index, plan, rig.servers, rig.redis_pids, poller, schema, hasher, results)
            return [progress(results)]

        run_rounds(plan.rounds, one_round)
        poller.close()
    lines = header(start, rig.redis_version, [servers_text(rig.servers, rig.topology)], plan.rounds,
                   [each_round_text(plan)])
    print("\n".join(lines + rows(results, plan)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
