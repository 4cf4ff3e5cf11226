"""The errors a new user meets in the first minutes, each one line on stderr and exit code 2.

A port in use (gRPC or metrics, manager or worker), a worker started before
its manager, a mistyped flag. Every command runs as a real process, as the
user starts it, and its whole stderr is checked: gRPC's C core must not add
lines of its own.
"""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys

import pytest
from e2e_support import start_stack, stop_stack
from processes import ROOT, free_port, launch, log_records, stop_all

from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX

POOL = {"num_blocks": 64, "groups": [{"kind": "full_attention", "block_size": 16}]}
KV_MANAGER = [sys.executable, "-m", "kv_manager_service.cli"]
GPU_WORKER = [sys.executable, "-m", "gpu_worker.cli"]
RUN_TIMEOUT_S = 120  # a hang guard, not an expectation


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def metrics_port_of(process) -> int:
    url = next(r["metrics_url"] for r in log_records(process) if "metrics_url" in r)
    return int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


def assert_nothing_shares(port: int) -> None:
    """Not even a socket that asks to share the port (SO_REUSEPORT, as gRPC's default servers do) gets it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError) as caught:
            sock.bind(("127.0.0.1", port))
    assert caught.value.errno == errno.EADDRINUSE


def test_a_manager_on_a_port_in_use_says_so_in_one_line(tmp_path):
    first = launch([*KV_MANAGER, "serve", "--port", "0", "--metrics-port", "0", "--num-blocks", "64"],
                   MANAGER_READY_PREFIX, tmp_path / "first.log")  # fmt: skip
    try:
        port, metrics_port = port_of(first.address), metrics_port_of(first)
        second = run([*KV_MANAGER, "serve", "--port", str(port), "--num-blocks", "64"])
        assert (second.returncode, second.stderr) == (2, f"kv-manager: error: port {port} on 127.0.0.1 is in use\n")
        second = run([*KV_MANAGER, "serve", "--port", "0", "--metrics-port", str(metrics_port), "--num-blocks", "64"])
        assert (second.returncode, second.stderr) == (
            2, f"kv-manager: error: metrics port {metrics_port} on 127.0.0.1 is in use\n",
        )  # fmt: skip
        assert_nothing_shares(port)
        assert first.running
    finally:
        assert not stop_all([first])


def test_a_second_worker_on_a_port_in_use_is_refused_and_the_first_keeps_serving(tmp_path):
    stack, processes = start_stack(tmp_path, "tiny", "torch", POOL, worker_args=["--metrics-port", "0"])
    try:
        port, metrics_port = port_of(stack.worker.address), metrics_port_of(stack.worker)
        worker = [*GPU_WORKER, "--manager", stack.manager.address, "--model", "tiny"]
        second = run([*worker, "--port", str(port)])
        assert (second.returncode, second.stderr) == (2, f"gpu-worker: error: port {port} on 127.0.0.1 is in use\n")
        second = run([*worker, "--metrics-port", str(metrics_port)])
        assert (second.returncode, second.stderr) == (
            2, f"gpu-worker: error: metrics port {metrics_port} on 127.0.0.1 is in use\n",
        )  # fmt: skip
        assert_nothing_shares(port)
        assert stack.worker_client.info().worker_id == "worker-0"
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)


def test_a_worker_says_at_once_that_it_waits_for_its_manager_then_names_the_flag():
    address = f"127.0.0.1:{free_port()}"  # no manager there
    done = run([*GPU_WORKER, "--manager", address, "--manager-timeout-s", "0.5", "--model", "tiny"])
    assert done.returncode == 2, done.stderr
    first, last = done.stderr.splitlines()  # the waiting line, then the error: nothing before, between or after
    waiting = json.loads(first)
    assert (waiting["level"], waiting["manager"]) == ("INFO", address), waiting
    assert waiting["msg"] == f"waiting up to 0.5s for the manager at {address}"
    assert last == (
        f"gpu-worker: error: the manager at {address} did not answer within 0.5s: "
        "start it first, or wait longer with --manager-timeout-s"
    )


def test_the_wait_for_the_manager_is_a_documented_flag():
    done = run([*GPU_WORKER, "--help"])
    assert done.returncode == 0 and "--manager-timeout-s" in done.stdout, done.stdout
    done = run([*GPU_WORKER, "--manager", "127.0.0.1:1", "--manager-timeout-s", "0"])
    assert (done.returncode, done.stderr) == (2, "gpu-worker: error: --manager-timeout-s must be > 0, got 0\n")


@pytest.mark.parametrize("command", [GPU_WORKER, [*KV_MANAGER, "serve"]], ids=["gpu-worker", "kv-manager"])
def test_an_unknown_flag_is_the_error_reported(command):
    done = run([*command, "--bogus"])
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()  # one line, no usage before it
    assert "error: unrecognized arguments: --bogus (see " in line and line.endswith(" --help)"), done.stderr


def test_a_worker_without_manager_still_asks_for_it():
    done = run(GPU_WORKER)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "gpu-worker: error: the following arguments are required: --manager (see gpu-worker --help)"
    ]


@pytest.mark.parametrize(
    "command", [[*GPU_WORKER, "--manager", "127.0.0.1:1"], [*KV_MANAGER, "serve"]], ids=["gpu-worker", "kv-manager"]
)
def test_one_port_for_grpc_and_metrics_is_refused(command, request):
    port = str(free_port())
    done = run([*command, "--port", port, "--metrics-port", port])
    message = f"{request.node.callspec.id}: error: --metrics-port must differ from --port, both are {port}\n"
    assert (done.returncode, done.stderr) == (2, message)
