"""Caller mistakes, as typed exceptions: the error vocabulary of the contract.

The core raises them, the servicers (manager and worker) map each to one gRPC
code (`kv_manager_service.shared.status`), and the client raises them again from
a rejected call's status. Pure Python, importing nothing: the core may use it.

Internal invariants are `assert`s: a failed one is a bug, never the caller's fault.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class. `reason` is a stable machine-readable token, `field` the offending input.

    An error about one op of a step also says which: `op_index`, and
    `op_field`, the field within that op (`field` is then `ops[i].<op_field>`),
    so a server can name it in the terms of the call that carried the op.
    """

    reason = "KV_CACHE_ERROR"
    op_index: int | None = None
    op_field: str | None = None

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def locate(self, op_index: int) -> None:
        """Mark the error as one of op `op_index`; its field becomes `ops[op_index].<field>`."""
        self.op_index = op_index
        self.op_field = self.field
        self.field = f"ops[{op_index}].{self.field}" if self.field else f"ops[{op_index}]"


class InvalidArgumentError(KVCacheError):
    reason = "INVALID_ARGUMENT"


class RequestNotFoundError(KVCacheError):
    reason = "REQUEST_NOT_FOUND"


class RequestExistsError(KVCacheError):
    reason = "REQUEST_EXISTS"


class FailedPreconditionError(KVCacheError):
    reason = "FAILED_PRECONDITION"


class KVMissingError(FailedPreconditionError):
    """A worker does not hold KV that requests of an Execute would read, so it computed nothing.

    `request_ids` names them (the worker has told the manager, which counts
    them as lost): run the others again without them, and admit these again.
    """

    reason = "KV_MISSING"

    def __init__(self, message: str, request_ids: "list[str]", field: str | None = None) -> None:
        super().__init__(message, field)
        self.request_ids = request_ids


class ResourceExhaustedError(KVCacheError):
    reason = "RESOURCE_EXHAUSTED"


class OutOfRangeError(KVCacheError):
    reason = "OUT_OF_RANGE"


class IdempotencyKeyReusedError(FailedPreconditionError):
    """The key was already used by a different request (FAILED_PRECONDITION)."""

    reason = "IDEMPOTENCY_KEY_REUSED"


class UnauthenticatedError(KVCacheError):
    """The call carries no valid credentials. Raised by the service, never by the core."""

    reason = "UNAUTHENTICATED"


class PermissionDeniedError(KVCacheError):
    """The caller is known but its role may not make this call. Raised by the service, never by the core."""

    reason = "PERMISSION_DENIED"


class ShuttingDownError(KVCacheError):
    """The server is stopping and takes no more mutations (UNAVAILABLE: retry, here after the restart or elsewhere)."""

    reason = "SHUTTING_DOWN"


class NotPrimaryError(KVCacheError):
    """This manager is a standby of a high-availability group (or a primary that lost its lease): it
    changes nothing. UNAVAILABLE; `primary` is the primary's advertised address, None while none is known."""

    reason = "NOT_PRIMARY"

    def __init__(self, message: str, primary: str | None = None) -> None:
        super().__init__(message)
        self.primary = primary
