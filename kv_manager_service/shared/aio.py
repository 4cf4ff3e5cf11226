"""A grpc.aio server driven from synchronous code.

The manager serves on `grpc.aio` so that an open stream costs a coroutine
and its buffered messages, not a thread: WatchSteps and WatchEvents wait on
the event loop, as do the cheap reads (GetStats, health checks). Unary
handlers stay plain methods; the server runs them in its thread pool (its
`migration_thread_pool`), so a long mutation holds a pool thread, never the
loop.

- `EventLoopThread` runs the loop in a daemon thread, so `start_server` and
  `RunningServer.stop` keep their synchronous signatures.
- `AioInterceptor` puts an interceptor written for the synchronous API on an
  aio server: it is handed the next handler already resolved. The wrappers
  such interceptors build must keep their behavior's kind (see `is_async`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Awaitable, Callable, TypeVar

import grpc

Result = TypeVar("Result")


class EventLoopThread:
    """An asyncio event loop running forever in a daemon thread, until `close`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Awaitable[Result], timeout_s: float | None = None) -> Result:
        """Run `coroutine` on the loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        """Stop the loop, join its thread and close it; tasks still pending are dropped."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class AioInterceptor(grpc.aio.ServerInterceptor):
    """A synchronous `grpc.ServerInterceptor` on a `grpc.aio` server."""

    def __init__(self, interceptor: grpc.ServerInterceptor) -> None:
        self.interceptor = interceptor

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        return self.interceptor.intercept_service(lambda _details: handler, handler_call_details)


def is_async(behavior: Callable[..., Any]) -> bool:
    """Whether a handler's behavior runs on the event loop (a coroutine or an async generator).

    A wrapper must have its behavior's kind: grpc.aio runs a plain function
    in its thread pool and awaits a coroutine function on the loop.
    """
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
