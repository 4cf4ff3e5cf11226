"""The manager's server: a replica of the block pool behind `KVManagerService`.

- `process`: the server process (options, gRPC server, health, shutdown);
- `servicer`: translates between the contract and the replica, and scopes calls to their caller;
- `journal`, `idempotency`, `tenancy`, `broadcast_log`: the replica's parts;
- `metrics`: the replica's figures for Prometheus.
"""
