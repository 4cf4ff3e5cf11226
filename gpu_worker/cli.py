"""The `gpu-worker` command line."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Sequence

from gpu_worker.model_config import BUILTIN_MODELS
from kv_manager_service.shared.arg_types import OneLineErrors, package_version
from kv_manager_service.shared.logs import configure_logging

WORKER_EXTRA_MODULES = ("torch", "safetensors", "numpy")  # the worker extra's imports (Triton only for its kernels)


def build_parser(require_manager: bool = True) -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="gpu-worker",
        usage="%(prog)s --manager HOST:PORT[,HOST:PORT...] [options]",
        description="Hold the KV cache of one kv-manager's pool and run a Llama-style decoder over it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--manager", required=require_manager, metavar="HOST:PORT[,HOST:PORT...]",
        help="the kv-manager to follow; or every member of its high-availability group, comma-separated: "
        "the worker follows the primary and, when it changes, the new one",
    )  # fmt: skip
    parser.add_argument(
        "--manager-timeout-s", type=float, default=30.0,
        help="how long to wait at startup for the manager to answer (with several, for one to be the primary), "
        "before loading anything (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default %(default)s)")
    parser.add_argument(
        "--backend", choices=["torch", "triton"],
        help="kernels: torch references, or Triton (on a CPU, in the interpreter: slow) "
        "(default: triton on cuda, torch on cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default="small",
        help=f"a built-in model ({', '.join(BUILTIN_MODELS)}: seeded random weights) or a directory with "
        "config.json and *.safetensors of a Llama, Mistral, Qwen2 or Qwen3 checkpoint (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"],
        help="weights and KV cache (default: float32 on cpu, bfloat16 on cuda)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of a built-in model's random weights (default %(default)s)")
    parser.add_argument(
        "--cuda-graphs", action="store_true",
        help="replay decode steps from CUDA graphs captured at startup, one per batch size of 1, 2, 4, ... up to the "
        "pool's request cap or 256 (needs --device cuda --backend triton)",
    )  # fmt: skip
    parser.add_argument("--worker-id", help="this worker's name at the manager (default: HOST-PID)")
    parser.add_argument(
        "--step-timeout-s", type=float, default=30.0,
        help="how long Execute waits for its step to arrive from the manager (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-port", type=int,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST is --host); 0 picks a free port "
        "(default: no metrics endpoint)",
    )  # fmt: skip
    _add_security_flags(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")
    parser.add_argument(
        "--log-format", default="json", choices=["json", "text"],
        help="logs on stderr: one JSON object per line, or plain text (default %(default)s)",
    )  # fmt: skip
    return parser


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (see docs/security.md)")
    group.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve over TLS with this certificate chain (PEM)")
    group.add_argument("--tls-key", type=Path, metavar="FILE", help="the private key of --tls-cert (PEM)")
    group.add_argument(
        "--tls-ca", type=Path, metavar="FILE", help="mutual TLS: require client certificates signed by this CA (PEM)"
    )
    group.add_argument(
        "--auth-token-file", type=Path, metavar="FILE",
        help="require 'authorization: Bearer <token>' on every call but health checks (the manager's token file format)",
    )  # fmt: skip
    group.add_argument(
        "--manager-tls-ca", type=Path, metavar="FILE", help="reach the manager over TLS: the CA that signed its certificate"
    )
    group.add_argument("--manager-tls-cert", type=Path, metavar="FILE", help="client certificate for the manager's mutual TLS")
    group.add_argument("--manager-tls-key", type=Path, metavar="FILE", help="the private key of --manager-tls-cert")
    group.add_argument(
        "--manager-token-file", type=Path, metavar="FILE",
        help="a file holding this worker's bearer token at the manager (one line; the operator role)",
    )  # fmt: skip


def _security_options(args: argparse.Namespace) -> dict:
    from kv_manager_service.shared import security

    return dict(
        tls=security.server_tls(args.tls_cert, args.tls_key, args.tls_ca),
        tokens=security.load_token_file(args.auth_token_file) if args.auth_token_file else None,
        manager_tls=security.client_tls(args.manager_tls_ca, args.manager_tls_cert, args.manager_tls_key),
        manager_token=security.read_token_file(args.manager_token_file) if args.manager_token_file else None,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags; exits 2 naming an unknown or invalid flag first, and only then a missing --manager.

    argparse reports the first error it meets, and it checks required flags before unknown ones:
    a first pass without --manager required lets a mistyped flag be the error the user sees.
    """
    build_parser(require_manager=False).parse_args(argv)
    args = build_parser().parse_args(argv)
    if args.backend is None:
        args.backend = default_backend(args.device)
    return args


def default_backend(device: str) -> str:
    """Triton on CUDA; torch on a CPU, where Triton kernels run in its interpreter (correct, and slow)."""
    return "triton" if device == "cuda" else "torch"


def backend_caveat(device: str, backend: str) -> str | None:
    """What to warn about a backend chosen for a device, if anything."""
    if device == "cuda" and backend == "torch":
        return (
            "--backend torch on CUDA: the torch reference kernels wait for the device several times per layer; "
            "they are there to check results against, serve with --backend triton"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    caveat = backend_caveat(args.device, args.backend)
    if caveat is not None:
        logging.getLogger("gpu_worker.cli").warning(caveat)
    missing = [name for name in WORKER_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"gpu-worker: error: {', '.join(missing)} not installed; the worker needs the worker extra: "
            "pip install 'kv-manager-service[worker]' (on a CPU-only machine, with -c constraints/cpu.txt)",
            file=sys.stderr,
        )
        return 2
    from gpu_worker.server import WorkerOptions, serve

    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    try:
        options = WorkerOptions(
            manager=args.manager, host=args.host, port=args.port, device=args.device, backend=args.backend,
            model=args.model, dtype=args.dtype, seed=args.seed, step_timeout_s=args.step_timeout_s,
            manager_timeout_s=args.manager_timeout_s, cuda_graphs=args.cuda_graphs,
            metrics_port=args.metrics_port, **_security_options(args), **extra,
        )  # fmt: skip
        return serve(options)
    except (ValueError, ConnectionError, OSError) as error:
        print(f"gpu-worker: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
