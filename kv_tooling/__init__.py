"""Tooling around the product, beside the reference scheduler: the `replay` and `demo` commands
(`commands`, `replay`, `in_process`, `demo`, `demo_flags`, `demo_report`, `progress`), the soak load
(`soak`), the Mooncake workload (`workload`) and the launcher that starts servers as processes for
tests, benches and the demo (`launch`). Nothing of the product imports it, but the `kv-manager`
command, which hands its `replay` and `demo` subcommands to `commands`."""
