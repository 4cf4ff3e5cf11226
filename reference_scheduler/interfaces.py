"""What the reference scheduler's loop drives: a manager that applies Steps and a worker that executes them.

`KVManagerClient` and `WorkerClient` are the gRPC implementations (the demo,
the end-to-end tests). `kv-manager replay` drives an in-process core and a
worker that "samples" synthetic tokens; the soak load (`soak.py`) drives a
client that sends decodes as columns and a worker that only acknowledges.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

from kv_manager_service.client import ForkResult, Op, StepResult


class Scheduled(NamedTuple):
    """Tokens of one request to compute in a step, from `start_position` on."""

    request_id: str
    token_ids: Sequence[int]
    start_position: int
    temperature: float = 0.0
    seed: int = 0


class NextToken(NamedTuple):
    request_id: str
    token_id: int
    logprob: float


class ExecuteResult(NamedTuple):
    step_id: int
    outputs: tuple[NextToken, ...]  # one per scheduled request, in order
    forward_ms: float


class Manager(Protocol):
    """A kv-manager as the loop uses it; `KVManagerClient` is one."""

    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        """Apply `ops` in order as one step: one result per op. With `auto_key`, a step whose
        answer was lost in transit is sent again under the same key and applied once."""
        ...

    def fork(self, parent_request_id: str, child_request_ids: Sequence[str]) -> ForkResult:
        """Children that share every block of the parent, as one step."""
        ...


class Worker(Protocol):
    """A model worker as the loop uses it; `WorkerClient` is one."""

    def execute(self, step_id: int, requests: Sequence[Scheduled]) -> ExecuteResult:
        """Compute `requests` in step `step_id` (after its block copies) and sample one token for each, in order.

        Raises `KVMissingError` if it does not hold the KV some of them
        would read: it computed nothing, and accepts the same step again without
        the requests the error names.
        """
        ...
