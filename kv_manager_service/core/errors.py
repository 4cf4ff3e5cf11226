"""Caller mistakes, as typed exceptions. The service maps each to one gRPC code.

Internal invariants are `assert`s: a failed one is a bug, never the caller's fault.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class. `reason` is a stable machine-readable token, `field` the offending input."""

    reason = "KV_CACHE_ERROR"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidArgumentError(KVCacheError):
    reason = "INVALID_ARGUMENT"


class RequestNotFoundError(KVCacheError):
    reason = "REQUEST_NOT_FOUND"


class RequestExistsError(KVCacheError):
    reason = "REQUEST_EXISTS"


class FailedPreconditionError(KVCacheError):
    reason = "FAILED_PRECONDITION"


class ResourceExhaustedError(KVCacheError):
    reason = "RESOURCE_EXHAUSTED"


class OutOfRangeError(KVCacheError):
    reason = "OUT_OF_RANGE"
