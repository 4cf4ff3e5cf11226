"""A rejected call's status stays within what a client accepts in trailing metadata, whatever its message."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from kv_manager_service.shared.errors import RequestNotFoundError
from kv_manager_service.shared.status import MAX_STATUS_MESSAGE_BYTES, end_call, error_info, short_message

METHOD = "/kvcache.test.Probe/Fail"


@pytest.fixture
def failing_server():
    """A real gRPC server on a free port whose one method fails with a NOT_FOUND carrying a long message."""

    def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
        end_call(context, RequestNotFoundError(f"unknown request id {request.decode()!r}", "request_ids"))

    handler = grpc.method_handlers_generic_handler(
        "kvcache.test.Probe", {"Fail": grpc.unary_unary_rpc_method_handler(fail)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.mark.parametrize("text", ["x" * 16384, "é" * 16384, "😀" * 16384], ids=["ascii", "latin", "emoji"])
def test_a_long_message_reaches_the_client_cut_with_its_code_and_error_info(failing_server: str, text: str):
    with grpc.insecure_channel(failing_server) as channel:
        call = channel.unary_unary(METHOD)
        with pytest.raises(grpc.RpcError) as raised:
            call(text.encode(), timeout=10)
    error = raised.value
    assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
    assert len(error.details().encode()) <= MAX_STATUS_MESSAGE_BYTES
    assert error.details().startswith("unknown request id '") and "bytes in all, cut" in error.details()
    info = error_info(error)
    assert info.reason == "REQUEST_NOT_FOUND" and info.metadata["field"] == "request_ids"


def test_short_messages_are_left_alone():
    assert short_message("unknown request id 'r1'") == "unknown request id 'r1'"
