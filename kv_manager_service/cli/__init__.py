"""The `kv-manager` command: `main` (the parser, `serve`, and the hand-off of the tooling commands) and
`flags` (the pool and security flags, parsed and validated once)."""
