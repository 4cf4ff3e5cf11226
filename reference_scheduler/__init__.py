"""The reference scheduler: drives a kv-manager and a GPU worker through the wire contract."""

from reference_scheduler.interfaces import Manager, Worker
from reference_scheduler.scheduler import (
    ReferenceScheduler,
    RequestTooLargeError,
    Sampling,
    SchedulerConfig,
    SchedulerError,
    StepTiming,
)
from reference_scheduler.worker_client import Scheduled, WorkerClient

__all__ = [
    "Manager",
    "ReferenceScheduler",
    "RequestTooLargeError",
    "Sampling",
    "Scheduled",
    "SchedulerConfig",
    "SchedulerError",
    "StepTiming",
    "Worker",
    "WorkerClient",
]
