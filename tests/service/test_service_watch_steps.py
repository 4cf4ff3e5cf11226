"""WatchSteps over real gRPC: what each step changed, resumable from any retained step id.

A worker that applies the deltas from step 1 (rows added, blocks appended from
new_block_index, requests freed) must hold exactly the tables GetBlockTables
reports, after every step.
"""

from __future__ import annotations

import pytest

from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import (
    NO_SPACE,
    OK,
    Worker,
    alloc,
    connect,
    follow_steps,
    last_step_id,
    op_alloc,
    op_free,
    pool_config,
    read_steps,
    stats,
    step_request,
    tables,
    take,
    watch_steps,
    workers,
)

from kv_manager_service.shared.ready_line import FIRST_STEP_ID_HEADER

WORKER = "gpu-0"
BS = 16


@pytest.fixture(scope="module")
def steps_server(module_server_factory):
    return module_server_factory.start("--replica-id", "steps", "--worker-timeout-s", "3600", config=pool_config(16, BS))


@pytest.fixture(scope="module")
def stub(steps_server):
    channel, stub = connect(steps_server.address)
    yield stub
    channel.close()


def block_ids(stub) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {rid: blocks for rid, (_, blocks) in tables(stub).items()}


@pytest.fixture(scope="module")
def run(stub):
    """Drive a history while a worker follows it live; returns (deltas, responses, tables after each step)."""
    follower = follow_steps(stub, WORKER, 1)  # opened before step 1 exists
    responses: dict[str, object] = {}
    after_step: list[dict] = []

    def record(name: str, response) -> None:
        responses[name] = response
        after_step.append(block_ids(stub))

    record("p", stub.Allocate(alloc("p", range(20))))  # 1: rows_added
    record("q", stub.Allocate(alloc("q", range(100, 116))))  # 2: rows_added, q fills its block
    record("decode-q", stub.Step(step_request(decode=[("q", 1)])))  # 3: q's 17th token: a block appended
    record("fork", stub.Fork(pb.ForkRequest(parent_request_id="p", child_request_ids=["c1", "c2"])))  # 4
    record("cow-c1", stub.Step(step_request(decode=[("c1", 5)])))  # 5: copy-on-write of p's block 1
    record(  # 6: nested ops and the decode batch together
        "mixed",
        stub.Step(step_request([op_alloc("r", range(200, 210)), op_free("q")], decode=[("c2", 6), ("p", 7)])),
    )
    record("no-space", stub.Step(step_request([op_alloc("big", range(300, 300 + 16 * BS))])))  # 7: NO_SPACE only
    record("free-c1", stub.Free(pb.FreeRequest(request_ids=["c1"])))  # 8
    record("chunk-1", stub.Allocate(alloc("s", range(400, 440), 16)))  # 9: chunked prefill
    record("chunk-2", stub.Allocate(alloc("s", [], 24)))  # 10
    record("lookahead", stub.Allocate(alloc("r", [9], 1, num_lookahead_tokens=20)))  # 11
    n = last_step_id(stub)
    assert n == 11
    try:
        deltas = take(follower, n)
    finally:
        follower.cancel()
    return deltas, responses, after_step


def test_step_ids_are_contiguous_from_one(run):
    deltas, _, _ = run
    assert [d.step_id for d in deltas] == list(range(1, 12))


def test_a_worker_applying_deltas_matches_get_block_tables_after_every_step(run, stub):
    deltas, _, after_step = run
    worker = Worker()
    for delta, expected in zip(deltas, after_step):
        worker.apply(delta)
        assert worker.block_ids() == expected, f"after step {delta.step_id}"
    # And from a fresh read of the whole log, the end state again.
    replayed = Worker()
    for delta in read_steps(stub, WORKER, 1, len(deltas)):
        replayed.apply(delta)
    assert replayed.block_ids() == block_ids(stub)


def rows(delta: pb.StepDelta) -> list[tuple[str, int, list[list[int]]]]:
    return [(r.request_id, r.num_computed_tokens, [list(g.block_ids) for g in r.groups]) for r in delta.rows_added]


def appended(delta: pb.StepDelta) -> list[tuple[str, int, int, list[int]]]:
    return [(u.request_id, u.group_id, u.new_block_index, list(u.block_ids)) for u in delta.blocks_appended]


