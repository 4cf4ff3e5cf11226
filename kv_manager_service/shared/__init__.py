"""What every process shares: the manager, the worker, the client and the schedulers. It imports
nothing of the manager, so the worker and the schedulers never reach the core through it.

The values of the contract, pure Python (the core speaks them, the client returns them):
- `ops`: the operations and their results; `events`: the prefix cache's changes;
- `config`: a pool's configuration; `hash_types`: block hashes and what they are made from;
- `errors`: the typed caller mistakes.

The processes' plumbing:
- `status`: the one table from error to gRPC status, with `ErrorInfo` details;
- `security`: TLS and mTLS credentials, bearer tokens and roles;
- `bounds`, `parse_errors`: every request's limits, checked before any handler;
- `rpc_metrics`, `metrics_endpoint`: RPC timing, and the /metrics endpoint with who may read it;
- `aio`: the grpc.aio server's event-loop thread; `logs`: one JSON object per log line;
- `connections`: how a server bounds its connections (idle sockets cannot starve real clients);
- `ports`, `ready_line`, `termination`: listening, saying so, and stopping on a signal;
- `arg_types`: argparse value types shared by the command lines.

This package's `__init__` imports nothing, so importing `errors` costs nothing.
"""
