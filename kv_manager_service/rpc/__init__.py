"""What the manager, the worker, the client and the schedulers share: the RPC layer.

- `errors`: the typed caller mistakes (pure Python; the core raises them);
- `status`: the one table from error to gRPC status, with `ErrorInfo` details;
- `convert`: the contract's messages <-> the core's value types;
- `security`: TLS and mTLS credentials, bearer tokens and roles;
- `parse_errors`, `metrics`: server interceptors (unparseable requests; RPC timing);
- `logs`: one JSON object per log line;
- `ready_line`, `launch`: a server's ready line, and starting servers as processes;
- `arg_types`: argparse value types shared by the command lines.

This package's `__init__` imports nothing, so importing `errors` costs nothing.
"""
