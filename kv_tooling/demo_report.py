"""What the demo measured: samples over time, the final report, and its figure.

`report.json` holds the `Report` fields and a `units` map (`REPORT_UNITS`)
that gives each field's unit; fractions are in 0..1, not percent. With a
host tier, `host_tier` holds a `TierReport` (its units map is the `units`
entry of the same name); without one it is null.

What prefix hits saved: an admission's cached prefix is not prefilled, so the
hits saved `num_prefix_hit_tokens` tokens of prefill. The time they saved is
an estimate from this run's prefill rate: the tokens computed by the steps
that prefilled, over those steps' model time (the worker's `forward_ms`).
The estimate is the saved tokens at that rate. It is rough both ways: a
cached prefix sits at the start of its prompt, where attention is cheaper
than for the tail the run computed (it errs high), and it leaves out the
fixed cost of the extra steps computing them would have taken (it errs low).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from reference_scheduler.scheduler import StepTiming

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kv_tooling.demo import ReplicaStack

# The PagedAttention paper (Kwon et al., SOSP 2023, Fig. 2): in earlier systems that reserve
# contiguous memory per request, 20.4% to 38.2% of the KV memory held real token states.
PAPER_CONTIGUOUS_RANGE = (0.204, 0.382)


@dataclasses.dataclass(frozen=True)
class Sample:
    """The replicas' state after one round of steps."""

    t_s: float
    usage: float  # blocks in use / usable blocks, over all replicas
    hit_rate: float  # prefix-hit tokens / looked-up tokens since the demo started
    num_running: int
    num_waiting: int
    num_completed: int
    num_preemptions: int
    real_tokens: int  # K/V held by running requests
    paged_slots: int  # token slots of the blocks those requests hold
    own_max_slots: int  # token slots reserving each request's own maximum (prompt + output limit)
    contiguous_slots: int  # token slots reserving max-model-len for each request
    num_prefix_hit_tokens: int  # admitted tokens found in the prefix cache since the demo started
    prefill_tokens_computed: int  # admitted tokens computed since the demo started
    # The host tier's share since the demo started (all 0 without one).
    host_hit_rate: float = 0.0  # of hit_rate: tokens loaded from the host tier / looked-up tokens
    num_offloaded_blocks: int = 0  # device -> host copies
    num_onloaded_blocks: int = 0  # host -> device copies
    offloaded_bytes: int | None = 0  # None: a replica's bytes per block are unknown
    onloaded_bytes: int | None = 0


@dataclasses.dataclass(frozen=True)
class TierReport:
    """Hits by tier and the host tier's copy volume; `TIER_UNITS` gives each field's unit."""

    num_host_blocks: int  # over all replicas
    device_hit_rate: float
    host_hit_rate: float
    num_offloaded_blocks: int
    num_onloaded_blocks: int
    offloaded_bytes: int | None  # None: not every replica's bytes per block are known
    onloaded_bytes: int | None


@dataclasses.dataclass(frozen=True)
class Report:
    """The demo's result; `REPORT_UNITS` gives each field's unit."""

    trace_file: str
    trace_start_index: int
    num_requests: int
    num_completed: int
    num_prompt_tokens: int
    num_generated_tokens: int
    prefix_hit_rate: float
    num_prefix_hit_tokens: int
    prefill_tokens_computed: int
    prefill_tokens_per_s: float | None  # None: too few steps to measure it
    est_prefill_time_saved_s: float | None
    mean_usage: float
    peak_usage: float
    wall_s: float
    requests_per_s: float
    generated_tokens_per_s: float
    step_ms_p50: float
    step_ms_p99: float
    execute_ms_p50: float
    execute_ms_p99: float
    num_preemptions: int
    num_kv_lost: int  # running requests recomputed because their KV was lost (docs/cache-validity.md)
    paged_real_token_share: float  # of the reserved KV slots, over the run
    own_max_real_token_share: float
    contiguous_real_token_share: float
    max_model_len: int
    requests_per_replica: dict[str, int]
    host_tier: TierReport | None = None  # None: no replica has a host tier

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "units": REPORT_UNITS}, indent=2) + "\n"


