"""What the demo measured: samples over time, the final report, and its figure."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from reference_scheduler.demo import Replica

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


@dataclasses.dataclass(frozen=True)
class Report:
    num_requests: int
    num_completed: int
    num_prompt_tokens: int
    num_generated_tokens: int
    prefix_hit_rate: float
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
    paged_real_token_share: float  # of the reserved KV slots, over the run
    own_max_real_token_share: float
    contiguous_real_token_share: float
    max_model_len: int
    requests_per_replica: dict[str, int]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


def build_report(replicas: Sequence["Replica"], samples: Sequence[Sample], wall_s: float, args: argparse.Namespace) -> Report:
    requests = [r for replica in replicas for r in replica.scheduler.sequences.values()]
    timings = [t for replica in replicas for t in replica.scheduler.timings]
    executed = [t.execute_ms for t in timings if t.num_requests]
    step_ms = [t.step_ms for t in timings]
    real = sum(s.real_tokens for s in samples)
    last = samples[-1] if samples else None
    num_completed = sum(1 for r in requests if r.finished)
    generated = sum(r.num_output_tokens for r in requests)
    return Report(
        num_requests=args.requests if not requests else len(requests),
        num_completed=num_completed,
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        num_generated_tokens=generated,
        prefix_hit_rate=last.hit_rate if last else 0.0,
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
        paged_real_token_share=real / max(1, sum(s.paged_slots for s in samples)),
        own_max_real_token_share=real / max(1, sum(s.own_max_slots for s in samples)),
        contiguous_real_token_share=real / max(1, sum(s.contiguous_slots for s in samples)),
        max_model_len=args.max_model_len,
        requests_per_replica={replica.replica_id: replica.num_routed for replica in replicas},
    )


def print_report(report: Report) -> None:
    low, high = PAPER_CONTIGUOUS_RANGE
    rows = [
        ("requests completed", f"{report.num_completed} / {report.num_requests}"),
        ("prompt / generated tokens", f"{report.num_prompt_tokens:,} / {report.num_generated_tokens:,}"),
        ("prefix-hit rate (tokens)", f"{report.prefix_hit_rate:.1%}"),
        ("KV usage, mean / peak", f"{report.mean_usage:.1%} / {report.peak_usage:.1%}"),
        ("requests per second", f"{report.requests_per_s:.2f}  ({report.generated_tokens_per_s:,.0f} generated tokens/s)"),
        ("Step RPC latency p50 / p99", f"{report.step_ms_p50:.2f} / {report.step_ms_p99:.2f} ms"),
        ("Execute latency p50 / p99", f"{report.execute_ms_p50:.1f} / {report.execute_ms_p99:.1f} ms"),
        ("preemptions", f"{report.num_preemptions}"),
        ("reserved KV holding real tokens", ""),
        ("  paged (16-token blocks)", f"{report.paged_real_token_share:.1%}"),
        ("  contiguous, each request's own max length", f"{report.own_max_real_token_share:.1%}"),
        (
            f"  contiguous, max-model-len ({report.max_model_len}) each",
            f"{report.contiguous_real_token_share:.1%}  (PagedAttention paper, earlier systems: {low:.1%}-{high:.1%})",
        ),
        ("wall time", f"{report.wall_s:.1f} s"),
    ]
    if len(report.requests_per_replica) > 1:
        rows.append(("requests per replica", ", ".join(f"{k} {v}" for k, v in report.requests_per_replica.items())))
    width = max(len(name) for name, _ in rows)
    print("\nDemo report")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def write_figure(samples: Sequence[Sample], path: Path) -> None:
    """KV usage and prefix-hit rate over time, and the running/waiting requests, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f"writing {path} needs matplotlib: install the demo extra (pip install '.[demo]')") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, constrained_layout=True)
    top.plot(t, [100 * s.usage for s in samples], label="KV usage (blocks in use)")
    top.plot(t, [100 * s.hit_rate for s in samples], label="prefix-hit rate (tokens, cumulative)")
    top.set_ylabel("%")
    top.set_ylim(0, 100)
    top.legend(loc="lower right")
    top.set_title("kv-manager demo: a scaled Mooncake trace")
    bottom.plot(t, [s.num_running for s in samples], label="running")
    bottom.plot(t, [s.num_waiting for s in samples], label="waiting")
    bottom.plot(t, [s.num_preemptions for s in samples], label="preemptions (cumulative)")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("requests")
    bottom.legend(loc="upper right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
