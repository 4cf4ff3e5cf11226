"""`kv-manager serve --metrics-port`: Prometheus metrics that agree with GetStats and the calls made; JSON logs.

The metrics are scraped over HTTP and parsed with prometheus_client's own
parser; every check compares counts, labels and values, never durations.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import urllib.error
import urllib.request
from datetime import datetime, timedelta
from typing import Iterator

import grpc
import pytest
from processes import free_port, log_records
from prometheus_client.parser import text_string_to_metric_families
from svc_support import (
    OK,
    alloc,
    connect,
    op_alloc,
    op_fork,
    op_free,
    pool_config,
    release_everything,
    rpc_error,
    stats,
    step_request,
    stream_error,
)

from kv_manager_service.core import KVCacheConfig
from kv_tooling.launch import LaunchedProcess
from kv_manager_service.shared.logs import JsonFormatter
from kv_manager_service.server.process import ServerOptions, start_server
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}


class Samples:
    """One scrape: sample name and labels -> value; a series not exposed reads as 0."""

    def __init__(self, text: str) -> None:
        self.values: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                self.values[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, frozenset(labels.items())), 0.0)

    def has(self, name: str, **labels: str) -> bool:
        return (name, frozenset(labels.items())) in self.values


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return Samples(response.read().decode())


def metrics_url(process: LaunchedProcess) -> str:
    """The URL the server logged at startup (it was started with --metrics-port 0)."""
    urls = [record["metrics_url"] for record in log_records(process) if "metrics_url" in record]
    assert len(urls) == 1, process.log()
    return urls[0]


@dataclasses.dataclass
class Metered:
    process: LaunchedProcess
    url: str
    stub: pb_grpc.KVManagerServiceStub


@pytest.fixture(scope="module")
def metered(module_server_factory) -> Iterator[Metered]:
    """A server with its metrics endpoint on a free port; each test leaves its pool empty."""
    process = module_server_factory.start("--replica-id", "metered", "--worker-timeout-s", "3600", "--metrics-port", "0", config=pool_config(64))
    channel, stub = connect(process.address)
    with channel:
        yield Metered(process, metrics_url(process), stub)


def test_the_step_histogram_counts_every_step_call(metered):
    stub = metered.stub
    before = scrape(metered.url)
    assert stub.Allocate(alloc("h-0", range(40))).status == OK
    for token in range(5):
        stub.Step(step_request(decode=[("h-0", token)]))
    after = scrape(metered.url)

    def added(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert after.types["kvcache_rpc_duration_seconds"] == "histogram"
    assert added("kvcache_rpc_duration_seconds_count", method="Step") == 5
    assert added("kvcache_rpc_duration_seconds_count", method="Allocate") == 1
    assert added("kvcache_rpc_duration_seconds_sum", method="Step") > 0
    assert after.get("kvcache_rpc_duration_seconds_bucket", method="Step", le="+Inf") == after.get(
        "kvcache_rpc_duration_seconds_count", method="Step"
    )
    # Every unary method has its series from the start; the streams have none.
    assert after.has("kvcache_rpc_duration_seconds_count", method="Fork")
    assert not after.has("kvcache_rpc_duration_seconds_count", method="WatchSteps")
    assert after.get("kvcache_last_step_id") == stats(stub).last_step_id
    release_everything(stub, "metrics-test")


def test_expected_requests_are_gauged(metered):
    stub = metered.stub
    stub.Step(step_request([pb.StepOp(expect=pb.ExpectRequest(request_id="m-waiting", token_ids=range(40)))]))
    samples = scrape(metered.url)
    assert (samples.get("kvcache_num_expected_requests"), samples.get("kvcache_num_expected_blocks")) == (1, 2)
    stub.Step(step_request([op_free("m-waiting")]))  # withdraws it
    assert scrape(metered.url).get("kvcache_num_expected_requests") == 0


def test_pool_metrics_agree_with_get_stats(metered):
    stub = metered.stub
    prompt = list(range(100, 140))  # 2 full blocks and 8 tokens
    assert stub.Allocate(alloc("g-a", prompt)).status == OK
    stub.Free(pb.FreeRequest(request_ids=["g-a"]))
    assert stub.Allocate(alloc("g-b", prompt)).num_computed_tokens == 32  # a prefix hit
    stub.Step(step_request([op_fork("g-b", "g-c")]))
    stub.Allocate(alloc("g-c", [7]))  # writes into the shared last block: a copy, pending until acknowledged
    expected = stats(stub)
    samples = scrape(metered.url)
    assert expected.num_pending_copies > 0 and expected.prefix_cache_hits > 0
    assert samples.get("kvcache_num_blocks") == expected.num_blocks == 64
    assert samples.get("kvcache_num_free_blocks") == expected.num_free_blocks
    assert samples.get("kvcache_usage_ratio") == pytest.approx(expected.usage, rel=1e-12)
    assert samples.get("kvcache_num_requests_running") == expected.num_requests == 2
    assert samples.get("kvcache_prefix_cache_query_tokens_total") == expected.prefix_cache_queries
    assert samples.get("kvcache_prefix_cache_hit_tokens_total") == expected.prefix_cache_hits
    assert samples.get("kvcache_prefix_cache_hit_ratio") == pytest.approx(
        expected.prefix_cache_hits / expected.prefix_cache_queries
    )
    assert samples.get("kvcache_evictions_total") == expected.num_evictions
    assert samples.get("kvcache_num_pending_copies") == expected.num_pending_copies
    assert samples.get("kvcache_num_pins") == expected.num_pins == 0
    assert samples.get("kvcache_num_pinned_blocks") == expected.num_pinned_blocks == 0
    assert samples.get("kvcache_unpinned_blocks_total") == expected.num_unpinned_blocks == 0
    assert samples.get("kvcache_num_expected_requests") == expected.num_expected_requests == 0
    assert samples.get("kvcache_last_step_id") == expected.last_step_id
    assert samples.get("kvcache_last_event_sequence") == expected.last_event_sequence
    assert samples.get("kvcache_mirror_enabled") == 0 and samples.has("kvcache_mirror_failures_total")
    assert samples.types["kvcache_evictions"] == "counter" and samples.types["kvcache_usage_ratio"] == "gauge"
    assert samples.has("process_resident_memory_bytes")
    release_everything(stub, "metrics-test")
    assert scrape(metered.url).get("kvcache_num_requests_running") == 0


def test_rejected_calls_are_counted_by_method_and_code_and_logged_with_their_request_ids(metered):
    stub = metered.stub
    before = scrape(metered.url)
    assert stub.Allocate(alloc("e-live", range(20))).status == OK
    rpc_error(stub.Free, pb.FreeRequest(request_ids=["e-ghost"]))
    # The second op's first allocate carries no prompt: only that op's request is named.
    error = rpc_error(stub.Step, step_request([op_alloc("e-new", range(20)), op_alloc("e-empty", [], 1)]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = rpc_error(stub.Step, step_request(decode=[("e-live", 1), ("e-gone", 2)]))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert stream_error(stub.WatchSteps, pb.WatchStepsRequest(worker_id="")).code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(metered.url)

    def added(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert after.types["kvcache_rpc_errors"] == "counter"
    assert added("kvcache_rpc_errors_total", method="Free", code="NOT_FOUND") == 1
    assert added("kvcache_rpc_errors_total", method="Step", code="INVALID_ARGUMENT") == 1
    assert added("kvcache_rpc_errors_total", method="Step", code="NOT_FOUND") == 1
    assert added("kvcache_rpc_errors_total", method="WatchSteps", code="INVALID_ARGUMENT") == 1
    assert added("kvcache_rpc_errors_total", method="Allocate", code="INVALID_ARGUMENT") == 0
    assert added("kvcache_rpc_duration_seconds_count", method="Step") == 2  # rejected calls are timed too

    rejected = {
        tuple(record.get("request_ids", ())) or record["method"]: record
        for record in log_records(metered.process)
        if " rejected: " in record["msg"]
    }
    free = rejected[("e-ghost",)]
    assert (free["level"], free["logger"], free["method"], free["code"], free["reason"], free["field"]) == (
        "INFO", "kv_manager_service.server.servicer", "Free", "NOT_FOUND", "REQUEST_NOT_FOUND", "request_ids",
    )  # fmt: skip
    assert "e-ghost" in free["msg"]
    empty = rejected[("e-empty",)]
    assert (empty["method"], empty["code"], empty["field"]) == ("Step", "INVALID_ARGUMENT", "ops[1].token_ids")
    gone = rejected[("e-gone",)]
    assert (gone["method"], gone["code"], gone["field"]) == ("Step", "NOT_FOUND", "decode.request_ids[1]")
    watch = rejected["WatchSteps"]
    assert (watch["code"], watch["field"], watch["worker_id"]) == ("INVALID_ARGUMENT", "worker_id", "")
    release_everything(stub, "metrics-test")


def test_every_log_line_is_one_json_object_with_the_core_fields(metered):
    records = log_records(metered.process)
    assert records
    for record in records:
        assert {"ts", "level", "logger", "msg"} <= record.keys(), record
        assert record["level"] in LEVELS, record
        ts = datetime.fromisoformat(record["ts"].replace("Z", "+00:00"))
        assert ts.utcoffset() == timedelta(0) and record["ts"].endswith("Z"), record
    serving = [record for record in records if record["msg"].startswith("serving ")]
    assert len(serving) == 1
    assert (serving[0]["replica_id"], serving[0]["address"]) == ("metered", metered.process.address)
    assert not any("exc" in record for record in records)


def test_text_logs_and_no_metrics_endpoint_without_the_flag(server_factory):
    server = server_factory.start("--replica-id", "plain", "--log-format", "text", config=pool_config(16))
    channel, stub = connect(server.address)
    with channel:
        rpc_error(stub.Free, pb.FreeRequest(request_ids=["t-ghost"]))
    lines = server.log().splitlines()
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    serving = rf'{stamp} INFO kv_manager_service\.server\.process: serving replica_id=plain .* replica_id="plain"'
    rejected = rf'{stamp} INFO kv_manager_service\.server\.servicer: Free rejected: .* request_ids=\["t-ghost"\]'
    assert any(re.match(serving, line) for line in lines), lines
    assert any(re.match(rejected, line) for line in lines), lines
    assert not any("metrics" in line for line in lines), lines


def test_each_server_has_its_own_registry_and_closes_its_endpoint_on_stop(caplog):
    caplog.set_level(logging.INFO, logger="kv_manager_service")
    port = free_port()
    first = start_server(KVCacheConfig(num_blocks=16), ServerOptions(port=0, replica_id="one", metrics_port=port))
    second = start_server(KVCacheConfig(num_blocks=32), ServerOptions(port=0, replica_id="two", metrics_port=0))
    unmetered = start_server(KVCacheConfig(num_blocks=8), ServerOptions(port=0, replica_id="off"))
    try:
        assert first.metrics_address == f"127.0.0.1:{port}"
        assert second.metrics_address is not None and unmetered.metrics_address is None
        logged = [record.metrics_url for record in caplog.records if hasattr(record, "metrics_url")]
        assert logged == [f"http://{first.metrics_address}/metrics", f"http://{second.metrics_address}/metrics"]
        channel, stub = connect(first.address)
        with channel:
            assert stub.Allocate(alloc("only-here", range(20))).status == OK
        one, two = (scrape(f"http://{r.metrics_address}/metrics") for r in (first, second))
        assert (one.get("kvcache_num_blocks"), two.get("kvcache_num_blocks")) == (16, 32)
        assert one.get("kvcache_rpc_duration_seconds_count", method="Allocate") == 1
        assert two.get("kvcache_rpc_duration_seconds_count", method="Allocate") == 0
        assert (one.get("kvcache_num_requests_running"), two.get("kvcache_num_requests_running")) == (1, 0)
    finally:
        for running in (first, second, unmetered):
            running.stop(0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_a_metrics_port_out_of_range_is_refused():
    with pytest.raises(ValueError, match="metrics_port"):
        ServerOptions(metrics_port=70000)


def test_the_json_formatter_keeps_extra_fields_and_tracebacks():
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("kv_manager_service.test", logging.ERROR, __file__, 1, "failed %s", ("x",), exc_info)
    record.__dict__.update({"request_ids": ["r-1", "r-\u00e9"], "step_id": 7, "code": "INTERNAL", "blob": object()})
    line = JsonFormatter().format(record)
    assert "\n" not in line and line.isascii()
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["msg"]) == ("ERROR", "kv_manager_service.test", "failed x")
    assert (entry["request_ids"], entry["step_id"], entry["code"]) == (["r-1", "r-\u00e9"], 7, "INTERNAL")
    assert entry["blob"].startswith("<object object")
    assert entry["exc"].startswith("Traceback") and "ValueError: boom" in entry["exc"]


def test_the_mirror_collectors_figures_are_exported_as_counters():
    from prometheus_client import CollectorRegistry, generate_latest

    from kv_manager_service.core import GroupKind, GroupSpec, KVCacheManager
    from kv_manager_service.mirror.collector import CollectorMetrics
    from kv_manager_service.mirror.writer import MirrorMetrics
    from kv_manager_service.server.replica_metrics import ManagerCollector
    from kv_manager_service.server.replica import Replica

    config = KVCacheConfig(num_blocks=8, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16),), enable_events=True)
    mirror = MirrorMetrics(collector=CollectorMetrics(num_collections=2, num_collected_fields=37, num_collected_replicas=1))
    registry = CollectorRegistry()
    registry.register(ManagerCollector(Replica(KVCacheManager(config), "metrics-test", 1), mirror))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    for name, value in (("kvcache_mirror_collections", 2), ("kvcache_mirror_collected_fields", 37),
                        ("kvcache_mirror_collected_replicas", 1)):  # fmt: skip
        assert families[name].type == "counter" and families[name].samples[0].value == value
