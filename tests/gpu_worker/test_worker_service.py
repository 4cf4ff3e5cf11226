"""WorkerService over real gRPC: every refusal names its field, and changes nothing."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from e2e_support import DenseOracle, start_stack, stop_stack
from processes import launch, stop_all

from gpu_worker.sampling import GREEDY
from kv_manager_service.core import AllocateOp
from kv_manager_service.rpc.ready_line import MANAGER_READY_PREFIX
from kv_manager_service.rpc.status import error_info
from kvcache.v1 import worker_pb2 as pb

POOL = {"num_blocks": 64, "groups": [{"kind": "full_attention", "block_size": 16}]}
MODEL = "tiny"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    stack, processes = start_stack(
        tmp_path_factory.mktemp("worker-service"), MODEL, "torch", POOL, worker_args=["--step-timeout-s", "1"]
    )
    try:
        yield stack
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)


def execute(stack, step_id, *requests):
    return stack.worker_client.stub.Execute(pb.ExecuteRequest(step_id=step_id, requests=list(requests)), timeout=30)


def scheduled(request_id, token_ids, start_position=0):
    return pb.ScheduledRequest(request_id=request_id, token_ids=token_ids, start_position=start_position)


def refused(call) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info = error_info(caught.value)
    return caught.value.code(), (info.metadata.get("field") if info is not None else None)


def test_worker_info_describes_the_model_and_the_cache(setup):
    info = setup.worker_client.info()
    assert (info.worker_id, info.model, info.device, info.backend, info.dtype) == ("worker-0", MODEL, "cpu", "torch", "float32")
    assert (info.num_layers, info.num_blocks, info.block_size) == (2, 64, 16)
    # 2 layers x 64 blocks x (K, V) x 16 slots x 2 KV heads x 16 dims x 4 bytes
    assert info.kv_cache_bytes == 2 * 64 * 2 * 16 * 2 * 16 * 4


def test_bad_executes_are_refused_with_their_field_and_change_nothing(setup):
    stack = setup
    oracle = DenseOracle(MODEL)
    tokens = list(range(1, 21))
    step = stack.manager_client.step([AllocateOp("err-a", tokens, len(tokens))])
    n = step.step_id
    cases = {
        "step 0": (lambda: execute(stack, 0, scheduled("err-a", tokens)), grpc.StatusCode.INVALID_ARGUMENT, "step_id"),
        "no request": (lambda: execute(stack, n), grpc.StatusCode.INVALID_ARGUMENT, "requests"),
        "no token": (lambda: execute(stack, n, scheduled("err-a", [])), grpc.StatusCode.INVALID_ARGUMENT, "requests[0].token_ids"),
        "token past the vocabulary": (
            lambda: execute(stack, n, scheduled("err-a", [256] + tokens[1:])), grpc.StatusCode.INVALID_ARGUMENT, "requests[0].token_ids",
        ),
        "twice in one call": (
            lambda: execute(stack, n, scheduled("err-a", tokens), scheduled("err-a", tokens)),
            grpc.StatusCode.INVALID_ARGUMENT, "requests[1].request_id",
        ),
        "unknown request": (lambda: execute(stack, n, scheduled("nobody", [1])), grpc.StatusCode.NOT_FOUND, "request_id"),
        "past its blocks": (
            lambda: execute(stack, n, scheduled("err-a", tokens, 20)), grpc.StatusCode.FAILED_PRECONDITION, "requests[0].start_position",
        ),
        "a step that never comes": (lambda: execute(stack, n + 1000, scheduled("err-a", tokens)), grpc.StatusCode.UNAVAILABLE, None),
    }  # fmt: skip
    for name, (call, code, field) in cases.items():
        assert refused(call) == (code, field), name
    # Nothing was computed or stored: the real call still matches the dense pass.
    first = execute(stack, n, scheduled("err-a", tokens)).outputs[0]
    assert first.token_id == oracle.next_token(tokens, GREEDY)[0]
    tokens.append(first.token_id)
    later = stack.manager_client.step([AllocateOp("err-a", tokens[-1:], 1)]).step_id
    second = execute(stack, later, scheduled("err-a", tokens[-1:], 20)).outputs[0]
    assert second.token_id == oracle.next_token(tokens, GREEDY)[0]
    # The tables here are at step `later` now: step n cannot run again.
    assert refused(lambda: execute(stack, n, scheduled("err-a", tokens[-1:], 20))) == (
        grpc.StatusCode.FAILED_PRECONDITION, "step_id",
    )  # fmt: skip
    stack.manager_client.free(["err-a"])


def test_a_worker_refuses_a_pool_it_cannot_run(tmp_path):
    """A mamba group (or a model/pool mismatch) stops the worker at startup with a clear error."""
    config = tmp_path / "pool.json"
    config.write_text('{"num_blocks": 32, "groups": [{"kind": "full_attention", "block_size": 16}, {"kind": "mamba", "block_size": 16}]}')
    manager = launch(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--config", str(config)],
        MANAGER_READY_PREFIX,
        tmp_path / "manager.log",
    )
    try:
        for model, message in (("tiny", "GROUP_KIND_MAMBA"), ("no-such-model", "neither a built-in model")):
            done = subprocess.run(
                [sys.executable, "-m", "gpu_worker.cli", "--manager", manager.address, "--model", model],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 2 and message in done.stderr, done.stderr
    finally:
        assert not stop_all([manager])
