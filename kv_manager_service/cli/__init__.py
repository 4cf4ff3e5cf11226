"""The `kv-manager` command: `main` (the command line, every flag parsed and validated once), and the
`replay` tooling it dispatches to (`replay`, `in_process`)."""
