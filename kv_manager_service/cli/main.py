"""The `kv-manager` command line: `serve`, and the tooling commands (`replay`, `demo`) it hands to
`kv_tooling` without importing it until they run or `--help` lists them."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Sequence

from kv_manager_service.cli.flags import add_pool_flags, add_security_flags, build_config, security_options
from kv_manager_service.server.journal import DEFAULT_COMPACT_BYTES
from kv_manager_service.shared.arg_types import OneLineErrors, package_version, positive_int
from kv_manager_service.shared.ports import PortUnavailableError


def make_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="kv-manager", description="The KV-cache manager of an LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="serve KVManagerService over gRPC",
        description="Serves one pool over gRPC (kvcache.v1.KVManagerService, with health checking and "
        "reflection). Prints 'KV manager listening on HOST:PORT' when ready; SIGTERM shuts it down gracefully.",
    )
    server = serve.add_argument_group("server")
    limits = serve.add_argument_group("limits and memory")
    mirror = serve.add_argument_group("the Redis mirror (see docs/redis.md)")
    journal = serve.add_argument_group("the journal (restart without loss)")
    observe = serve.add_argument_group("metrics, logs and checks")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    server.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one (default %(default)s)")
    server.add_argument("--replica-id", default=socket.gethostname(), help="this replica's name (default: the host name)")
    server.add_argument(
        "--max-workers", type=positive_int, default=32,
        help="threads that run unary calls; streams, GetStats and health checks run on the event loop and hold "
        "none (default %(default)s)",
    )  # fmt: skip
    server.add_argument(
        "--shutdown-grace-s", type=float, default=5.0,
        help="on SIGTERM, calls in flight get this long before they are cancelled; the process then exits 0 "
        "(default %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-tokens-per-call", type=positive_int, default=1 << 20, help="token ids in one call (default %(default)s)"
    )
    limits.add_argument("--max-ops-per-step", type=positive_int, default=1 << 16, help="ops in one Step (default %(default)s)")
    limits.add_argument(
        "--max-message-bytes", type=positive_int, default=64 << 20, help="largest gRPC message (default %(default)s)"
    )
    server.add_argument(
        "--max-connections", type=positive_int, default=None, metavar="N",
        help="connections served at once; more are closed at accept (default: the open-file limit, ulimit -n, "
        "less 128 kept for the journal, Redis and the rest)",
    )  # fmt: skip
    server.add_argument(
        "--handshake-timeout-s", type=float, default=10.0, metavar="S",
        help="close a connection that has not finished its HTTP/2 (and TLS) handshake within S seconds, so idle "
        "sockets cannot hold the connection slots (default %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--idempotency-retention", type=positive_int, default=100_000,
        help="keyed Steps remembered for retries (idempotency_key); older keys are forgotten (default %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--idempotency-retention-bytes", type=positive_int, default=128 << 20, metavar="BYTES",
        help="at most this many bytes of keys and responses of keyed Steps are remembered (default %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--step-retention-bytes", type=positive_int, default=128 << 20, metavar="BYTES",
        help="the step log WatchSteps serves keeps at most this many bytes of deltas, and at most 100000 "
        "steps; a worker that falls further behind resyncs (default %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--event-retention-bytes", type=positive_int, default=64 << 20, metavar="BYTES",
        help="the event log WatchEvents and the mirror follow keeps about this many bytes of events, and at "
        "most 100000 events; a reader that falls further behind resyncs (default %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--no-memory-check", action="store_true",
        help="start even when the manager's estimated memory (every block of both tiers cached, a compaction's "
        "snapshot, the logs and the key memory full) exceeds what the machine or the cgroup has available",
    )  # fmt: skip
    observe.add_argument(
        "--check-invariants", action="store_true",
        help="debugging and testing aid: check the whole pool's invariants after every mutating call (slow: "
        "O(pool) per call); a broken one is logged as a bug and the call answered INTERNAL",
    )  # fmt: skip
    mirror.add_argument(
        "--redis-url",
        help="mirror the prefix index (hashes only) to this Redis, e.g. redis://host:6379/0, or to the Redis "
        "Cluster this node belongs to (see --redis-cluster); without it the index stays in-process",
    )
    mirror.add_argument(
        "--redis-required", action="store_true",
        help="refuse to start while the Redis of --redis-url does not answer (default: start, serve from this "
        "replica's pool, and write the mirror once Redis answers)",
    )  # fmt: skip
    mirror.add_argument(
        "--redis-cluster", choices=("auto", "yes", "no"), default="auto",
        help="whether --redis-url names a node of a Redis Cluster: auto asks that node (INFO cluster) on first "
        "contact; no skips the question; yes refuses to start against a node with cluster mode off. On a "
        "cluster every key goes to the master of its slot and writes are pipelined per node (default %(default)s)",
    )  # fmt: skip
    mirror.add_argument(
        "--redis-collect-interval-s", type=float, default=300.0, metavar="S",
        help="the replicas' writers delete stale index fields (of earlier incarnations, of replicas gone for "
        "good) at most once per this long, one writer at a time (default %(default)s)",
    )  # fmt: skip
    mirror.add_argument(
        "--redis-collect-after-s", type=float, default=600.0, metavar="S",
        help="a replica id without a lease for this long is gone: its index fields are deleted and it leaves "
        "the replica set (default %(default)s)",
    )  # fmt: skip
    mirror.add_argument(
        "--redis-writer", choices=("thread", "process"), default="thread",
        help="where the mirror's per-key work and Redis writes run: a thread of the manager, or a child process, "
        "which holds the GIL the manager's RPCs need ~10x less per batch but costs some CPU in all; for a host "
        "with a core to spare (default %(default)s)",
    )  # fmt: skip
    mirror.add_argument(
        "--redis-writer-timeout-s", type=float, default=30.0, metavar="S",
        help="with --redis-writer process: a child that answers no batch within S seconds (stopped, stuck) is "
        "killed and replaced, and the mirror resyncs (default %(default)s)",
    )  # fmt: skip
    mirror.add_argument("--model-name", default="default", help="namespaces the mirror's keys (default %(default)s)")
    mirror.add_argument(
        "--lease-ttl-s", type=float, default=10.0,
        help="the replica's lease in Redis expires after this long without a heartbeat; a second manager with "
        "the same --replica-id waits this long for it to lapse, then refuses to start (default %(default)s)",
    )
    ha = serve.add_argument_group("high availability (see docs/high-availability.md)")
    ha.add_argument(
        "--ha-url", metavar="URL",
        help="join the high-availability group of --replica-id whose leadership lease is in this Redis "
        "(redis://HOST:PORT/DB; may be --redis-url's): one member serves, the others follow it as hot standbys "
        "and one takes over when it fails; give that Redis persistence (appendonly yes)",
    )  # fmt: skip
    ha.add_argument(
        "--advertise-address", metavar="HOST:PORT",
        help="the address the other members, clients and workers reach this manager at (default: --host and "
        "the port really bound; set it when --host is 0.0.0.0)",
    )  # fmt: skip
    ha.add_argument(
        "--ha-replication-port", type=int, default=0, metavar="PORT",
        help="the port, on --host, where this member's standbys follow it when it leads; the group's lease in "
        "Redis names it with the host of --advertise-address (default 0: a free port)",
    )  # fmt: skip
    ha.add_argument(
        "--ha-token-file", type=Path, metavar="FILE",
        help="with --auth-token-file: the token this member follows the primary with (one line), whose entry in "
        "the token file has role: member; the replication listener lets in that role only, and it may call no RPC",
    )  # fmt: skip
    ha.add_argument(
        "--ha-tls-ca", type=Path, metavar="FILE", help="with --tls-cert: the CA that signed the other members' certificates"
    )
    ha.add_argument("--ha-tls-cert", type=Path, metavar="FILE", help="the client certificate this member presents to "
                    "the others when they require one (--tls-ca)")  # fmt: skip
    ha.add_argument("--ha-tls-key", type=Path, metavar="FILE", help="the private key of --ha-tls-cert")
    ha.add_argument(
        "--ha-lease-ms", type=int, default=1200, metavar="MS",
        help="the primary's leadership lease: a failed primary is replaced within about this long; it renews "
        "it four times a lease, and stops accepting before it can lapse (default %(default)s)",
    )  # fmt: skip
    ha.add_argument(
        "--ha-sync-timeout-ms", type=int, default=500, metavar="MS",
        help="an in-sync standby that has not acknowledged a record this long after it was needed leaves the "
        "in-sync set (recorded in Redis first, so it cannot be promoted), and the primary goes on without it "
        "(default %(default)s)",
    )  # fmt: skip
    server.add_argument(
        "--worker-timeout-s", type=float, default=10.0,
        help="a worker registered by WatchSteps that has no stream open and sends no AckSteps for this long is "
        "dropped, and the copy-on-write copies only it held are released (default %(default)s)",
    )  # fmt: skip
    mirror.add_argument(
        "--cluster-lookup-timeout-ms", type=int, default=50,
        help="FindCacheHit(cluster=true) waits this long for Redis, then answers from this replica alone; "
        "after a failure, lookups skip Redis for 1 s (default %(default)s)",
    )  # fmt: skip
    observe.add_argument(
        "--metrics-port", type=int,
        help="serve Prometheus metrics at http(s)://HOST:PORT/metrics (HOST is --metrics-host); 0 picks a free "
        "port; with --auth-token-file they need an operator's or the --metrics-token-file token, over HTTPS with "
        "--tls-cert, and a client certificate with --tls-ca (default: no metrics endpoint)",
    )  # fmt: skip
    observe.add_argument(
        "--metrics-host", metavar="HOST",
        help="address the metrics endpoint binds (default: --host); a loopback address serves them without a "
        "token, and without the per-tenant series, when no token may read them",
    )  # fmt: skip
    observe.add_argument(
        "--metrics-token-file", type=Path, metavar="FILE",
        help="a scrape token, one line: it reads /metrics, without the per-tenant series, and calls no RPC",
    )  # fmt: skip
    journal.add_argument(
        "--journal", type=Path,
        help="append every accepted mutation to this file, and restore from it at start: a manager restarted "
        "under the same --replica-id resumes its tables, cache and pending copies (default: no journal)",
    )  # fmt: skip
    journal.add_argument(
        "--journal-fsync", choices=["always", "never"], default="always",
        help="always: each record reaches the disk before the reply (survives power loss); never: it reaches "
        "the operating system before the reply (survives a crash of the process) (default %(default)s)",
    )  # fmt: skip
    journal.add_argument(
        "--journal-compact-bytes", type=int, default=DEFAULT_COMPACT_BYTES, metavar="BYTES",
        help="restart the journal from a snapshot of the whole state once the records since the last snapshot "
        "pass BYTES and the snapshot's size, so a restart replays little; 0 never compacts (default %(default)s)",
    )  # fmt: skip
    observe.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")
    observe.add_argument(
        "--log-format", default="json", choices=["json", "text"],
        help="logs on stderr: one JSON object per line, or plain text (default %(default)s)",
    )  # fmt: skip
    add_security_flags(serve)
    add_pool_flags(serve, default_num_blocks=16_384)
    from kv_tooling.commands import add_tool_commands

    add_tool_commands(commands)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from kv_manager_service.shared.logs import configure_logging
    from kv_manager_service.shared.metrics_endpoint import load_scrape_token_file
    from kv_manager_service.server.ha_options import HAOptions
    from kv_manager_service.shared import security
    from kv_manager_service.server.process import ServerOptions, serve
    from kv_manager_service.server.retention import ServiceLimits

    configure_logging(args.log_level, args.log_format)
    config = build_config(args)
    options = ServerOptions(
        host=args.host,
        port=args.port,
        replica_id=args.replica_id,
        max_workers=args.max_workers,
        grace_s=args.shutdown_grace_s,
        max_message_bytes=args.max_message_bytes,
        max_connections=args.max_connections,
        handshake_timeout_s=args.handshake_timeout_s,
        limits=ServiceLimits(
            max_tokens_per_call=args.max_tokens_per_call,
            max_ops_per_step=args.max_ops_per_step,
            idempotency_retention=args.idempotency_retention,
            idempotency_retention_bytes=args.idempotency_retention_bytes,
            step_retention_bytes=args.step_retention_bytes,
            event_retention_bytes=args.event_retention_bytes,
        ),
        redis_url=args.redis_url,
        redis_required=args.redis_required,
        redis_cluster=args.redis_cluster,
        redis_collect_interval_s=args.redis_collect_interval_s,
        redis_collect_after_s=args.redis_collect_after_s,
        redis_writer=args.redis_writer,
        redis_writer_timeout_s=args.redis_writer_timeout_s,
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
        memory_check=not args.no_memory_check,
        check_invariants=args.check_invariants,
        ha_url=args.ha_url,
        advertise_address=args.advertise_address,
        ha=HAOptions(lease_s=args.ha_lease_ms / 1000, sync_timeout_s=args.ha_sync_timeout_ms / 1000),
        ha_token=security.read_token_file(args.ha_token_file) if args.ha_token_file else None,
        ha_tls=security.client_tls(args.ha_tls_ca, args.ha_tls_cert, args.ha_tls_key),
        ha_replication_port=args.ha_replication_port,
        **security_options(args),
    )
    return serve(config, options)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args)
        from kv_tooling.commands import run_tool_command

        return run_tool_command(args)
    except (ValueError, PortUnavailableError) as e:
        parser.exit(2, f"kv-manager: error: {e}\n")
