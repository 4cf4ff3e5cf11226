"""The `kv-manager` command line: every flag is parsed and validated here, once."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

from kv_manager_service.rpc.arg_types import fraction, non_negative_int, positive_int
from kv_manager_service.rpc.ports import PortUnavailableError
from kv_manager_service.server.journal import DEFAULT_COMPACT_BYTES
from kv_manager_service.core import GroupKind, GroupSpec, HashAlgorithm, KVCacheConfig, KVCacheManager

# The trace ships in the repository's data/ folder, beside the package.
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"


def add_pool_flags(parser: argparse.ArgumentParser, default_num_blocks: int) -> None:
    """Flags that shape the pool; `build_config` turns them into a KVCacheConfig."""
    group = parser.add_argument_group("pool")
    group.add_argument(
        "--config",
        type=Path,
        help="YAML or JSON file with num_blocks, groups ([{kind, block_size, sliding_window, chunk_size}]), "
        "hashing and limits; flags override it",
    )
    group.add_argument("--num-blocks", type=int, help=f"blocks in the pool, null block included (default {default_num_blocks})")
    group.add_argument(
        "--block-size", type=int, help="tokens per block of a single full-attention group (default 16); "
        "an error when --config lists groups"
    )
    group.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached blocks")
    group.add_argument(
        "--hash-algorithm",
        choices=[a.value for a in HashAlgorithm],
        help="block hash (default sha256_cbor; xxh3_128 needs --hash-seed)",
    )
    group.add_argument("--hash-seed", help="seed of the root hash; the secret key of xxh3_128")
    group.add_argument(
        "--num-host-blocks", type=non_negative_int,
        help="blocks of a host-memory tier behind the pool (write-back on eviction; full-attention groups "
        "only); 0 means none (default: the config file's num_host_blocks, else 0)",
    )  # fmt: skip
    parser.set_defaults(default_num_blocks=default_num_blocks)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """TLS, bearer tokens, tenants and Redis credentials; `security_options` reads them. Secrets come from files only."""
    group = parser.add_argument_group("security (see the README's Security section)")
    group.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve gRPC over TLS with this certificate chain (PEM)")
    group.add_argument("--tls-key", type=Path, metavar="FILE", help="the private key of --tls-cert (PEM)")
    group.add_argument(
        "--tls-ca", type=Path, metavar="FILE",
        help="mutual TLS: require every client to present a certificate signed by this CA (PEM)",
    )  # fmt: skip
    group.add_argument(
        "--auth-token-file", type=Path, metavar="FILE",
        help="require 'authorization: Bearer <token>' on every call but health checks: a YAML/JSON mapping "
        "tenant -> token (or -> {token, role: tenant|operator, quota_blocks}), or one token (tenant 'default', "
        "operator role)",
    )  # fmt: skip
    group.add_argument(
        "--multi-tenant", action="store_true",
        help="isolate the token file's tenants: their own cache salts, request ids and block quotas "
        "(needs --auth-token-file and --tenant-secret-file; refuses xxh3_128)",
    )  # fmt: skip
    group.add_argument(
        "--tenant-secret-file", type=Path, metavar="FILE",
        help="the secret that keys each tenant's cache salt (at least 16 bytes); replicas of one deployment share it",
    )  # fmt: skip
    group.add_argument(
        "--tenant-quota-blocks", type=positive_int, metavar="N",
        help="blocks a tenant may hold, unless its token entry sets quota_blocks (default: no quota)",
    )  # fmt: skip
    group.add_argument("--redis-tls-ca", type=Path, metavar="FILE", help="CA that signed Redis's certificate (rediss:// URLs)")
    group.add_argument(
        "--redis-password-file", type=Path, metavar="FILE",
        help="Redis AUTH password, read from a file (instead of redis://:PASSWORD@host in --redis-url)",
    )  # fmt: skip


def security_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerOptions fields of `add_security_flags`, with their files read."""
    from kv_manager_service.rpc import security

    return dict(
        tls=security.server_tls(args.tls_cert, args.tls_key, args.tls_ca),
        tokens=security.load_token_file(args.auth_token_file) if args.auth_token_file else None,
        multi_tenant=args.multi_tenant,
        tenant_secret=(
            security.read_secret_file(args.tenant_secret_file, "--tenant-secret-file") if args.tenant_secret_file else None
        ),
        tenant_quota_blocks=args.tenant_quota_blocks,
        redis_tls_ca=args.redis_tls_ca,
        redis_password=(
            security.read_secret_file(args.redis_password_file, "--redis-password-file", min_bytes=1).decode()
            if args.redis_password_file
            else None
        ),
    )


