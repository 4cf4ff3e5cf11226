"""The acknowledged history stays one linear sequence through Redis outages and random interleavings of
kills, pauses and restarts of members and of Redis; the serving primary's state is its replay."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from ha_support import LEASE_MS, THOROUGH, Group, KeyedClients, Redis, assert_history_replays, is_primary
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

LEASE_S = LEASE_MS / 1000


def test_a_redis_restart_without_its_data_loses_no_step_and_no_step_is_acknowledged_twice(
    group: Group, redis_server: Redis
) -> None:
    group.start()
    primary = group.primary()
    group.wait_in_sync(group.start(), primary)
    clients = KeyedClients(group, 2)
    try:
        clients.wait_for(30)
        redis_server.kill()  # no persistence: the lease, the token and the in-sync set are gone
        killed = time.monotonic()
        time.sleep(LEASE_S * 2)
        # The primary served while its lease allowed, and no longer: nobody serves without Redis.
        assert not any(is_primary(m.address) for m in group.running)
        acked_during = len(clients.acked)
        time.sleep(0.5)
        assert len(clients.acked) == acked_during
        redis_server.start()
        assert group.primary() is primary  # it re-establishes its lease under a higher token
        clients.wait_for(30)
        assert time.monotonic() - killed > LEASE_S
    finally:
        clients.stop()
    assert_history_replays(group, clients)


EVENTS = ("kill_primary", "pause_primary", "kill_standby", "restart_redis", "steps")


def _apply(event: str, group: Group, redis_server: Redis, clients: KeyedClients) -> None:
    """One event, then the group back to a primary and an in-sync standby."""
    primary = group.primary()
    (standby,) = [m for m in group.running if m is not primary]
    if event == "kill_primary":
        primary.kill()
    elif event == "pause_primary":
        os.kill(primary.pid, signal.SIGSTOP)
        time.sleep(LEASE_S * 1.5)
        os.kill(primary.pid, signal.SIGCONT)
    elif event == "kill_standby":
        standby.kill()
    elif event == "restart_redis":
        redis_server.kill()
        time.sleep(LEASE_S / 2)
        redis_server.start()
    clients.wait_for(10)
    primary = group.primary()
    if len(group.running) < 2:
        group.wait_in_sync(group.start(), primary)
    else:
        (standby,) = [m for m in group.running if m is not primary]
        group.wait_in_sync(standby, primary)


@settings(
    max_examples=4 if THOROUGH else 1,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
    phases=[Phase.explicit, Phase.generate],  # each example runs processes for seconds: no shrinking
)
@given(events=st.lists(st.sampled_from(EVENTS), min_size=3, max_size=8 if THOROUGH else 4))
# Redis restarted empty: the primary founds the group again, alone in the in-sync set, and the standby
# must rejoin it before it may take over.
@example(events=["restart_redis", "kill_primary", "kill_primary", "kill_primary"])
def test_any_interleaving_of_failures_keeps_one_history_that_the_primary_replays(events: list[str]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        redis_server = Redis(Path(directory))
        redis_server.start()
        group = Group(Path(directory), redis_server.url)
        clients = None
        try:
            group.start()
            group.wait_in_sync(group.start(), group.primary())
            clients = KeyedClients(group, 2)
            for event in events:
                _apply(event, group, redis_server, clients)
            clients.stop()
            assert_history_replays(group, clients)
        finally:
            if clients is not None:
                clients.stop()
            failures = group.close()
            redis_server.stop()
        assert not failures, failures
