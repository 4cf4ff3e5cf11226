"""`gpu-worker --metrics-port`: Execute metrics that match the calls made; one JSON log line per failed Execute."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from e2e_support import start_stack, stop_stack
from processes import free_port, log_records
from prometheus_client.parser import text_string_to_metric_families

from kv_manager_service.core import AllocateOp, FreeOp
from kvcache.v1 import worker_pb2 as pb

POOL = {"num_blocks": 64, "groups": [{"kind": "full_attention", "block_size": 16}]}
MODEL = "tiny"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Sample name and labels -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A manager and a worker, both with metrics: the worker's on a port picked here, the manager's on any."""
    port = free_port()
    stack, processes = start_stack(
        tmp_path_factory.mktemp("worker-metrics"), MODEL, "torch", POOL,
        worker_args=["--step-timeout-s", "1", "--metrics-port", str(port)], manager_args=["--metrics-port", "0"],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        yield stack, url
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)
        with pytest.raises(urllib.error.URLError):  # the endpoint closed with the worker
            urllib.request.urlopen(url, timeout=5)


def execute(stack, step_id: int, *requests: pb.ScheduledRequest) -> pb.ExecuteResponse:
    return stack.worker_client.stub.Execute(pb.ExecuteRequest(step_id=step_id, requests=list(requests)), timeout=30)


def scheduled(request_id: str, token_ids: list[int], start_position: int = 0) -> pb.ScheduledRequest:
    return pb.ScheduledRequest(request_id=request_id, token_ids=token_ids, start_position=start_position)


def test_execute_metrics_count_the_executes_made(setup):
    stack, url = setup
    before = scrape(url)
    prompts = {"m-a": list(range(1, 21)), "m-b": list(range(30, 45))}
    step = stack.manager_client.step([AllocateOp(rid, tokens, len(tokens)) for rid, tokens in prompts.items()])
    first = execute(stack, step.step_id, *(scheduled(rid, tokens) for rid, tokens in prompts.items()))
    num_executes, num_requests, num_tokens = 1, 2, 35
    positions = {rid: len(tokens) for rid, tokens in prompts.items()}
    last = [o.token_id for o in first.outputs]
    for _ in range(3):  # decode steps
        step = stack.manager_client.step([AllocateOp(rid, [token], 1) for rid, token in zip(prompts, last)])
        response = execute(stack, step.step_id, *(scheduled(rid, [t], positions[rid]) for rid, t in zip(prompts, last)))
        last = [o.token_id for o in response.outputs]
        positions = {rid: p + 1 for rid, p in positions.items()}
        num_executes, num_requests, num_tokens = num_executes + 1, num_requests + 2, num_tokens + 2
    after = scrape(url)

    def added(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert added("gpu_worker_execute_forward_seconds_count") == num_executes == 4
    assert added("gpu_worker_execute_forward_seconds_sum") > 0
    assert added("gpu_worker_rpc_duration_seconds_count", method="Execute") == num_executes
    assert added("gpu_worker_requests_executed_total") == num_requests
    assert added("gpu_worker_tokens_computed_total") == num_tokens
    assert value(after, "gpu_worker_last_applied_step_id") == step.step_id
    assert value(after, "gpu_worker_kv_cache_bytes") == stack.worker_client.info().kv_cache_bytes
    # The manager's endpoint saw the same steps.
    manager_url = next(r["metrics_url"] for r in log_records(stack.manager) if "metrics_url" in r)
    assert value(scrape(manager_url), "kvcache_last_step_id") == step.step_id
    stack.manager_client.step([FreeOp(tuple(prompts))])


def test_a_failed_execute_is_counted_by_code_and_logged_with_its_step_and_requests(setup):
    stack, url = setup
    before = scrape(url)
    step_id = stack.manager_client.step([AllocateOp("f-a", list(range(1, 11)), 10)]).step_id
    with pytest.raises(grpc.RpcError) as caught:
        execute(stack, step_id, scheduled("f-a", list(range(1, 11))), scheduled("f-nobody", [1]))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as caught:
        execute(stack, step_id + 1000, scheduled("f-a", [1], 10))  # a step that never comes
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    after = scrape(url)

    def added(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert added("gpu_worker_rpc_errors_total", method="Execute", code="NOT_FOUND") == 1
    assert added("gpu_worker_rpc_errors_total", method="Execute", code="UNAVAILABLE") == 1
    assert added("gpu_worker_rpc_duration_seconds_count", method="Execute") == 2
    assert added("gpu_worker_execute_forward_seconds_count") == 0  # only successes have a forward time
    assert added("gpu_worker_requests_executed_total") == 0

    failed = [r for r in log_records(stack.worker) if r["msg"].startswith("Execute of step")]
    by_code = {r["code"]: r for r in failed if r["step_id"] in (step_id, step_id + 1000)}
    not_found, unavailable = by_code["NOT_FOUND"], by_code["UNAVAILABLE"]
    assert (not_found["level"], not_found["logger"]) == ("WARNING", "gpu_worker.service")
    assert not_found["worker_id"] == "worker-0"
    assert not_found["step_id"] == step_id and "f-nobody" in not_found["request_ids"]
    assert (unavailable["step_id"], unavailable["request_ids"], unavailable["field"]) == (step_id + 1000, ["f-a"], None)
    stack.manager_client.step([FreeOp(("f-a",))])


def test_every_worker_log_line_is_one_json_object(setup):
    stack, _ = setup
    for process in (stack.worker, stack.manager):
        records = log_records(process)
        assert records
        for record in records:
            assert {"ts", "level", "logger", "msg"} <= record.keys(), record
            assert "exc" not in record, record
    started = [r for r in log_records(stack.worker) if r["msg"].startswith("worker worker-0: model ")]
    assert len(started) == 1
    assert (started[0]["worker_id"], started[0]["manager"]) == ("worker-0", stack.manager.address)
