"""A group's records, from the primary to its standbys, and when a record counts as committed.

The primary's side is `Commit` and `ReplicationServicer`; the standby's is `Follower`.

- A standby opens `Follow` saying where it stands: its last record's number
  and token. When the primary's history holds that record with the same
  token, the two histories agree up to it (only one primary ever gave out a
  token, and each took its history from the one before), and the standby
  gets the records after it. Otherwise it gets a snapshot record of the
  primary's whole state first, and starts over from it.
- The standby applies each message's records (and journals them when it has
  a journal), then acknowledges the last one on the same stream.
- A record is committed when every member of the in-sync set has
  acknowledged it (`Commit`). A call is answered, and a worker sent a step,
  only once what it did is committed: a standby that takes over holds it.
- A standby that has caught up with the primary joins the in-sync set; one
  that falls behind by more than the sync timeout, or whose stream ends, is
  removed from it, in Redis first (`Leadership.change_in_sync`), so a member
  that may lack a committed record can never be promoted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator, Sequence

import grpc

from kv_manager_service.broadcast_log import LogTruncatedError
from kv_manager_service.server.replica import ReplicationError
from kv_manager_service.server.snapshot import take_snapshot
from kv_manager_service.shared.errors import NotPrimaryError
from kv_manager_service.shared.status import end_call
from kvcache.journal.v1 import journal_pb2 as jpb
from kvcache.replication.v1 import replication_pb2 as rpb
from kvcache.replication.v1 import replication_pb2_grpc as rpb_grpc

if TYPE_CHECKING:
    from kv_manager_service.server.ha import GroupMember

log = logging.getLogger("kv_manager_service.server.replication")

RECORDS_PER_MESSAGE = 4096
MESSAGE_BYTES = 4 << 20  # a message of records stops growing past this (one record may be larger)


@dataclass
class _Standby:
    acked_seq: int  # it holds every record up to this one
    streams: int = 1  # its open Follow streams (a reconnection may open one before the last ends)
    in_sync: bool = False  # Redis lists it in the in-sync set: every commit waits for it
    joining: bool = False  # its addition to the in-sync set is under way


class Commit:
    """The primary's standbys, what each acknowledged, and the waits for commitment (on the event loop).

    Thread-safe: acknowledgements arrive on the loop, changes of the in-sync set in the thread pool.
    A standby stays known while Redis may list it in the in-sync set, even between two of its
    streams, so no commit stops waiting for it before Redis has dropped it (`left`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._changed = threading.Condition()
        self._standbys: dict[str, _Standby] = {}
        self._waiters: list[tuple[int, asyncio.Future[bool]]] = []

    def committed_seq(self, last_seq: int) -> int:
        """The last committed record: the least any in-sync standby acknowledged, `last_seq` with none."""
        with self._changed:
            return min((s.acked_seq for s in self._standbys.values() if s.in_sync), default=last_seq)

    async def wait(self, seq: int, last_seq: Callable[[], int], timeout_s: float) -> bool:
        """Until record `seq` is committed: True; False after `timeout_s` (some in-sync standby lags)."""
        if self.committed_seq(last_seq()) >= seq:
            return True
        future: asyncio.Future[bool] = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, _settle, [future], False)
        with self._changed:
            self._waiters.append((seq, future))
        self._wake()  # an acknowledgement may have come between the check and the registration
        try:
            return await future
        finally:
            timer.cancel()

    def laggards(self, seq: int) -> list[str]:
        """The in-sync standbys that have not acknowledged record `seq`."""
        with self._changed:
            return [m for m, s in self._standbys.items() if s.in_sync and s.acked_seq < seq]

    def connect(self, member_id: str, acked_seq: int) -> None:
        """A standby's stream opened; `acked_seq`: what it holds (an in-sync one keeps what it acknowledged)."""
        with self._changed:
            standby = self._standbys.get(member_id)
            if standby is None:
                self._standbys[member_id] = _Standby(acked_seq)
            else:
                standby.streams += 1

    def disconnect(self, member_id: str) -> bool:
        """A standby's stream ended: True when it has no other and Redis lists it in the in-sync set (it
        must be removed there, then `left`); otherwise it is forgotten once it has no stream."""
        with self._changed:
            standby = self._standbys.get(member_id)
            if standby is None:  # forgotten: this member stepped down
                return False
            standby.streams -= 1
            if standby.streams:
                return False
            if not standby.in_sync:
                del self._standbys[member_id]
            return standby.in_sync

    def left(self, member_id: str) -> None:
        """Redis no longer lists the standby in the in-sync set: no commit waits for it any more."""
        with self._changed:
            standby = self._standbys.get(member_id)
            if standby is not None:
                standby.in_sync = False
                if not standby.streams:
                    del self._standbys[member_id]
        self._wake()

    def acknowledged(self, member_id: str, seq: int) -> bool:
        """A standby holds every record up to `seq`; True when it should now try to join the in-sync set."""
        with self._changed:
            standby = self._standbys.get(member_id)
            if standby is None:
                return False
            standby.acked_seq = max(standby.acked_seq, seq)
            self._changed.notify_all()
            may_join = not standby.in_sync and not standby.joining
            if may_join:
                standby.joining = True
        self._wake()
        return may_join

    def wait_acked(self, member_id: str, seq: int, timeout_s: float) -> bool:
        """Block (a thread) until the standby acknowledged record `seq`, for at most `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(
                lambda: member_id in self._standbys and self._standbys[member_id].acked_seq >= seq, timeout_s
            )

    def joined(self, member_id: str, in_sync: bool) -> None:
        """The end of a standby's attempt to join the in-sync set."""
        with self._changed:
            standby = self._standbys.get(member_id)
            if standby is not None:
                standby.in_sync = standby.in_sync or in_sync
                standby.joining = False

    def in_sync(self) -> list[str]:
        """The standbys every commit waits for."""
        with self._changed:
            return [m for m, s in self._standbys.items() if s.in_sync]

    def clear(self) -> None:
        """Forget every standby and wake every wait (a primary that stepped down: its waits end refused)."""
        with self._changed:
            self._standbys.clear()
        self._wake(everyone=True)

    def _wake(self, everyone: bool = False) -> None:
        """Resolve the waits that are committed now (from any thread)."""
        with self._changed:
            acks = [s.acked_seq for s in self._standbys.values() if s.in_sync]
            committed = min(acks) if acks else None
            due = [f for seq, f in self._waiters if everyone or committed is None or seq <= committed]
            if due:
                self._waiters = [(seq, f) for seq, f in self._waiters if not (everyone or committed is None or seq <= committed)]
        if not due:
            return
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # an acknowledgement, read on the loop: the waits go on at once
            _settle(due, True)
        else:
            self.loop.call_soon_threadsafe(_settle, due, True)


