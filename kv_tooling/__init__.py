"""Tooling around the product, beside the reference scheduler: the `replay`, `conversations` and `demo`
commands (`commands`, `replay` and its step-time `cost_model`, `in_process`, `conversations`, `demo`,
`demo_flags`, `demo_report`, `progress`), the soak load (`soak`), the Mooncake workload (`workload`)
and the launcher that starts servers as processes for
tests, benches and the demo (`launch`). Nothing of the product imports it, but the `kv-manager`
command, which hands its `replay`, `conversations` and `demo` subcommands to `commands`."""
