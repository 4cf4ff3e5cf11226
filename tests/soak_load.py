"""A trace-driven scheduler that loads one kv-manager for a bounded time.

Shared by the soak test (tests/service/test_service_soak.py, schedulers in
threads) and `bench/soak_bench.py` (schedulers in processes). Each scheduler
owns one `KVManagerClient` and its own request ids, and per iteration sends
at most two Steps:

1. nested ops, in this order: one `FreeOp` for the requests that finished,
   were aborted or are preempted; a `ForkOp` now and then; `AllocateOp`s
   admitting waiting requests (the whole prompt; prefix hits adopted);
2. the decode columns (`client.decode`): every running request appends one
   sampled token.

NO_SPACE is handled as a continuous-batching scheduler handles it: a refused
admission goes back to the head of the queue, and each refused decode entry
preempts the youngest running request (recompute: freed in the next Step and
re-admitted later with every token it has so far). Fork children decode on
their own, so their first write into a shared block goes through
copy-on-write; a fake worker acknowledges the scheduler's steps every few
iterations, which releases the copies' blocks. At the deadline the scheduler
frees everything it holds.

Every response is checked against the scheduler's own view: a status is OK
or NO_SPACE, an admission computes the whole prompt, a decode entry starts
at the request's token count. Any RPC error or disagreement raises.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from kv_manager_service import cli
from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateOp, AllocateResult, AllocateStatus, ForkOp, FreeOp
from kv_manager_service.core.ops import Op, OpResult
from kv_manager_service.workload import TokenExpander, load_trace, scaled_length
from kvcache.v1 import kv_manager_pb2 as pb

TRACE_PATH = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"
VOCAB_SIZE = 32000  # TokenExpander's default: sampled tokens come from the same range


def serve_flags(*wanted: str) -> list[str]:
    """The flags among `wanted` that this checkout's `kv-manager serve --help` lists."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        cli.make_parser().parse_args(["serve", "--help"])
    listed = set(text.getvalue().split())
    return [flag for flag in wanted if flag in listed]


class RequestSpec(NamedTuple):
    """One request of the workload: its prompt and how many tokens it decodes."""

    prompt_token_ids: list[int]
    num_output_tokens: int


def trace_requests(
    scale: float,
    output_scale: float,
    max_num_tokens: int,
    index: int = 0,
    stride: int = 1,
    path: Path = TRACE_PATH,
) -> list[RequestSpec]:
    """Records index, index + stride, ... of the Mooncake trace, scaled.

    Prompts are scaled by `scale` (`TokenExpander`), outputs by
    `output_scale`; a record whose prompt plus output exceeds
    `max_num_tokens` is left out, so that no request needs more of the pool
    than its share.
    """
    expander = TokenExpander(VOCAB_SIZE, scale)
    specs = []
    for record in load_trace(path)[index::stride]:
        num_output = scaled_length(record.output_length, output_scale)
        if expander.prompt_length(record) + num_output <= max_num_tokens:
            specs.append(RequestSpec(expander.prompt_token_ids(record), num_output))
    if not specs:
        raise ValueError(f"no trace record fits in {max_num_tokens} tokens at scale {scale}")
    return specs


