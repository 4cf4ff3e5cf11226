"""The transport between a group's members: frames over one TCP connection, on the event loop.

A frame is a message's length as 4 bytes, little-endian, then the message
(replication.proto). Both ends are asyncio protocols, so a frame is read in
the loop's callback for its socket and written straight to the socket: no
thread hand-off and no per-message task on either side. A standby's record
thus reaches its acknowledgement, and the acknowledgement the primary's
waiting call, in a loopback round trip and a few callbacks.

TLS, when the members serve TLS: the primary's replication listener presents
the server's certificate (`--tls-cert`, `--tls-key`) and, with `--tls-ca`,
requires a client certificate signed by it; a standby checks the primary's
certificate against `--ha-tls-ca` and presents `--ha-tls-cert` when given.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from typing import Callable

from kv_manager_service.shared.security import ClientTLS, ServerTLS

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = (1 << 32) - 1  # what the length's 4 bytes can say: a larger snapshot is refused


class FrameTooLargeError(Exception):
    pass


def frame(message: bytes) -> bytes:
    if len(message) > MAX_FRAME_BYTES:
        raise FrameTooLargeError(f"a replication message of {len(message)} bytes is over the limit of {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(message)) + message


class FrameProtocol(asyncio.Protocol):
    """A connection that hands each whole frame to `on_frame`, and can be told to wait while the
    socket's send buffer is full (`drained`)."""

    max_frame_bytes = MAX_FRAME_BYTES  # a frame said to be longer ends the connection

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._writable = asyncio.Event()
        self._writable.set()
        self.closed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= 4:
            (size,) = _LENGTH.unpack_from(buffer, start)
            if size > self.max_frame_bytes:
                self.close()
                return
            end = start + 4 + size
            if len(buffer) < end:
                break
            message = bytes(buffer[start + 4 : end])
            start = end
            self.on_frame(message)
            if self.transport is None or self.transport.is_closing():
                return
        del buffer[:start]

    def on_frame(self, message: bytes) -> None:
        raise NotImplementedError

    def send(self, message: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(message))

    async def drained(self) -> None:
        await self._writable.wait()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()  # a sender waiting for room finds the connection closed
        self.closed.set()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def server_context(tls: ServerTLS | None) -> ssl.SSLContext | None:
    if tls is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(tls.client_ca_file)
    return context


def client_context(tls: ClientTLS | None) -> ssl.SSLContext | None:
    if tls is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    if tls.cert_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


async def connect(
    address: str, protocol: Callable[[], FrameProtocol], context: ssl.SSLContext | None, server_name: str | None
) -> FrameProtocol:
    """A connection to a member's replication address, with TLS when `context`."""
    host, port = split_address(address)
    loop = asyncio.get_running_loop()
    hostname = (server_name or host) if context is not None else None
    _, opened = await loop.create_connection(protocol, host, port, ssl=context, server_hostname=hostname)
    return opened


def ask(address: str, request: bytes, context: ssl.SSLContext | None = None, timeout_s: float = 30.0) -> bytes:
    """One exchange with a member's replication listener, over a blocking socket: send `request` as the
    first frame and return the first frame answered (b"" when the connection ends first). For tools and
    checks: a snapshot probe, or whether a listener lets a caller in."""
    host, port = split_address(address)
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        sock = context.wrap_socket(raw, server_hostname=host) if context is not None else raw
        sock.sendall(frame(request))
        received = bytearray()
        while len(received) < 4 or len(received) < 4 + _LENGTH.unpack_from(received)[0]:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return b""
            received += chunk
        (size,) = _LENGTH.unpack_from(received)
        return bytes(received[4 : 4 + size])
