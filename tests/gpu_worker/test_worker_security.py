"""A secured deployment end to end: a multi-tenant manager behind mutual TLS and tokens, and a worker
that reaches it with an operator token and serves its own TLS and tokens.

The worker follows the manager's internal request ids (`tenant/request_id`):
a scheduler driving it names requests that way in Execute.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from certs import make_certs
from e2e_support import DenseOracle
from processes import launch, stop_all

from gpu_worker.sampling import GREEDY
from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateOp, AllocateStatus
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
from kv_manager_service.shared.security import ClientTLS
from reference_scheduler.worker_client import Scheduled, WorkerClient

MODEL = "tiny"
SCHEDULER_TOKEN = "sched-token-Fh2Kq9Lw4Zp7"
WORKER_TOKEN = "worker-token-Ub6Tn1Xc8Mr3"  # the worker's own, at the manager: operator
EXECUTE_TOKEN = "execute-token-Ge5Vd0Sj7Ya2"  # the scheduler's, at the worker


def write_private(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o600)
    return path


def test_a_worker_follows_a_secured_multi_tenant_manager_and_serves_over_tls(tmp_path):
    certs = make_certs(tmp_path / "certs")
    manager_tokens = write_private(
        tmp_path / "manager-tokens.json",
        json.dumps({"sched": SCHEDULER_TOKEN, "workers": {"token": WORKER_TOKEN, "role": "operator"}}),
    )
    (tmp_path / "pool.json").write_text(json.dumps({"num_blocks": 64, "groups": [{"kind": "full_attention", "block_size": 16}]}))
    processes = []
    try:
        manager = launch(
            [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--config", str(tmp_path / "pool.json"),
             "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-ca", str(certs.ca),
             "--auth-token-file", str(manager_tokens), "--multi-tenant",
             "--tenant-secret-file", str(write_private(tmp_path / "secret", "a-tenant-secret-0123456789"))],
            MANAGER_READY_PREFIX, tmp_path / "manager.log",
        )  # fmt: skip
        processes.append(manager)
        worker = launch(
            [sys.executable, "-m", "gpu_worker.cli", "--manager", manager.address, "--port", "0", "--device", "cpu",
             "--backend", "torch", "--model", MODEL, "--worker-id", "worker-0",
             "--manager-tls-ca", str(certs.ca), "--manager-tls-cert", str(certs.client_cert),
             "--manager-tls-key", str(certs.client_key),
             "--manager-token-file", str(write_private(tmp_path / "worker-token", WORKER_TOKEN + "\n")),
             "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
             "--auth-token-file", str(write_private(tmp_path / "worker-tokens", EXECUTE_TOKEN)), "--metrics-port", "0"],
            WORKER_READY_PREFIX, tmp_path / "worker.log",
        )  # fmt: skip
        processes.append(worker)

        tls = ClientTLS(certs.ca, certs.client_cert, certs.client_key)
        tokens = list(range(1, 21))
        with KVManagerClient(manager.address, tls=tls, token=SCHEDULER_TOKEN) as scheduler, WorkerClient(
            worker.address, tls=ClientTLS(certs.ca), token=EXECUTE_TOKEN
        ) as executor:
            step = scheduler.step([AllocateOp("r-1", tokens, len(tokens))])
            assert step.results[0].status is AllocateStatus.OK
            result = executor.execute(step.step_id, [Scheduled("sched/r-1", tokens, 0)])
            assert result.outputs[0].token_id == DenseOracle(MODEL).next_token(tokens, GREEDY)[0]
            scheduler.free(["r-1"])

            # The worker asks for its token, and speaks TLS only.
            with WorkerClient(worker.address, tls=ClientTLS(certs.ca)) as anonymous:
                with pytest.raises(grpc.RpcError) as caught:
                    anonymous.info()
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with WorkerClient(worker.address, token=EXECUTE_TOKEN) as plaintext:
                with pytest.raises(grpc.RpcError) as caught:
                    plaintext.info()
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert executor.info().worker_id == "worker-0"

        # Its metrics likewise: over TLS, for its token only.
        (url,) = [json.loads(line)["metrics_url"] for line in worker.log().splitlines() if '"metrics_url"' in line]
        assert url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(certs.ca))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10, context=trusting)
        assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"].startswith("Bearer ")
        scrape = urllib.request.Request(url, headers={"Authorization": f"Bearer {EXECUTE_TOKEN}"})
        with urllib.request.urlopen(scrape, timeout=10, context=trusting) as response:
            assert b"gpu_worker_" in response.read()
        for process in processes:
            log = process.log()
            for token in (SCHEDULER_TOKEN, WORKER_TOKEN, EXECUTE_TOKEN):
                assert token not in log
    finally:
        failures = stop_all(processes)
    assert not failures, "\n\n".join(failures)


def test_a_worker_with_a_refused_token_stops_with_a_clear_error(tmp_path):
    tokens = write_private(tmp_path / "tokens", "the-managers-token-0123456789")
    manager = launch(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "32",
         "--auth-token-file", str(tokens)],
        MANAGER_READY_PREFIX, tmp_path / "manager.log",
    )  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpu_worker.cli", "--manager", manager.address, "--model", MODEL,
             "--manager-token-file", str(write_private(tmp_path / "wrong", "not-the-managers-token-000"))],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "gpu-worker: error:" in done.stderr and "UNAUTHENTICATED" in done.stderr, done.stderr
        assert "not-the-managers-token-000" not in done.stderr
    finally:
        failures = stop_all([manager])
    assert not failures, "\n\n".join(failures)
