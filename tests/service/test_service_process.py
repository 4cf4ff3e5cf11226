"""`kv-manager serve` as a process: its flags, identity across restarts, and graceful shutdown."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from kvcache.v1 import kv_manager_pb2 as pb

from processes import check_clean_exit
from svc_support import OK, ROOT, alloc, connect, follow_steps, pool_config, stats, wait_for, watch_events, write_config


def get_config(address: str) -> pb.GetConfigResponse:
    channel, stub = connect(address)
    with channel:
        return stub.GetConfig(pb.GetConfigRequest())


def serve_and_fail(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )


def test_block_size_flag_defines_one_full_attention_group(server_factory):
    server = server_factory.start("--num-blocks", "11", "--block-size", "32")
    config = get_config(server.address)
    assert config.num_blocks == 11
    assert [(g.kind, g.block_size) for g in config.groups] == [(pb.GROUP_KIND_FULL_ATTENTION, 32)]
    assert config.hash_block_size == 32


def test_pool_flags(server_factory):
    server = server_factory.start(
        "--num-blocks", "20", "--no-prefix-caching", "--hash-algorithm", "xxh3_128", "--hash-seed", "s3cret",
        "--replica-id", "flags", config=pool_config(99, 8),
    )
    config = get_config(server.address)
    assert config.num_blocks == 20  # the flag overrides the file
    assert [g.block_size for g in config.groups] == [8]
    assert (config.hash_algorithm, config.enable_prefix_caching, config.replica_id) == ("xxh3_128", False, "flags")
    channel, stub = connect(server.address)
    with channel:
        tokens = list(range(33))
        assert stub.Allocate(alloc("a", tokens)).status == OK
        stub.Free(pb.FreeRequest(request_ids=["a"]))
        again = stub.Allocate(alloc("b", tokens))
        assert again.num_computed_tokens == 0 and list(again.groups[0].hit_block_ids) == []
        assert stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=tokens)).num_cached_tokens == 0
        assert stats(stub).last_event_sequence == 0  # nothing is ever cached


@pytest.mark.parametrize(
    "args, message",
    [
        (("--hash-algorithm", "xxh3_128"), "hash_seed"),
        (("--num-blocks", "1"), "num_blocks"),
        # 10^9 host blocks cannot fit: refused with the estimate (expected-blocks room included) before allocating.
        (("--num-host-blocks", "1000000000"), "the manager would need up to 417.68 GiB"),
    ],
)
def test_bad_pool_flags_exit_2_with_a_message(args, message):
    done = serve_and_fail(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "KV manager listening" not in done.stdout


def test_the_start_line_says_the_memory_estimate_and_the_check_can_be_skipped(server_factory):
    server = server_factory.start("--num-blocks", "1000", "--num-host-blocks", "1000")
    wait_for(lambda: "memory up to 0." in server.log_path.read_text(), "the start line")
    assert "MiB of blocks" in server.log_path.read_text()
    done = serve_and_fail("--num-host-blocks", "1000000000", "--no-memory-check", "--port", "99999")
    assert done.returncode == 2 and "would need" not in done.stderr and "port" in done.stderr, done.stderr


def test_the_start_says_which_hashing_implementation_runs(server_factory):
    """A build without the C chain (no OpenSSL headers at install) is 3.6x slower per block: the log says so."""
    from kv_manager_service.core import hashing

    server = server_factory.start()
    wait_for(lambda: "sha256_cbor block hashes by" in server.log_path.read_text(), "the hashing line")
    assert hashing.implementation() in server.log_path.read_text()


def test_block_size_with_groups_in_the_file_is_an_error(tmp_path):
    path = write_config(tmp_path, pool_config(11, 16))
    done = serve_and_fail("--config", str(path), "--block-size", "32")
    assert done.returncode == 2 and "--block-size" in done.stderr, done.stderr


def test_each_start_is_a_new_incarnation(server_factory):
    first = server_factory.start("--replica-id", "same", config=pool_config(8))
    first_config = get_config(first.address)
    check_clean_exit(first)
    second = server_factory.start("--replica-id", "same", config=pool_config(8))
    second_config = get_config(second.address)
    assert first_config.replica_id == second_config.replica_id == "same"
    assert 0 != first_config.incarnation != second_config.incarnation != 0


def test_sigterm_with_open_streams_shuts_down_gracefully(server_factory):
    server = server_factory.start("--replica-id", "bye", config=pool_config(16))
    channel, stub = connect(server.address)
    with channel:
        steps = follow_steps(stub, "gpu", 1)
        events = watch_events(stub, 0)
        response = stub.Allocate(alloc("a", range(20)))
        assert response.status == OK
        assert next(steps).step_id == 1 and next(events).sequence == 1
        check_clean_exit(server)  # SIGTERM: exits 0 in time although two streams are open
        for stream in (steps, events):
            try:
                leftover = list(stream)
            except grpc.RpcError as error:
                # The stream ended because the server went away, not because our deadline passed.
                assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), error
            else:
                assert leftover == []