def build_config(args: argparse.Namespace, **overrides: Any) -> KVCacheConfig:
    """The one place where the config file, the flags and `overrides` meet."""
    values: dict[str, Any] = {}
    if args.config is not None:
        values = _load_config_file(args.config)
    if args.block_size is not None:
        if "groups" in values:
            raise ValueError(f"--block-size defines a single full-attention group, but {args.config} lists groups")
        values["groups"] = (GroupSpec(GroupKind.FULL_ATTENTION, args.block_size),)
    if args.num_blocks is not None:
        values["num_blocks"] = args.num_blocks
    values.setdefault("num_blocks", args.default_num_blocks)
    if args.no_prefix_caching:
        values["enable_prefix_caching"] = False
    if args.hash_algorithm is not None:
        values["hash_algorithm"] = args.hash_algorithm
    if args.hash_seed is not None:
        values["hash_seed"] = args.hash_seed
    if args.num_host_blocks is not None:
        values["num_host_blocks"] = args.num_host_blocks
    values.update(overrides)
    return KVCacheConfig.from_dict(values)


def _load_config_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-manager", description="The KV-cache manager of an LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser(
        "replay",
        help="replay the Mooncake trace through the block manager and report hits, usage and speed",
        description="Replays a Mooncake trace through the core with the reference scheduler's loop "
        "(continuous batching, chunked prefill, preemption on NO_SPACE). No model runs: only the block "
        "manager works.",
    )
    replay.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSON-lines trace (default: %(default)s)")
    replay.add_argument("--requests", type=positive_int, default=400, help="replay the first N requests (default %(default)s)")
    replay.add_argument(
        "--scale",
        type=fraction,
        default=1.0,
        help="shrink every 512-token trace block to round(512 * SCALE) tokens, outputs likewise (default %(default)s)",
    )
    replay.add_argument("--token-budget", type=positive_int, default=8192, help="tokens per scheduler step (default %(default)s)")
    replay.add_argument("--max-running", type=positive_int, default=256, help="requests running at once (default %(default)s)")
    add_pool_flags(replay, default_num_blocks=100_000)

    serve = commands.add_parser(
        "serve",
        help="serve KVManagerService over gRPC",
        description="Serves one pool over gRPC (kvcache.v1.KVManagerService, with health checking and "
        "reflection). Prints 'KV manager listening on HOST:PORT' when ready; SIGTERM shuts it down gracefully.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    serve.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one (default %(default)s)")
    serve.add_argument("--replica-id", default=socket.gethostname(), help="this replica's name (default: the host name)")
    serve.add_argument(
        "--max-workers", type=positive_int, default=32,
        help="threads that run unary calls; streams, GetStats and health checks run on the event loop and hold "
        "none (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--shutdown-grace-s", type=float, default=5.0,
        help="on SIGTERM, calls in flight get this long before they are cancelled; the process then exits 0 "
        "(default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--max-tokens-per-call", type=positive_int, default=1 << 20, help="token ids in one call (default %(default)s)"
    )
    serve.add_argument("--max-ops-per-step", type=positive_int, default=1 << 16, help="ops in one Step (default %(default)s)")
    serve.add_argument(
        "--max-message-bytes", type=positive_int, default=64 << 20, help="largest gRPC message (default %(default)s)"
    )
    serve.add_argument(
        "--idempotency-retention", type=positive_int, default=100_000,
        help="keyed Steps remembered for retries (idempotency_key); older keys are forgotten (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--idempotency-retention-bytes", type=positive_int, default=128 << 20, metavar="BYTES",
        help="at most this many bytes of keys and responses of keyed Steps are remembered (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--step-retention-bytes", type=positive_int, default=128 << 20, metavar="BYTES",
        help="the step log WatchSteps serves keeps at most this many bytes of deltas, and at most 100000 "
        "steps; a worker that falls further behind resyncs (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--event-retention-bytes", type=positive_int, default=64 << 20, metavar="BYTES",
        help="the event log WatchEvents and the mirror follow keeps about this many bytes of events, and at "
        "most 100000 events; a reader that falls further behind resyncs (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--check-invariants", action="store_true",
        help="debugging and testing aid: check the whole pool's invariants after every mutating call (slow: "
        "O(pool) per call); a broken one is logged as a bug and the call answered INTERNAL",
    )  # fmt: skip
    serve.add_argument(
        "--redis-url",
        help="mirror the prefix index (hashes only) to this Redis, e.g. redis://host:6379/0, or to the Redis "
        "Cluster this node belongs to (see --redis-cluster); without it the index stays in-process",
    )
    serve.add_argument(
        "--redis-cluster", choices=("auto", "yes", "no"), default="auto",
        help="whether --redis-url names a node of a Redis Cluster: auto asks that node (INFO cluster) on first "
        "contact; no skips the question; yes refuses to start against a node with cluster mode off. On a "
        "cluster every key goes to the master of its slot and writes are pipelined per node (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--redis-collect-interval-s", type=float, default=300.0, metavar="S",
        help="the replicas' writers delete stale index fields (of earlier incarnations, of replicas gone for "
        "good) at most once per this long, one writer at a time (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--redis-collect-after-s", type=float, default=600.0, metavar="S",
        help="a replica id without a lease for this long is gone: its index fields are deleted and it leaves "
        "the replica set (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--redis-writer", choices=("thread", "process"), default="thread",
        help="where the mirror's per-key work and Redis writes run: a thread of the manager, or a child process, "
        "which holds the GIL the manager's RPCs need ~10x less per batch but costs some CPU in all; for a host "
        "with a core to spare (default %(default)s)",
    )  # fmt: skip
    serve.add_argument("--model-name", default="default", help="namespaces the mirror's keys (default %(default)s)")
    serve.add_argument(
        "--lease-ttl-s", type=float, default=10.0,
        help="the replica's lease in Redis expires after this long without a heartbeat; a second manager with "
        "the same --replica-id waits this long for it to lapse, then refuses to start (default %(default)s)",
    )
    serve.add_argument(
        "--worker-timeout-s", type=float, default=10.0,
        help="a worker registered by WatchSteps that has no stream open and sends no AckSteps for this long is "
        "dropped, and the copy-on-write copies only it held are released (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--cluster-lookup-timeout-ms", type=int, default=50,
        help="FindCacheHit(cluster=true) waits this long for Redis, then answers from this replica alone; "
        "after a failure, lookups skip Redis for 1 s (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--metrics-port", type=int,
        help="serve Prometheus metrics at http(s)://HOST:PORT/metrics (HOST is --metrics-host); 0 picks a free "
        "port; with --auth-token-file they need an operator's or the --metrics-token-file token, over HTTPS with "
        "--tls-cert, and a client certificate with --tls-ca (default: no metrics endpoint)",
    )  # fmt: skip
    serve.add_argument(
        "--metrics-host", metavar="HOST",
        help="address the metrics endpoint binds (default: --host); a loopback address serves them without a "
        "token, and without the per-tenant series, when no token may read them",
    )  # fmt: skip
    serve.add_argument(
        "--metrics-token-file", type=Path, metavar="FILE",
        help="a scrape token, one line: it reads /metrics, without the per-tenant series, and calls no RPC",
    )  # fmt: skip
    serve.add_argument(
        "--journal", type=Path,
        help="append every accepted mutation to this file, and restore from it at start: a manager restarted "
        "under the same --replica-id resumes its tables, cache and pending copies (default: no journal)",
    )  # fmt: skip
    serve.add_argument(
        "--journal-fsync", choices=["always", "never"], default="always",
        help="always: each record reaches the disk before the reply (survives power loss); never: it reaches "
        "the operating system before the reply (survives a crash of the process) (default %(default)s)",
    )  # fmt: skip
    serve.add_argument(
        "--journal-compact-bytes", type=int, default=DEFAULT_COMPACT_BYTES, metavar="BYTES",
        help="restart the journal from a snapshot of the whole state once the records since the last snapshot "
        "pass BYTES and the snapshot's size, so a restart replays little; 0 never compacts (default %(default)s)",
    )  # fmt: skip
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")
    serve.add_argument(
        "--log-format", default="json", choices=["json", "text"],
        help="logs on stderr: one JSON object per line, or plain text (default %(default)s)",
    )  # fmt: skip
    add_security_flags(serve)
    add_pool_flags(serve, default_num_blocks=16_384)

    demo = commands.add_parser(
        "demo",
        help="run a manager, a worker and a scheduler on a scaled Mooncake trace, and report",
        description="Starts a kv-manager and a gpu-worker (CPU, torch backend) as local processes, or "
        "connects to running ones (--replica), and replays a window of the Mooncake trace (by default one "
        "where conversations continue and share prefixes) through the reference scheduler (continuous "
        "batching, chunked prefill, preemption on NO_SPACE). "
        "Prints a report and writes report.json and demo.png. Needs the worker extra.",
    )
    from reference_scheduler.demo_flags import add_demo_flags

    add_demo_flags(demo)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from kv_manager_service.rpc.logs import configure_logging
    from kv_manager_service.rpc.metrics_endpoint import load_scrape_token_file
    from kv_manager_service.server.process import ServerOptions, serve
    from kv_manager_service.server.replica import ServiceLimits

    configure_logging(args.log_level, args.log_format)
    config = build_config(args)
    options = ServerOptions(
        host=args.host,
        port=args.port,
        replica_id=args.replica_id,
        max_workers=args.max_workers,
        grace_s=args.shutdown_grace_s,
        max_message_bytes=args.max_message_bytes,
        limits=ServiceLimits(
            max_tokens_per_call=args.max_tokens_per_call,
            max_ops_per_step=args.max_ops_per_step,
            idempotency_retention=args.idempotency_retention,
            idempotency_retention_bytes=args.idempotency_retention_bytes,
            step_retention_bytes=args.step_retention_bytes,
            event_retention_bytes=args.event_retention_bytes,
        ),
        redis_url=args.redis_url,
        redis_cluster=args.redis_cluster,
        redis_collect_interval_s=args.redis_collect_interval_s,
        redis_collect_after_s=args.redis_collect_after_s,
        redis_writer=args.redis_writer,
        model_name=args.model_name,
        lease_ttl_s=args.lease_ttl_s,
        worker_timeout_s=args.worker_timeout_s,
        cluster_lookup_timeout_ms=args.cluster_lookup_timeout_ms,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_tokens=load_scrape_token_file(args.metrics_token_file) if args.metrics_token_file else None,
        journal_path=args.journal,
        journal_fsync=args.journal_fsync,
        journal_compact_bytes=args.journal_compact_bytes,
        check_invariants=args.check_invariants,
        **security_options(args),
    )
    return serve(config, options)