def _settle(futures: list[asyncio.Future[bool]], committed: bool) -> None:
    """End waits: with True once committed, False when their time is up."""
    for future in futures:
        if not future.done():
            future.set_result(committed)


class ReplicationServicer(rpb_grpc.ReplicationServiceServicer):
    """The primary's side of `Follow` (see the module docstring)."""

    def __init__(self, member: GroupMember) -> None:
        self.member = member

    async def Follow(
        self, request_iterator: AsyncIterator[rpb.FollowRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.FollowResponse]:
        member = self.member
        replica = member.replica
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        try:
            if first.highest_token > replica.token:
                member.saw_token(first.highest_token)
            token = member.serving_token()  # NotPrimaryError unless this member serves
            loop = asyncio.get_running_loop()
            start, snapshot = await loop.run_in_executor(member.pool, self._start, first)
        except NotPrimaryError as error:
            end_call(context, error)
            return
        commit = member.commit
        commit.connect(first.member_id, start - 1 if snapshot is None else 0)
        log.info(
            "standby %s at %s follows from record %d%s", first.member_id, first.address, start,
            " (after a snapshot)" if snapshot is not None else "", extra={"member_id": first.member_id},
        )  # fmt: skip
        if snapshot is None and commit.acknowledged(first.member_id, start - 1):  # it may be in sync already
            loop.run_in_executor(member.pool, member.admit_standby, first.member_id)
        acks = asyncio.ensure_future(self._read_acks(first.member_id, request_iterator))
        try:
            if snapshot is not None:
                yield rpb.FollowResponse(token=token, records=[snapshot])
            async for batch in replica.history.follow(start, RECORDS_PER_MESSAGE):
                if member.token != token:
                    break  # this member stepped down (or its token moved on): the standby reconnects
                for records in _by_size([payload for _, payload in batch], MESSAGE_BYTES):
                    yield rpb.FollowResponse(token=token, records=records)
        except LogTruncatedError:
            log.warning("standby %s fell behind the history's retention; it starts over", first.member_id)
        finally:
            acks.cancel()
            if commit.disconnect(first.member_id):
                asyncio.get_running_loop().run_in_executor(member.pool, member.drop_standby, first.member_id)

    def _start(self, first: rpb.FollowRequest) -> tuple[int, bytes | None]:
        """Where a standby starts: (the first record it is sent, a snapshot record to send before, or None)."""
        replica = self.member.replica
        with replica.lock:
            history = replica.history
            seq = first.last_seq
            if seq == replica.last_seq and first.last_token == replica.last_record_token:
                return seq + 1, None
            if 0 < seq < replica.last_seq and seq >= history.first_retained_id:
                (_, payload), = history.read(seq, 1, 0)
                if jpb.JournalRecord.FromString(payload).token == first.last_token:
                    return seq + 1, None
            record = jpb.JournalRecord(
                snapshot=take_snapshot(replica), seq=replica.last_seq, token=replica.last_record_token
            )
            return replica.last_seq + 1, record.SerializeToString()

    async def _read_acks(self, member_id: str, requests: AsyncIterator[rpb.FollowRequest]) -> None:
        member = self.member
        async for request in requests:
            if member.commit.acknowledged(member_id, request.acked_seq):
                asyncio.get_running_loop().run_in_executor(member.pool, member.admit_standby, member_id)


def _follows(records: list[jpb.JournalRecord], seq: int, token: int) -> bool:
    """Whether `records` (no snapshot among them) continue, in order, a history ending at record `seq` of token `token`."""
    for record in records:
        if record.WhichOneof("entry") == "snapshot" or record.seq != seq + 1 or record.token < token:
            return False
        seq, token = record.seq, record.token
    return bool(records)


def _by_size(payloads: list[bytes], max_bytes: int) -> Iterator[list[bytes]]:
    """`payloads` in order, in runs of at most `max_bytes` (a larger payload alone)."""
    run: list[bytes] = []
    size = 0
    for payload in payloads:
        if run and size + len(payload) > max_bytes:
            yield run
            run, size = [], 0
        run.append(payload)
        size += len(payload)
    if run:
        yield run


class Follower:
    """A standby's stream from its primary, a task on the server's event loop: acknowledges each
    message's records and applies them (in the thread pool, so the loop never waits for the lock)."""

    def __init__(self, member: GroupMember, address: str, quiet: bool = False) -> None:
        """`quiet`: a failure to follow is logged at DEBUG only (the last try at this address failed too)."""
        self.member = member
        self.quiet = quiet
        self.failed = False
        self.address = address
        self._stopped = threading.Event()
        self._applied = threading.Event()  # set while no apply is under way
        self._applied.set()
        self._future = asyncio.run_coroutine_threadsafe(self._run(), member.commit.loop)

    @property
    def alive(self) -> bool:
        return not self._future.done()

    def stop(self) -> None:
        """End the stream and return once no record is being applied (from any thread but the loop's)."""
        self._stopped.set()
        self._future.cancel()
        concurrent.futures.wait([self._future])
        self._applied.wait()

    async def _run(self) -> None:
        channel = self.member.channel(self.address)  # made on the loop it belongs to
        try:
            await self._follow(channel)
        finally:
            await channel.close()

    def _apply(self, payloads: Sequence[bytes], records: list[jpb.JournalRecord]) -> None:
        try:
            self.member.replica.apply_records(payloads, records)
        finally:
            self._applied.set()

    async def _follow(self, channel: grpc.aio.Channel) -> None:
        member = self.member
        replica = member.replica
        with replica.lock:
            first = rpb.FollowRequest(
                member_id=member.member_id, address=member.address, last_seq=replica.last_seq,
                last_token=replica.last_record_token, highest_token=replica.token, acked_seq=replica.last_seq,
            )  # fmt: skip
        started = time.monotonic()
        applied = 0
        try:
            call = rpb_grpc.ReplicationServiceStub(channel).Follow(metadata=member.call_metadata)
            await call.write(first)
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                if response.token < replica.token:
                    log.warning("the member at %s sends token %d, older than %d: not following it",
                                self.address, response.token, replica.token)  # fmt: skip
                    return
                member.saw_token(response.token)
                records = [jpb.JournalRecord.FromString(payload) for payload in response.records]
                # Without a journal, a record is held once it is in memory: acknowledged before it is
                # applied, when it surely applies (it follows), so applying it is off the primary's
                # round trip. The promotion waits for this thread, so it is applied before any call.
                early = replica.journal is None and _follows(records, replica.last_seq, replica.last_record_token)
                if early:
                    await call.write(rpb.FollowRequest(acked_seq=records[-1].seq))
                self._applied.clear()
                # Shielded: a stop waits for an apply under way rather than leave it half-known.
                await asyncio.shield(
                    asyncio.get_running_loop().run_in_executor(member.pool, self._apply, response.records, records)
                )
                applied += len(records)
                if not early:
                    await call.write(rpb.FollowRequest(acked_seq=replica.last_seq))
        except grpc.RpcError as error:
            if not self._stopped.is_set():
                self.failed = not applied
                log.log(logging.DEBUG if self.quiet and not applied else logging.INFO,
                        "following %s ended: %s %s", self.address, error.code().name, error.details())  # fmt: skip
        except ReplicationError as error:
            log.warning("cannot apply the records of %s (%s); starting over", self.address, error)
            with replica.lock:  # ask for a snapshot next time: no record of ours can match
                replica.last_record_token = 0
        finally:
            self._stopped.set()
            if applied:
                elapsed = time.monotonic() - started
                log.info("followed %s: %d records in %.2fs", self.address, applied, elapsed)
