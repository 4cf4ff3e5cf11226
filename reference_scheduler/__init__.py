"""The reference scheduler: drives a kv-manager and a GPU worker through the wire contract."""

from reference_scheduler.scheduler import ReferenceScheduler, Sampling, SchedulerConfig, SchedulerError, StepTiming
from reference_scheduler.worker_client import Scheduled, WorkerClient

__all__ = ["ReferenceScheduler", "Sampling", "SchedulerConfig", "SchedulerError", "StepTiming", "Scheduled", "WorkerClient"]
