"""Requests that do not parse end with INVALID_ARGUMENT, not gRPC's INTERNAL.

grpc-python answers a request whose bytes its deserializer rejects with
INTERNAL ("Exception deserializing request!") and logs a traceback; but
INTERNAL is this service's word for a bug, and unparseable bytes are the
caller's mistake. `ParseErrorInterceptor` gives every unary-request method
a deserializer that never raises (bytes that do not parse become an
`Unparsed` value) and a behavior that answers an `Unparsed` request with
INVALID_ARGUMENT and the usual ErrorInfo (reason `INVALID_ARGUMENT`, field
`request`). Well-formed requests are then checked against the limits of
`shared.bounds`, so a string or list past its limit is refused the same way,
naming the field, before any handler sees it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, AsyncIterator, Callable, NamedTuple

import grpc

from kv_manager_service.shared import bounds
from kv_manager_service.shared.errors import InvalidArgumentError, KVCacheError
from kv_manager_service.shared.status import end_call

log = logging.getLogger("kv_manager_service.server.servicer")


# A coroutine handler's request larger than this is checked in a thread, off the event loop.
CHECK_ON_LOOP_MAX_BYTES = 64 << 10


class Unparsed(NamedTuple):
    """A request whose bytes did not parse, and why."""

    num_bytes: int
    error: str


class ParseErrorInterceptor(grpc.ServerInterceptor):
    """Wraps the handler of every unary-request method of every service (the wrap is built once per method).

    Put it last in the server's interceptor list, so that interceptors
    before it (metrics) see, and count, the INVALID_ARGUMENT it answers.
    """

    def __init__(self) -> None:
        # full method name -> (the handler it wraps, the wrapped handler)
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        name = method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            wrapped = handler._replace(
                request_deserializer=_lenient(handler.request_deserializer),
                unary_unary=_refusing_unparsed(handler.unary_unary, name),
            )
        else:
            wrapped = handler._replace(
                request_deserializer=_lenient(handler.request_deserializer),
                unary_stream=_refusing_unparsed(handler.unary_stream, name),
            )
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def lenient(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # DecodeError, or anything a parser may raise on hostile bytes
            return Unparsed(len(data), f"{type(error).__name__}: {error}")

    return lenient


def _refusing_unparsed(behavior: Callable, name: str) -> Callable:
    """`behavior`, after a check that refuses an unparsed request; of `behavior`'s kind (see shared/aio.py).

    Also right for server streams: the status is set before any response.
    """
    if inspect.isasyncgenfunction(behavior):

        async def refusing_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            error = _refusal(request, name)
            if error is not None:
                end_call(context, error)
                return
            async for response in behavior(request, context):
                yield response

        return refusing_stream
    if inspect.iscoroutinefunction(behavior):

        async def refusing_async(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if type(request) is not Unparsed and request.ByteSize() > CHECK_ON_LOOP_MAX_BYTES:
                # Walking a large request takes long (0.5 s for 65,536 ops): not on the event loop.
                error = await asyncio.to_thread(_refusal, request, name)
            else:
                error = _refusal(request, name)
            if error is not None:
                end_call(context, error)
                return None
            return await behavior(request, context)

        return refusing_async

    def refusing(request: Any, context: grpc.ServicerContext) -> Any:
        error = _refusal(request, name)
        if error is not None:
            end_call(context, error)
            return None
        return behavior(request, context)

    return refusing


def _refusal(request: Any, name: str) -> KVCacheError | None:
    """The error that refuses `request` before its handler runs (logged here), or None to let it through:
    bytes that did not parse, or a field past its limit (`bounds`)."""
    if type(request) is not Unparsed:
        error = bounds.violation(request)
        if error is None:
            return None
    else:
        error = InvalidArgumentError(
            f"the {request.num_bytes}-byte request is not a valid {name} request message ({request.error})",
            "request",
        )
    log.info(
        "%s rejected: %s", name, error,
        extra={"method": name, "code": "INVALID_ARGUMENT", "reason": error.reason, "field": error.field},
    )  # fmt: skip
    return error
