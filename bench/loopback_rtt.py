"""What a loopback round trip costs in Python, three ways: the choice behind server/replication_link.py.

A server process echoes a short frame for each frame it receives, on blocking sockets; the client
process sends `--size`-byte frames one at a time and times each until its answer:

1. blocking: the client's blocking socket, `sendall` then `recv`;
2. protocol: an asyncio `Protocol` whose `data_received` settles the future the sender awaits (what a
   standby's connection and the primary's commit wait do);
3. streams: asyncio's `StreamReader`/`StreamWriter` (`readexactly` of the length, then of the body).

    python bench/loopback_rtt.py [--frames 3000] [--size 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import subprocess
import sys
import time

LENGTH = struct.Struct("<I")


def echo_server() -> None:
    """Accept one connection per mode; answer each whole frame with an 8-byte frame."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], flush=True)
    while True:
        connection, _ = listener.accept()
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = b""
        while chunk := connection.recv(1 << 16):
            buffer += chunk
            while len(buffer) >= 4 and len(buffer) >= 4 + LENGTH.unpack_from(buffer)[0]:
                buffer = buffer[4 + LENGTH.unpack_from(buffer)[0] :]
                connection.sendall(LENGTH.pack(8) + b"\0" * 8)
        connection.close()


def blocking(port: int, frame: bytes, frames: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(frames):
            start = time.perf_counter()
            sock.sendall(frame)
            received = 0
            while received < 12:
                received += len(sock.recv(1 << 16))
            times.append(time.perf_counter() - start)
        return times


async def protocol(port: int, frame: bytes, frames: int) -> list[float]:
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[None]] = []

    class Answers(asyncio.Protocol):
        received = 0

        def data_received(self, data: bytes) -> None:
            self.received += len(data)
            while self.received >= 12:
                self.received -= 12
                waiting.pop(0).set_result(None)

    transport, _ = await loop.create_connection(Answers, "127.0.0.1", port)
    times = []
    for _ in range(frames):
        start = time.perf_counter()
        future = loop.create_future()
        waiting.append(future)
        transport.write(frame)
        await future
        times.append(time.perf_counter() - start)
    transport.close()
    return times


async def streams(port: int, frame: bytes, frames: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(frames):
        start = time.perf_counter()
        writer.write(frame)
        (size,) = LENGTH.unpack(await reader.readexactly(4))
        await reader.readexactly(size)
        times.append(time.perf_counter() - start)
    writer.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=3000, help="timed round trips per mode (default %(default)s)")
    parser.add_argument("--size", type=int, default=1500, help="bytes of each frame sent (default %(default)s)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        echo_server()
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        frame = LENGTH.pack(args.size) + b"\1" * args.size
        results = {
            "blocking sockets": blocking(port, frame, args.frames),
            "asyncio protocol callback": asyncio.run(protocol(port, frame, args.frames)),
            "asyncio streams": asyncio.run(streams(port, frame, args.frames)),
        }
    finally:
        server.kill()
    print(f"| loopback round trip, {args.size}-byte frame, {args.frames:,} each | p50 | p90 |")
    print("|---|---:|---:|")
    for name, times in results.items():
        times.sort()
        p90 = times[int(len(times) * 0.9)]
        print(f"| {name} | {statistics.median(times) * 1e6:.0f} us | {p90 * 1e6:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
