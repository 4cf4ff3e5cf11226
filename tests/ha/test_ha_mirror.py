"""The shared prefix index follows the leadership: a new primary takes the replica's mirror lease over
and rewrites its entries in one pass, so other replicas' cluster lookups find its prefixes again."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ha_support import Group, Redis
from processes import launch, stop_all
from svc_support import alloc, connect

from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kvcache.v1 import kv_manager_pb2 as pb

PROMPT = list(range(1000, 1064))  # four full blocks


def _seen_from(stub, replica_id: str) -> int:
    """The tokens of PROMPT that a cluster lookup says `replica_id` caches."""
    response = stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=PROMPT, cluster=True))
    return next((r.num_cached_tokens for r in response.replicas if r.replica_id == replica_id), 0)


def test_a_new_primary_takes_the_mirror_over_and_its_prefixes_are_found_again(
    tmp_path: Path, redis_server: Redis
) -> None:
    group = Group(tmp_path, redis_server.url, extra=("--redis-url", redis_server.url, "--lease-ttl-s", "2"))
    other = launch(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--replica-id", "other",
         "--redis-url", redis_server.url, "--num-blocks", "256"],
        MANAGER_READY_PREFIX, tmp_path / "other.log",
    )  # fmt: skip
    try:
        group.start()
        primary = group.primary()
        standby = group.start()
        group.wait_in_sync(standby, primary)
        _, on_primary = connect(primary.address)
        on_primary.Allocate(alloc("kept", PROMPT))
        expected = on_primary.FindCacheHit(pb.FindCacheHitRequest(token_ids=PROMPT)).num_cached_tokens
        assert expected >= 48
        _, on_other = connect(other.address)
        deadline = time.monotonic() + 10
        while _seen_from(on_other, "r") != expected:
            assert time.monotonic() < deadline, "the primary's prefix never reached the mirror"
            time.sleep(0.02)
        primary.kill()
        killed = time.monotonic()
        missing_s, last = 0.0, killed
        while time.monotonic() - killed < 4.0:  # a lease, the mirror lease's TTL, and the republication
            seen = _seen_from(on_other, "r")
            now = time.monotonic()
            if seen != expected:
                missing_s += now - last
            last = now
            time.sleep(0.01)
        assert group.primary() is standby
        assert _seen_from(on_other, "r") == expected
        print(f"across the failover, cluster lookups missed replica r's prefix for {missing_s:.2f} s of 4 s")
        assert "mirror republished" in standby.log()
    finally:
        failures = group.close() + stop_all([other])
    assert not failures, failures