@dataclass(frozen=True)
class SchedulerConfig:
    """One scheduler's knobs. Every `*_every` counts iterations."""

    scheduler_id: str  # prefixes its request ids
    duration_s: float
    max_running: int = 64
    max_admit_per_step: int = 8
    fork_every: int = 25  # fork one running request into one or two children
    abort_every: int = 40  # free one running request before it finishes
    ack_every: int = 8  # AckSteps(worker_id, last step seen)
    worker_id: str = "soak-worker"  # one fake worker for every scheduler of a run
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        for name in ("max_running", "max_admit_per_step", "fork_every", "abort_every", "ack_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SchedulerCounters:
    """What one scheduler did; `add` sums schedulers."""

    num_iterations: int = 0
    num_steps: int = 0  # Step RPCs, both kinds
    num_decode_steps: int = 0
    num_request_steps: int = 0  # decode entries that got OK
    num_requests: int = 0  # trace requests started
    num_admitted: int = 0  # admissions that got OK, re-admissions included
    num_readmitted: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preempted: int = 0
    num_forks: int = 0
    num_fork_children: int = 0
    num_no_space_admit: int = 0
    num_no_space_decode: int = 0
    num_copies: int = 0
    num_acks: int = 0
    num_prompt_tokens: int = 0  # admitted
    num_hit_tokens: int = 0  # of which prefix-cache hits
    num_freed_at_end: int = 0
    last_step_id: int = 0

    def add(self, other: SchedulerCounters) -> None:
        for f in fields(self):
            if f.name == "last_step_id":
                self.last_step_id = max(self.last_step_id, other.last_step_id)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class LatencyBucket(NamedTuple):
    """Step round trips of one scheduler that ended in one whole second since the shared start."""

    scheduler_id: str
    second: int
    decode_us: list[int]  # Steps carrying the decode columns
    ops_us: list[int]  # Steps carrying nested ops (admissions, frees, forks)


@dataclass
class _Live:
    request_id: str
    token_ids: list[int]  # prompt + decoded so far; all computed while running
    num_left: int  # output tokens still to decode
    order: int = 0  # admission order: the youngest is preempted first


class _Buckets:
    """Collects round trips per second; hands each finished second to `sink`."""

    def __init__(self, scheduler_id: str, start_s: float, sink: Callable[[LatencyBucket], None]) -> None:
        self.start_s = start_s
        self.sink = sink
        self.current = LatencyBucket(scheduler_id, 0, [], [])

    def add(self, end_s: float, latency_s: float, decode: bool) -> None:
        second = int(end_s - self.start_s)
        if second != self.current.second:
            self.flush()
            self.current = LatencyBucket(self.current.scheduler_id, second, [], [])
        (self.current.decode_us if decode else self.current.ops_us).append(round(latency_s * 1e6))

    def flush(self) -> None:
        if self.current.decode_us or self.current.ops_us:
            self.sink(self.current)


def run_scheduler(
    client: KVManagerClient,
    config: SchedulerConfig,
    specs: Sequence[RequestSpec],
    start_s: float,
    sink: Callable[[LatencyBucket], None],
) -> SchedulerCounters:
    """Schedule `specs` (cycled; each pass gets new request ids) from `start_s` (time.monotonic) for
    `config.duration_s`, then free every request this scheduler holds.

    `sink` gets the Step round trips second by second. Raises on any RPC
    error and on any response that disagrees with the scheduler's view.
    """
    rng = random.Random(config.seed)
    counters = SchedulerCounters()
    buckets = _Buckets(config.scheduler_id, start_s, sink)
    deadline = start_s + config.duration_s
    running: dict[str, _Live] = {}
    waiting: deque[_Live] = deque()
    to_free: list[str] = []
    next_spec = 0
    next_order = 0
    preempted = False

    def new_id() -> str:
        counters.num_requests += 1
        return f"{config.scheduler_id}-{counters.num_requests}"

    def timed_step(ops: list[Op]) -> tuple[OpResult, ...]:
        started = time.monotonic()
        result = client.step(ops)
        ended = time.monotonic()
        buckets.add(ended, ended - started, decode=False)
        counters.num_steps += 1
        counters.last_step_id = max(counters.last_step_id, result.step_id)
        return result.results

    time.sleep(max(0.0, start_s - time.monotonic()))
    while time.monotonic() < deadline:
        counters.num_iterations += 1
        iteration = counters.num_iterations
        while len(waiting) < config.max_admit_per_step:
            spec = specs[next_spec % len(specs)]
            next_spec += 1
            waiting.append(_Live("", list(spec.prompt_token_ids), spec.num_output_tokens))

        # 1. nested ops: frees, a fork, admissions
        ops: list[Op] = []
        touched = set(to_free)
        if to_free:
            ops.append(FreeOp(to_free))
            to_free = []
        fork: tuple[_Live, list[str]] | None = None
        if iteration % config.fork_every == 0 and running and len(running) < config.max_running:
            parent = rng.choice(list(running.values()))
            fork = (parent, [new_id() for _ in range(rng.randint(1, 2))])
            ops.append(ForkOp(parent.request_id, fork[1]))
            touched.add(parent.request_id)
            touched.update(fork[1])
        admitting: list[_Live] = []
        if not preempted:
            num_slots = min(config.max_admit_per_step, config.max_running - len(running))
            while waiting and len(admitting) < num_slots and waiting[0].request_id not in touched:
                live = waiting.popleft()
                live.request_id = live.request_id or new_id()
                admitting.append(live)
                ops.append(AllocateOp(live.request_id, live.token_ids, len(live.token_ids)))
        if ops:
            results = timed_step(ops)
            if fork is not None:
                parent, child_ids = fork
                counters.num_forks += 1
                counters.num_fork_children += len(child_ids)
                for child_id in child_ids:
                    next_order += 1
                    num_left = rng.randint(1, max(1, parent.num_left))
                    running[child_id] = _Live(child_id, list(parent.token_ids), num_left, next_order)
            refused = []
            for live, result in zip(admitting, results[len(ops) - len(admitting) :]):
                assert isinstance(result, AllocateResult), result
                if result.status is AllocateStatus.OK:
                    num_tokens = result.num_computed_tokens + result.num_scheduled_tokens
                    assert num_tokens == len(live.token_ids), (live.request_id, num_tokens, len(live.token_ids))
                    counters.num_admitted += 1
                    counters.num_readmitted += live.order > 0
                    counters.num_prompt_tokens += len(live.token_ids)
                    counters.num_hit_tokens += result.num_computed_tokens
                    next_order += 1
                    live.order = next_order
                    running[live.request_id] = live
                else:
                    assert result.status is AllocateStatus.NO_SPACE, result.status
                    counters.num_no_space_admit += 1
                    refused.append(live)
            waiting.extendleft(reversed(refused))
            if refused and not running:
                time.sleep(0.002)  # the other schedulers hold the pool: let them run
        preempted = False

        # 2. decode: every running request appends one token
        request_ids = list(running)
        if request_ids:
            token_ids = [rng.randrange(VOCAB_SIZE) for _ in request_ids]
            started = time.monotonic()
            decoded = client.decode(request_ids, token_ids)
            ended = time.monotonic()
            buckets.add(ended, ended - started, decode=True)
            counters.num_steps += 1
            counters.num_decode_steps += 1
            counters.last_step_id = max(counters.last_step_id, decoded.step_id)
            counters.num_copies += len(decoded.copies)
            num_refused = 0
            for request_id, token_id, status, num_computed in zip(
                request_ids, token_ids, decoded.statuses, decoded.num_computed_tokens
            ):
                live = running[request_id]
                if status is AllocateStatus.OK:
                    assert num_computed == len(live.token_ids), (request_id, num_computed, len(live.token_ids))
                    live.token_ids.append(token_id)
                    live.num_left -= 1
                    counters.num_request_steps += 1
                    if live.num_left == 0:
                        counters.num_finished += 1
                        del running[request_id]
                        to_free.append(request_id)
                else:
                    assert status is AllocateStatus.NO_SPACE, status
                    num_refused += 1
            counters.num_no_space_decode += num_refused
            for _ in range(min(num_refused, len(running))):
                victim = max(running.values(), key=lambda live: live.order)
                del running[victim.request_id]
                to_free.append(victim.request_id)
                waiting.appendleft(victim)
                counters.num_preempted += 1
                preempted = True

        if iteration % config.abort_every == 0 and running:
            victim = rng.choice(list(running.values()))
            del running[victim.request_id]
            to_free.append(victim.request_id)
            counters.num_aborted += 1
        if iteration % config.ack_every == 0 and counters.last_step_id:
            client.ack_steps(config.worker_id, counters.last_step_id)
            counters.num_acks += 1

    held = to_free + list(running)
    if held:
        result = client.step([FreeOp(held)])
        counters.last_step_id = max(counters.last_step_id, result.step_id)
        counters.num_freed_at_end = len(held)
    buckets.flush()
    return counters


class EndState(NamedTuple):
    """The pool as the service reports it once every scheduler has stopped."""

    num_blocks: int
    num_free_blocks: int
    usage: float
    num_requests: int
    num_pending_copies: int
    last_step_id: int
    num_tables: int  # GetBlockTables, all requests
    num_listed_pending_copies: int  # GetBlockTables.pending_copies

    def violations(self) -> list[str]:
        """What an idle pool must satisfy and this one does not (empty when drained)."""
        found = []
        if self.num_requests or self.num_tables:
            found.append(f"{self.num_requests} requests live ({self.num_tables} block tables)")
        if self.num_pending_copies or self.num_listed_pending_copies:
            found.append(f"{self.num_pending_copies} pending copies ({self.num_listed_pending_copies} listed)")
        if self.num_free_blocks != self.num_blocks - 1:
            found.append(f"{self.num_free_blocks} free blocks, expected {self.num_blocks - 1} (all but the null block)")
        if self.usage != 0.0:
            found.append(f"usage {self.usage}, expected 0")
        return found


def settle(client: KVManagerClient, worker_id: str) -> EndState:
    """Acknowledge, as `worker_id`, every step issued so far (releasing all copies), then read the pool."""
    step_id = client.stub.GetStats(pb.GetStatsRequest(), timeout=client.timeout_s).last_step_id
    if step_id:
        client.ack_steps(worker_id, step_id)
    stats = client.stub.GetStats(pb.GetStatsRequest(), timeout=client.timeout_s)
    tables = client.block_tables()
    return EndState(
        stats.num_blocks,
        stats.num_free_blocks,
        stats.usage,
        stats.num_requests,
        stats.num_pending_copies,
        stats.last_step_id,
        len(tables.tables),
        len(tables.pending_copies),
    )
