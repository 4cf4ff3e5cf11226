"""Caller mistakes as gRPC statuses: one table, one machine-readable reason each.

A rejected call ends with the mapped status code and a `google.rpc.ErrorInfo`
in the status details (`reason`, domain `kvcache.v1`, metadata `field`). The
same reason and field are also sent as trailing metadata (`kvcache-reason`,
`kvcache-field`) for clients without the rich-status helpers. A standby's
NOT_PRIMARY also names the primary, when it knows one: ErrorInfo metadata
`primary` and trailing metadata `kvcache-primary`, both its HOST:PORT.

The message travels twice in the trailing metadata (the status details and
`grpc-message`), whose size gRPC clients cap (8 KiB by default): past it the
caller would read RESOURCE_EXHAUSTED instead of the real status. So a
message is cut to MAX_STATUS_MESSAGE_BYTES of UTF-8, keeping its head and
tail: even percent-encoded it leaves room for the rest.
"""

from __future__ import annotations

import json

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kv_manager_service.shared.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    KVMissingError,
    NotPrimaryError,
    OutOfRangeError,
    PermissionDeniedError,
    RequestExistsError,
    RequestNotFoundError,
    ResourceExhaustedError,
    ShuttingDownError,
    UnauthenticatedError,
)

ERROR_DOMAIN = "kvcache.v1"
MAX_STATUS_MESSAGE_BYTES = 1024
PRIMARY_HEADER = "kvcache-primary"  # NOT_PRIMARY's trailing metadata: the primary's address, when known



STATUS_CODES: dict[type[KVCacheError], grpc.StatusCode] = {
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    RequestNotFoundError: grpc.StatusCode.NOT_FOUND,
    RequestExistsError: grpc.StatusCode.ALREADY_EXISTS,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    OutOfRangeError: grpc.StatusCode.OUT_OF_RANGE,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    ShuttingDownError: grpc.StatusCode.UNAVAILABLE,
    NotPrimaryError: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: KVCacheError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return grpc.StatusCode.INVALID_ARGUMENT


def end_call(context: grpc.ServicerContext, error: KVCacheError) -> None:
    """End the call with the status mapped from `error`.

    On a threaded server this raises, as grpc's abort does. On a grpc.aio
    server (a plain handler's context or a coroutine's) it sets the status
    and returns, and the handler must then return None: an abort there
    raises an exception whose traceback keeps the request alive until the
    cycle collector runs, so refused megabyte requests would pile up.
    """
    status = _status(error)
    if isinstance(context, grpc.ServicerContext):
        context.abort_with_status(status)
    context.set_trailing_metadata(status.trailing_metadata)
    context.set_code(status.code)
    context.set_details(status.details)


def _status(error: KVCacheError) -> grpc.Status:
    code = status_code(error)
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN)
    if error.field:
        info.metadata["field"] = error.field
    if isinstance(error, KVMissingError):
        info.metadata["request_ids"] = request_ids_metadata(error.request_ids)
    primary = error.primary if isinstance(error, NotPrimaryError) else None
    if primary:
        info.metadata["primary"] = primary
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=short_message(str(error)), details=[detail])
    rich = rpc_status.to_status(status)
    metadata = tuple(rich.trailing_metadata) + (("kvcache-reason", error.reason), ("kvcache-field", error.field or ""))
    if primary:
        metadata += ((PRIMARY_HEADER, primary),)
    return _Status(rich.code, rich.details, metadata)


def request_ids_metadata(request_ids: list[str]) -> str:
    """`request_ids` as a JSON array for an ErrorInfo's metadata, the first ones only past
    MAX_STATUS_MESSAGE_BYTES (a caller that runs the rest again hears of the others then)."""
    kept: list[str] = []
    size = 2
    for request_id in request_ids:
        size += len(json.dumps(request_id)) + 1
        if size > MAX_STATUS_MESSAGE_BYTES and kept:
            break
        kept.append(request_id)
    return json.dumps(kept)


def short_message(message: str) -> str:
    """`message`, or its head and tail around a note of what was cut: at most MAX_STATUS_MESSAGE_BYTES of UTF-8."""
    encoded = message.encode()
    if len(encoded) <= MAX_STATUS_MESSAGE_BYTES:
        return message
    note = f"...[{len(encoded)} bytes in all, cut]..."
    keep = (MAX_STATUS_MESSAGE_BYTES - len(note)) // 2
    # errors="ignore" drops a character cut in two at either edge.
    head = encoded[:keep].decode(errors="ignore")
    tail = encoded[len(encoded) - keep :].decode(errors="ignore")
    return f"{head}{note}{tail}"


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo of a failed call, on the client side; None if there is none."""
    status = rpc_status.from_call(error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None