def copies(delta: pb.StepDelta) -> list[tuple[int, int]]:
    return [(c.src_block_id, c.dst_block_id) for c in delta.copies]


def test_rows_added_on_first_allocate_and_for_fork_children(run):
    deltas, responses, _ = run
    p_blocks = list(responses["p"].groups[0].new_block_ids)
    assert rows(deltas[0]) == [("p", 20, [p_blocks])]
    assert (appended(deltas[0]), list(deltas[0].requests_freed), copies(deltas[0])) == ([], [], [])
    assert rows(deltas[1]) == [("q", 16, [list(responses["q"].groups[0].new_block_ids)])]
    # Fork children arrive as whole tables, with the parent's progress.
    assert rows(deltas[3]) == [("c1", 20, [p_blocks]), ("c2", 20, [p_blocks])]
    assert appended(deltas[3]) == [] and copies(deltas[3]) == []


def test_blocks_appended_on_continuations(run):
    deltas, responses, _ = run
    (change,) = responses["decode-q"].decode.changes
    assert appended(deltas[2]) == [("q", 0, 1, list(change.new_block_ids))]
    assert rows(deltas[2]) == []
    # Chunked prefill: the first chunk adds the row, the next appends at index 1.
    first, second = responses["chunk-1"], responses["chunk-2"]
    assert rows(deltas[8]) == [("s", 16, [list(first.groups[0].new_block_ids)])]
    assert appended(deltas[9]) == [("s", 0, 1, list(second.groups[0].new_block_ids))]
    assert len(second.groups[0].new_block_ids) == 2
    # Lookahead slots are blocks too.
    lookahead = responses["lookahead"]
    assert appended(deltas[10]) == [("r", 0, 1, list(lookahead.groups[0].new_block_ids))]


def test_copy_on_write_delta_carries_the_copy_and_the_replaced_slot(run):
    deltas, responses, _ = run
    p_blocks = list(responses["p"].groups[0].new_block_ids)
    (copy,) = responses["cow-c1"].decode.copies
    assert copies(deltas[4]) == [(p_blocks[1], copy.dst_block_id)]
    assert appended(deltas[4]) == [("c1", 0, 1, [copy.dst_block_id])]  # the replaced slot, not the end
    mixed = responses["mixed"]
    (c2_copy,) = mixed.decode.copies  # c2 still shares the block with p; p no longer shares it
    assert copies(deltas[5]) == [(p_blocks[1], c2_copy.dst_block_id)]
    assert ("c2", 0, 1, [c2_copy.dst_block_id]) in appended(deltas[5])
    assert not [u for u in appended(deltas[5]) if u[0] == "p"]


def test_mixed_step_delta(run):
    deltas, responses, _ = run
    mixed = responses["mixed"]
    assert mixed.step_id == deltas[5].step_id == 6
    assert rows(deltas[5]) == [("r", 10, [list(mixed.results[0].allocate.groups[0].new_block_ids)])]
    assert list(deltas[5].requests_freed) == ["q"]
    assert list(deltas[7].requests_freed) == ["c1"]


def test_a_step_with_only_no_space_still_has_a_delta(run):
    deltas, responses, _ = run
    no_space = responses["no-space"]
    assert no_space.results[0].allocate.status == NO_SPACE and no_space.step_id == 7
    empty = deltas[6]
    assert empty.step_id == 7
    assert (rows(empty), appended(empty), list(empty.requests_freed), copies(empty)) == ([], [], [], [])


@pytest.mark.parametrize("k", [1, 3, 5, 6, 11])
def test_resuming_from_a_step_id_yields_exactly_the_rest_then_follows(run, stub, k):
    deltas, _, _ = run
    last = last_step_id(stub)  # earlier tests may have made more steps
    stream = watch_steps(stub, WORKER, k)  # the same worker reconnecting
    try:
        resumed = take(stream, last - k + 1)
        assert resumed[: len(deltas) - k + 1] == deltas[k - 1 :]
        assert [d.step_id for d in resumed] == list(range(k, last + 1))
        response = stub.Allocate(alloc(f"resume-{k}", [k]))
        assert response.status == OK
        (following,) = take(stream, 1)
    finally:
        stream.cancel()
    assert following.step_id == response.step_id == last + 1
    assert rows(following) == [(f"resume-{k}", 1, [list(response.groups[0].new_block_ids)])]
    stub.Free(pb.FreeRequest(request_ids=[f"resume-{k}"]))