TIER_UNITS: dict[str, str] = {
    "num_host_blocks": "blocks of host memory behind the device pools, over all replicas",
    "device_hit_rate": "fraction (0..1) of the tokens looked up on admission found on the device",
    "host_hit_rate": "fraction (0..1) of the tokens looked up on admission found only in the host tier, "
    "so loaded from it",
    "num_offloaded_blocks": "blocks copied device -> host (write-back on eviction)",
    "num_onloaded_blocks": "blocks copied host -> device (host hits)",
    "offloaded_bytes": "bytes copied device -> host, every layer of each block; null when unknown (a pool "
    "that is not all full attention)",
    "onloaded_bytes": "bytes copied host -> device, every layer of each block; null when unknown",
}

_FRACTION_OF_SLOTS = "fraction (0..1) of the token slots reserved for the running requests, averaged over the run"

# The unit of every Report field, written to report.json as "units" (host_tier's: a map of its own).
REPORT_UNITS: dict[str, str | dict[str, str]] = {
    "trace_file": "file name",
    "trace_start_index": "0-based index (line) in the trace of the first request replayed",
    "num_requests": "requests",
    "num_completed": "requests",
    "num_prompt_tokens": "tokens (scaled prompts, each request counted once)",
    "num_generated_tokens": "tokens",
    "prefix_hit_rate": "fraction (0..1) of the tokens looked up on admission found in the prefix cache",
    "num_prefix_hit_tokens": "tokens found in the prefix cache on admission, so not prefilled "
    "(re-admissions after preemption included)",
    "prefill_tokens_computed": "tokens computed in prefill passes, every token not computed by a decode step "
    "(after a preemption, the prompt and the outputs so far again)",
    "prefill_tokens_per_s": "tokens/s of model time: the tokens computed by the steps that prefilled, over "
    "their model time",
    "est_prefill_time_saved_s": "s of model time: num_prefix_hit_tokens / prefill_tokens_per_s",
    "mean_usage": "fraction (0..1) of usable blocks in use, averaged over the run's samples",
    "peak_usage": "fraction (0..1) of usable blocks in use, the highest sample",
    "wall_s": "s",
    "requests_per_s": "requests/s",
    "generated_tokens_per_s": "tokens/s",
    "step_ms_p50": "ms",
    "step_ms_p99": "ms",
    "execute_ms_p50": "ms",
    "execute_ms_p99": "ms",
    "num_preemptions": "preemptions",
    "num_kv_lost": "requests",
    "paged_real_token_share": _FRACTION_OF_SLOTS + " (paged, the blocks they hold)",
    "own_max_real_token_share": _FRACTION_OF_SLOTS + " (contiguous, each request's prompt + output limit)",
    "contiguous_real_token_share": _FRACTION_OF_SLOTS + " (contiguous, max_model_len or more each)",
    "max_model_len": "tokens",
    "requests_per_replica": "requests, by replica id",
    "host_tier": TIER_UNITS,
}


def build_report(
    replicas: Sequence["ReplicaStack"],
    samples: Sequence[Sample],
    wall_s: float,
    args: argparse.Namespace,
    trace_file: str,
    trace_start_index: int,
) -> Report:
    requests = [r for replica in replicas for r in replica.scheduler.sequences.values()]
    timings = [t for replica in replicas for t in replica.scheduler.timings]
    num_prefix_hit_tokens = sum(replica.scheduler.counters.num_cached_tokens for replica in replicas)
    seconds_per_token = prefill_seconds_per_token(timings)
    executed = [t.execute_ms for t in timings if t.num_requests]
    step_ms = [t.step_ms for t in timings]
    real = sum(s.real_tokens for s in samples)
    last = samples[-1] if samples else None
    num_completed = sum(1 for r in requests if r.finished)
    generated = sum(r.num_output_tokens for r in requests)
    return Report(
        trace_file=trace_file,
        trace_start_index=trace_start_index,
        num_requests=args.requests if not requests else len(requests),
        num_completed=num_completed,
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        num_generated_tokens=generated,
        prefix_hit_rate=last.hit_rate if last else 0.0,
        num_prefix_hit_tokens=num_prefix_hit_tokens,
        prefill_tokens_computed=sum(
            replica.scheduler.counters.num_admitted_tokens - replica.scheduler.counters.num_cached_tokens
            for replica in replicas
        ),
        prefill_tokens_per_s=1 / seconds_per_token if seconds_per_token else None,
        est_prefill_time_saved_s=num_prefix_hit_tokens * seconds_per_token if seconds_per_token else None,
        mean_usage=statistics.fmean(s.usage for s in samples) if samples else 0.0,
        peak_usage=max((s.usage for s in samples), default=0.0),
        wall_s=wall_s,
        requests_per_s=num_completed / wall_s if wall_s else 0.0,
        generated_tokens_per_s=generated / wall_s if wall_s else 0.0,
        step_ms_p50=_percentile(step_ms, 50),
        step_ms_p99=_percentile(step_ms, 99),
        execute_ms_p50=_percentile(executed, 50),
        execute_ms_p99=_percentile(executed, 99),
        num_preemptions=sum(replica.scheduler.num_preemptions for replica in replicas),
        num_kv_lost=sum(replica.scheduler.counters.num_kv_lost for replica in replicas),
        paged_real_token_share=real / max(1, sum(s.paged_slots for s in samples)),
        own_max_real_token_share=real / max(1, sum(s.own_max_slots for s in samples)),
        contiguous_real_token_share=real / max(1, sum(s.contiguous_slots for s in samples)),
        max_model_len=args.max_model_len,
        requests_per_replica={replica.replica_id: replica.num_routed for replica in replicas},
        host_tier=build_tier_report(sum(replica.num_host_blocks for replica in replicas), last),
    )


