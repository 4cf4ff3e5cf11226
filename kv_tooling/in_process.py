"""A `KVCacheManager` in this process, behind the Step interface the reference scheduler drives."""

from __future__ import annotations

from typing import Sequence

from kv_manager_service.core import ForkResult, KVCacheManager, StepResult
from kv_manager_service.shared.ops import Op


class InProcessManager:
    """Applies the scheduler's steps to `manager` directly.

    No worker holds block copies here, so each step is acknowledged as soon
    as it is applied (its copies are released at once). Nothing travels, so
    nothing is lost or retried: `auto_key` is accepted and has no effect.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager

    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        result = self.manager.step(ops)
        self.manager.ack(result.step_id)
        return result

    def fork(self, parent_request_id: str, child_request_ids: Sequence[str]) -> ForkResult:
        result = self.manager.fork(parent_request_id, child_request_ids)
        self.manager.ack(result.step_id)
        return result
