"""Retention as a user meets it (docs/retention.md): a real `kv-manager serve --journal`, a real gRPC client.

A TTL pin keeps a system prompt cached through pressure that evicts an unpinned
prompt; the manager's clock expires it; the expiry, journaled, survives a
SIGKILL and restart (the pin is not revived), while a pin still running is
restored. A prompt past the quota is refused with the field and the limit.
"""

from __future__ import annotations

import sys
import time

import grpc

from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kvcache.v1 import kv_manager_pb2 as pb
from processes import free_port, launch, stop_all
from svc_support import NO_SPACE, OK, alloc, assert_error, connect, pool_config, rpc_error, snapshot, stats, write_config

BLOCK = 16
SYSTEM_PROMPT = list(range(2 * BLOCK))  # two blocks
AGENT_CONTEXT = list(range(1000, 1000 + BLOCK))  # one block
OTHER_PROMPT = list(range(2000, 2000 + 2 * BLOCK))


def cached_tokens(stub, tokens: list[int]) -> int:
    return stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=tokens + [7])).num_cached_tokens


def test_a_pin_survives_pressure_expires_by_the_managers_clock_and_its_expiry_survives_a_restart(tmp_path):
    config = write_config(tmp_path, pool_config(12, BLOCK))  # 11 usable blocks
    argv = [
        sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", str(free_port()), "--replica-id", "pins",
        "--config", str(config), "--journal", str(tmp_path / "replica.journal"), "--retention-max-pinned-blocks", "4",
        "--check-invariants",
    ]  # fmt: skip
    processes = []
    try:
        processes.append(launch(argv, MANAGER_READY_PREFIX, tmp_path / "manager-0.log"))
        channel, stub = connect(processes[-1].address)
        with channel:
            pin_short = pb.Retention(ttl_ms=2500)
            pin_long = pb.Retention(priority=3, ttl_ms=3_600_000)
            assert stub.Allocate(alloc("sys", SYSTEM_PROMPT, retention=pin_short)).status == OK
            assert stub.Allocate(alloc("agent", AGENT_CONTEXT, retention=pin_long)).status == OK
            assert stub.Allocate(alloc("other", OTHER_PROMPT)).status == OK
            stub.Free(pb.FreeRequest(request_ids=["sys", "agent", "other"]))
            figures = stats(stub)
            assert (figures.num_pins, figures.num_pinned_blocks, figures.num_free_blocks) == (2, 3, 8)

            # Pressure: every evictable block. The unpinned prompt goes; the pinned ones stay.
            assert stub.Allocate(alloc("big", range(5000, 5000 + 9 * BLOCK))).status == NO_SPACE
            assert stub.Allocate(alloc("big", range(5000, 5000 + 8 * BLOCK))).status == OK
            stub.Free(pb.FreeRequest(request_ids=["big"]))
            assert cached_tokens(stub, OTHER_PROMPT) == 0
            assert cached_tokens(stub, SYSTEM_PROMPT) == 2 * BLOCK
            assert cached_tokens(stub, AGENT_CONTEXT) == BLOCK

            # The manager's clock expires the short pin (checked once a second); the blocks stay cached.
            deadline = time.monotonic() + 15
            while stats(stub).num_pins != 1:
                assert time.monotonic() < deadline, "the pin did not expire"
                time.sleep(0.2)
            assert stats(stub).num_pinned_blocks == 1
            assert cached_tokens(stub, SYSTEM_PROMPT) == 2 * BLOCK
            before = snapshot(stub)
        processes[-1].kill()

        processes.append(launch(argv, MANAGER_READY_PREFIX, tmp_path / "manager-1.log"))
        channel, stub = connect(processes[-1].address)
        with channel:
            assert snapshot(stub) == before  # the expiry was replayed, not decided again; the long pin is back
            time.sleep(1.5)  # a clock tick or more: nothing expires that had not
            assert stats(stub).num_pins == 1
            assert stub.Allocate(alloc("big", range(5000, 5000 + 10 * BLOCK))).status == OK
            assert cached_tokens(stub, SYSTEM_PROMPT) == 0  # unpinned: evicted under pressure like any block
            assert cached_tokens(stub, AGENT_CONTEXT) == BLOCK
    finally:
        failures = stop_all(processes)
        assert not failures, "\n\n".join(failures)


def test_a_prompt_the_pin_quota_could_never_hold_is_refused_naming_the_field_and_the_limit(server_factory):
    server = server_factory.start("--retention-max-pinned-blocks", "2", config=pool_config(12, BLOCK))
    channel, stub = connect(server.address)
    with channel:
        error = rpc_error(stub.Allocate, alloc("long", range(3 * BLOCK), retention=pb.Retention(ttl_ms=1000)))
        assert_error(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "retention.ttl_ms")
        assert "retention_max_pinned_blocks is 2" in error.details()
        assert stats(stub).last_step_id == 0