def build_tier_report(num_host_blocks: int, last: Sample | None) -> TierReport | None:
    """Hits by tier and copy volume from the run's last sample; None without a host tier."""
    if not num_host_blocks:
        return None
    if last is None:
        return TierReport(num_host_blocks, 0.0, 0.0, 0, 0, 0, 0)
    return TierReport(
        num_host_blocks=num_host_blocks,
        device_hit_rate=last.hit_rate - last.host_hit_rate,
        host_hit_rate=last.host_hit_rate,
        num_offloaded_blocks=last.num_offloaded_blocks,
        num_onloaded_blocks=last.num_onloaded_blocks,
        offloaded_bytes=last.offloaded_bytes,
        onloaded_bytes=last.onloaded_bytes,
    )


def prefill_seconds_per_token(timings: Sequence[StepTiming]) -> float | None:
    """This run's model time per computed token over the steps that prefilled, in seconds; None if none did.

    A step prefilled when it computed more tokens than it ran requests (a
    decode computes one). Such a step's decodes are counted with its prefill
    chunks: they are a few tokens of each.
    """
    num_tokens = forward_ms = 0.0
    for timing in timings:
        if timing.num_tokens > timing.num_requests:
            num_tokens += timing.num_tokens
            forward_ms += timing.forward_ms
    return forward_ms / 1e3 / num_tokens if num_tokens and forward_ms > 0 else None


def print_report(report: Report) -> None:
    low, high = PAPER_CONTIGUOUS_RANGE
    first = report.trace_start_index
    if report.est_prefill_time_saved_s is None or report.prefill_tokens_per_s is None:
        saved_time = "not estimated (too few steps to measure the prefill rate)"
    else:
        saved_time = (
            f"{report.est_prefill_time_saved_s:.1f} s of model time (estimated: "
            f"{report.num_prefix_hit_tokens:,} tokens at {report.prefill_tokens_per_s:,.0f} prefill tokens/s)"
        )
    rows = [
        ("trace requests", f"{first}..{first + report.num_requests - 1} of {report.trace_file}"),
        ("requests completed", f"{report.num_completed} / {report.num_requests}"),
        ("prompt / generated tokens", f"{report.num_prompt_tokens:,} / {report.num_generated_tokens:,}"),
        ("prefix-hit rate (tokens)", f"{report.prefix_hit_rate:.1%}"),
        *(tier_rows(report.host_tier) if report.host_tier is not None else ()),
        ("tokens found cached, not prefilled", f"{report.num_prefix_hit_tokens:,}"),
        ("prefill tokens computed", f"{report.prefill_tokens_computed:,}"),
        ("prefill time the hits saved", saved_time),
        ("KV usage, mean / peak", f"{report.mean_usage:.1%} / {report.peak_usage:.1%}"),
        ("requests per second", f"{report.requests_per_s:.2f}  ({report.generated_tokens_per_s:,.0f} generated tokens/s)"),
        ("Step RPC latency p50 / p99", f"{report.step_ms_p50:.2f} / {report.step_ms_p99:.2f} ms"),
        ("Execute latency p50 / p99", f"{report.execute_ms_p50:.1f} / {report.execute_ms_p99:.1f} ms"),
        ("preemptions", f"{report.num_preemptions}"),
        ("requests recomputed, their KV lost", f"{report.num_kv_lost}"),
        ("reserved KV holding real tokens", ""),
        ("  paged (16-token blocks)", f"{report.paged_real_token_share:.1%}"),
        ("  contiguous, each request's own max length", f"{report.own_max_real_token_share:.1%}"),
        (f"  contiguous, max-model-len ({report.max_model_len}) each", f"{report.contiguous_real_token_share:.1%}"),
        ("wall time", f"{report.wall_s:.1f} s"),
    ]
    if len(report.requests_per_replica) > 1:
        rows.append(("requests per replica", ", ".join(f"{k} {v}" for k, v in report.requests_per_replica.items())))
    width = max(len(name) for name, _ in rows)
    print("\nDemo report")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    notes = [
        "The prefill time saved is an estimate: the cached tokens at this run's prefill rate, which is the "
        "tokens computed by the steps that prefilled over the worker's model time for those steps.",
        f"The PagedAttention paper (Kwon et al., SOSP 2023) found that earlier systems, which reserve contiguous "
        f"memory for each request, held real tokens in only {low:.1%} to {high:.1%} of their KV memory; here a "
        f"{report.max_model_len}-token contiguous reservation per request would hold "
        f"{report.contiguous_real_token_share:.1%}, and paging holds {report.paged_real_token_share:.1%}.",
    ]
    for note in notes:
        print()
        print(textwrap.fill(note, width=100, initial_indent="  ", subsequent_indent="  "))


