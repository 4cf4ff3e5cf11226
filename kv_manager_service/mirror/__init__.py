"""The Redis mirror of the prefix index: which replica caches which block hash.

- `schema`: the key schema, leases and what a reader makes of them;
- `writer`: the background writer of one replica's cached hashes;
- `lookup`: the cluster lookup (every live replica's longest cached prefix) and `choose_replica`.
"""