def test_resuming_at_the_next_step_waits_for_it(stub, run):
    last = last_step_id(stub)
    stream = watch_steps(stub, WORKER, last + 1)
    try:
        freed = stub.Free(pb.FreeRequest(request_ids=["s"]))
        (delta,) = take(stream, 1)
    finally:
        stream.cancel()
    assert delta.step_id == freed.step_id == last + 1 and list(delta.requests_freed) == ["s"]


def test_registration_is_said_before_any_step(stub, run):
    """The stream's headers come as soon as the worker is registered, with no step to send yet."""
    last = last_step_id(stub)
    stream = watch_steps(stub, "registers-" + WORKER, last + 1)
    try:
        assert (FIRST_STEP_ID_HEADER, str(last + 1)) in stream.initial_metadata()
        assert "registers-" + WORKER in workers(stub)
        assert last_step_id(stub) == last  # no step was needed, nor sent
    finally:
        stream.cancel()
    stub.UnregisterWorker(pb.UnregisterWorkerRequest(worker_id="registers-" + WORKER))


def test_copies_are_released_when_every_registered_worker_acknowledged(stub, run):
    assert stats(stub).num_pending_copies == 2  # c1's and c2's copies from the run
    last = last_step_id(stub)
    second = read_steps(stub, "gpu-1", last, 1)  # registers a second worker at last - 1
    assert second[0].step_id == last
    stub.AckSteps(pb.AckStepsRequest(worker_id=WORKER, step_id=last))
    assert stats(stub).num_pending_copies == 0  # gpu-1 had already done every step with a copy
    # A new copy now waits for both workers.
    stub.Allocate(alloc("cw", range(500, 520)))
    stub.Fork(pb.ForkRequest(parent_request_id="cw", child_request_ids=["cw-child"]))
    cow = stub.Allocate(alloc("cw-child", [1]))
    assert len(cow.copies) == 1
    stub.AckSteps(pb.AckStepsRequest(worker_id=WORKER, step_id=cow.step_id))
    assert stats(stub).num_pending_copies == 1
    stub.AckSteps(pb.AckStepsRequest(worker_id="gpu-1", step_id=cow.step_id))
    assert stats(stub).num_pending_copies == 0


def test_deltas_agree_with_every_live_slot_of_a_hybrid_model(server_factory):
    """Sliding-window and mamba groups put the null block (0) in slots they will never read again.

    A worker following the deltas must agree with GetBlockTables on every slot that still holds a block.
    """
    groups = [
        {"kind": "full_attention", "block_size": 16},
        {"kind": "sliding_window", "block_size": 16, "sliding_window": 32},
        {"kind": "mamba", "block_size": 16},
    ]
    server = server_factory.start("--replica-id", "hybrid-steps", config={"num_blocks": 64, "groups": groups})
    channel, stub = connect(server.address)
    with channel:
        stub.Allocate(alloc("a", range(40)))
        stub.Allocate(alloc("b", range(1000, 1020)))
        stub.Fork(pb.ForkRequest(parent_request_id="b", child_request_ids=["b2"]))
        for i in range(40):
            stub.Step(step_request(decode=[("a", i), ("b", i), ("b2", i + 1)]))
        stub.Free(pb.FreeRequest(request_ids=["b"]))
        n = last_step_id(stub)
        worker = Worker()
        deltas = read_steps(stub, "hybrid-worker", 1, n)
        assert [d.step_id for d in deltas] == list(range(1, n + 1))
        for delta in deltas:
            worker.apply(delta)
        truth = block_ids(stub)
        followed = worker.block_ids()
        assert set(followed) == set(truth) == {"a", "b2"}
        for request_id, groups_ in truth.items():
            assert truth[request_id][0] == followed[request_id][0]  # full attention: all of it
            for group_id, (true_table, followed_table) in enumerate(zip(groups_, followed[request_id])):
                assert len(true_table) == len(followed_table), (request_id, group_id)
                live = [(i, b) for i, b in enumerate(true_table) if b != 0]
                assert live == [(i, followed_table[i]) for i, _ in live], (request_id, group_id)
            assert 0 in truth[request_id][1]  # the window really recycled blocks