def tier_rows(tier: TierReport) -> list[tuple[str, str]]:
    """The console report's host-tier rows: hits by tier, then the copy volume."""

    def volume(num_blocks: int, num_bytes: int | None) -> str:
        return f"{num_blocks:,} blocks" + ("" if num_bytes is None else f" ({num_bytes / 2**20:,.1f} MiB)")

    return [
        ("  of which on the device", f"{tier.device_hit_rate:.1%}"),
        (f"  of which in the host tier ({tier.num_host_blocks:,} blocks)", f"{tier.host_hit_rate:.1%}"),
        ("host tier: offloaded (device -> host)", volume(tier.num_offloaded_blocks, tier.offloaded_bytes)),
        ("host tier: onloaded (host -> device)", volume(tier.num_onloaded_blocks, tier.onloaded_bytes)),
    ]


def build_figure(samples: Sequence[Sample], title: str, host_tier: bool = False) -> "Figure":
    """KV usage and prefix-hit rate, prefill tokens cached and computed, and requests, over time.

    With `host_tier`, the top panel also shows the share of the hit rate
    loaded from the host tier. Every legend sits to the right of its axes, outside the plotted data.
    """
    try:
        import matplotlib
    except ImportError:
        raise ValueError("the demo's figure needs matplotlib: install the demo extra (pip install '.[demo]')") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s for s in samples]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True, constrained_layout=True)
    top.plot(t, [100 * s.usage for s in samples], label="KV usage\n(blocks in use)")
    top.plot(t, [100 * s.hit_rate for s in samples], label="prefix-hit rate\n(tokens, cumulative)")
    if host_tier:
        top.plot(t, [100 * s.host_hit_rate for s in samples], label="of which from\nthe host tier")
    top.set_ylabel("%")
    top.set_ylim(0, 100)
    top.set_title(title)
    middle.plot(t, [s.num_prefix_hit_tokens / 1e3 for s in samples], label="found cached:\nnot prefilled")
    middle.plot(t, [s.prefill_tokens_computed / 1e3 for s in samples], label="prefilled")
    middle.set_ylabel("thousand tokens\n(cumulative)")
    middle.set_ylim(bottom=0)
    bottom.plot(t, [s.num_running for s in samples], label="running")
    bottom.plot(t, [s.num_waiting for s in samples], label="waiting")
    bottom.plot(t, [s.num_preemptions for s in samples], label="preemptions\n(cumulative)")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("requests")
    for axes in (top, middle, bottom):
        axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
    return fig


def write_figure(samples: Sequence[Sample], path: Path, title: str, host_tier: bool = False) -> None:
    """`build_figure` as a PNG at `path`."""
    fig = build_figure(samples, title, host_tier)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