def run_replay(args: argparse.Namespace) -> int:
    from kv_manager_service.cli.replay import ReplayConfig, ReplayProgress, replay
    from kv_manager_service.workload import TokenExpander, load_trace

    config = build_config(args)
    if not args.trace.exists():
        raise ValueError(f"trace file {args.trace} not found; pass --trace PATH")
    records = load_trace(args.trace, limit=args.requests)
    manager = KVCacheManager(config)
    expander = TokenExpander(scale=args.scale)
    replay_config = ReplayConfig(token_budget=args.token_budget, max_num_running=args.max_running, progress_every_steps=200)
    block_size = config.groups[0].block_size
    print(
        f"Replaying {len(records)} requests of {args.trace.name} (scale {args.scale}) through a pool of "
        f"{config.num_blocks} blocks x {block_size} tokens, prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}"
        + (f", host tier of {config.num_host_blocks} blocks" if config.num_host_blocks else ""),
        file=sys.stderr,
    )

    def show(p: ReplayProgress) -> None:
        stats = manager.stats()
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        print(
            f"  step {p.num_steps:>6}: {p.num_completed:>5}/{len(records)} done, {p.num_running:>3} running, "
            f"usage {p.usage:6.1%}, prefix hits {hit_rate:6.1%}",
            file=sys.stderr,
        )

    result = replay(manager, records, expander, replay_config, progress=show)
    rows = [
        ("requests completed", f"{result.num_completed} / {result.num_requests}"),
        ("prompt tokens", f"{result.num_prompt_tokens:,}"),
        ("output tokens", f"{result.num_output_tokens:,}"),
        ("scheduler steps", f"{result.num_steps:,}"),
        ("prefix-hit rate (tokens)", f"{result.prefix_hit_rate:.1%}"),
        ("peak KV usage", f"{result.peak_usage:.1%}"),
        ("preemptions", f"{result.num_preemptions}"),
        ("evictions", f"{manager.stats().num_evictions:,}"),
    ]
    if config.num_host_blocks:
        generated = max(result.num_output_tokens, 1)
        offloaded, onloaded = result.num_offloaded_blocks, result.num_onloaded_blocks
        rows += [
            ("device hit rate (tokens)", f"{result.device_hit_rate:.1%}"),
            ("host hit rate (tokens)", f"{result.host_hit_rate:.1%}"),
            ("offloaded blocks", f"{offloaded:,} ({offloaded / generated:.2f} per output token)"),
            ("onloaded blocks", f"{onloaded:,} ({onloaded / generated:.2f} per output token)"),
            ("host evictions", f"{result.num_host_evictions:,}"),
            ("offloads dropped (host pinned)", f"{result.num_dropped_offloads:,}"),
        ]
    rows += [
        ("wall time", f"{result.wall_s:.2f} s"),
        ("requests per second", f"{result.requests_per_s:,.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nReplay report")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "replay":
            return run_replay(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "demo":
            from reference_scheduler.demo import run_demo

            return run_demo(args)
    except (ValueError, PortUnavailableError) as e:
        parser.exit(2, f"kv-manager: error: {e}\n")
    return 1

