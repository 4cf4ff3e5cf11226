"""A Redis that does not answer: one clear line at start, then at most one warning a minute while it stays
down, one line when it answers again; and `--redis-required` refuses the start instead."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mirror_support import RedisServer, wait_until
from processes import log_records


def _warnings(replica) -> list[str]:
    return [r["msg"] for r in log_records(replica.process) if r["level"] == "WARNING"]


def test_a_redis_that_does_not_answer_is_said_once_then_once_it_answers(replicas, redis_factory, tmp_path: Path):
    redis_server = RedisServer(tmp_path)  # a free port, nothing listening yet
    redis_factory.append(redis_server)
    replica = replicas.start("quiet", redis_server.url)  # the lease's heartbeat tries every second
    time.sleep(4)
    warnings = _warnings(replica)
    assert len(warnings) == 1, warnings
    assert "the mirror's Redis" in warnings[0] and "is unreachable" in warnings[0]
    assert "answers from its own pool" in warnings[0]
    assert replica.client.stats().num_blocks  # it serves meanwhile
    redis_server.start()
    wait_until(replica.log, lambda text: "answers again" in text, 20, "the mirror to say Redis answers again")
    assert len(_warnings(replica)) == 1


def test_redis_required_refuses_to_start_in_one_line(tmp_path: Path):
    port = RedisServer(tmp_path).port
    argv = [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0",
            "--redis-url", f"redis://127.0.0.1:{port}/0", "--redis-required"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("kv-manager: error:")]
    assert len(errors) == 1 and "--redis-required" in errors[0] and f"{port}" in errors[0], done.stderr
