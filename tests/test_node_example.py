"""examples/node-scheduler against a real `kv-manager serve`: the wire contract from Node.js.

Skipped only when `node` is not installed. When node_modules is missing (a
fresh clone), the example's dependencies are installed with `npm ci` from
its package-lock.json first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from processes import launch

from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "node-scheduler"
REPLICA_ID = "node-example-test"
NUM_BLOCKS = 64

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")


@pytest.fixture(scope="module")
def node_example() -> Path:
    """The example folder, with its node_modules installed (npm ci on a fresh clone)."""
    needed = [EXAMPLE / "node_modules" / "@grpc" / name / "package.json" for name in ("grpc-js", "proto-loader")]
    if not all(path.is_file() for path in needed):
        npm = shutil.which("npm")
        assert npm is not None, "node is installed but npm is not: cannot install examples/node-scheduler's modules"
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=EXAMPLE, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"npm ci failed in {EXAMPLE}:\n{done.stdout}\n{done.stderr}"
    return EXAMPLE / "scheduler.js"


@pytest.fixture
def manager(tmp_path):
    """A real `kv-manager serve --port 0` subprocess; yields its HOST:PORT, always stopped."""
    argv = [sys.executable, "-m", "kv_manager_service.cli", "serve",
            "--port", "0", "--num-blocks", str(NUM_BLOCKS), "--replica-id", REPLICA_ID]  # fmt: skip
    process = launch(argv, MANAGER_READY_PREFIX, tmp_path / "server.log")
    try:
        yield process.address
    finally:
        process.stop()


def tables_from_step_log(stub, last_step_id: int) -> tuple[dict[str, dict[int, list[int]]], list[str]]:
    """Rebuild every request's block tables from WatchSteps, as a GPU worker would.

    Returns the tables each request had when it was freed, and the ids the
    last step freed.
    """
    live: dict[str, dict[int, list[int]]] = {}
    at_free: dict[str, dict[int, list[int]]] = {}
    freed_last: list[str] = []
    stream = stub.WatchSteps(pb.WatchStepsRequest(worker_id="pytest-node-example", from_step_id=1), timeout=30)
    try:
        expected = 1
        for delta in stream:
            assert delta.step_id == expected, "step deltas are contiguous from 1"
            expected += 1
            for row in delta.rows_added:
                live[row.request_id] = {g.group_id: list(g.block_ids) for g in row.groups}
            for update in delta.blocks_appended:
                table = live[update.request_id].setdefault(update.group_id, [])
                assert update.new_block_index <= len(table)
                table[update.new_block_index :] = update.block_ids
            for request_id in delta.requests_freed:
                at_free[request_id] = live.pop(request_id)
            if delta.step_id == last_step_id:
                freed_last = list(delta.requests_freed)
                break
    finally:
        stream.cancel()
    assert not live, f"requests never freed: {sorted(live)}"
    return at_free, freed_last


def test_node_scheduler_drives_the_manager(node_example, manager):
    node = shutil.which("node")
    done = subprocess.run([node, str(node_example), manager], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"scheduler failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    assert summary["ok"] is True
    assert summary["address"] == manager
    assert summary["steps"] == 20
    assert summary["block_size"] == 16
    assert summary["not_found"]["code"] == grpc.StatusCode.NOT_FOUND.value[0] == 5
    assert summary["not_found"]["reason"] == "REQUEST_NOT_FOUND"
    assert summary["stats_after_free"] == {"num_requests": 0, "num_free_blocks": NUM_BLOCKS - 1}

    # Request A: 40 prompt + 20 decoded tokens; B: admitted one step later with
    # the same prompt (a 2-block prefix hit) and 19 decoded tokens.
    (a, row_a), (b, row_b) = sorted(summary["requests"].items())
    assert a.startswith("node-a-") and b.startswith("node-b-")
    assert row_a["num_computed_tokens"] == 60 and row_b["num_computed_tokens"] == 59
    blocks_a, blocks_b = row_a["block_ids"]["0"], row_b["block_ids"]["0"]
    assert summary["block_ids"] == blocks_a
    assert len(blocks_a) == len(blocks_b) == 4  # ceil(60 / 16), ceil(59 / 16)
    assert summary["prefix_hit_blocks"] == 2 and blocks_b[:2] == blocks_a[:2]
    assert len(set(blocks_a) | set(blocks_b)) == 6 == summary["num_freed_blocks"]
    assert 0 not in blocks_a + blocks_b

    # The manager's own account, through the Python stubs.
    with grpc.insecure_channel(manager) as channel:
        stub = pb_grpc.KVManagerServiceStub(channel)
        config = stub.GetConfig(pb.GetConfigRequest(), timeout=10)
        assert summary["replica_id"] == config.replica_id == REPLICA_ID
        assert summary["incarnation"] == str(config.incarnation)  # uint64 as a string, not rounded

        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.num_requests == 0 and stats.num_free_blocks == NUM_BLOCKS - 1
        # Allocate, 20 Steps, Free: the scheduler's steps are the only ones.
        assert stats.last_step_id == int(summary["last_step_id"]) == 22
        assert stats.prefix_cache_hits == 32  # B's two blocks

        # The tables the scheduler tracked equal the ones a worker rebuilds from the step log.
        at_free, freed_last = tables_from_step_log(stub, stats.last_step_id)
        assert sorted(freed_last) == [a, b]
        assert {rid: {str(g): ids for g, ids in groups.items()} for rid, groups in at_free.items()} == {
            rid: row["block_ids"] for rid, row in summary["requests"].items()
        }
