"""A group's records, from the primary to its standbys, and when a record counts as committed.

The primary's side is `Commit` and `ReplicationListener`; the standby's is
`Follower`. They talk over one connection (replication_link.py).

- A standby connects to the replication address the lease names, and says
  where it stands: its last record's number and token. When the primary's
  history holds that record with the same token, the two histories agree up
  to it (only one primary ever gave out a token, and each took its history
  from the one before), and the standby gets the records after it.
  Otherwise it gets a snapshot record of the primary's whole state first,
  and starts over from it.
- The standby acknowledges each message's records once it holds them: on
  arrival when it has no journal and they continue its history (they surely
  apply), after applying and journaling them otherwise. It applies them in
  order, and a promotion waits until every record received is applied.
- A record is committed when every member of the in-sync set has
  acknowledged it (`Commit`). A call is answered, and a worker sent a step,
  only once what it did is committed: a standby that takes over holds it.
- A standby that has caught up with the primary joins the in-sync set; one
  that falls behind by more than the sync timeout, or whose connection ends,
  is removed from it, in Redis first (`Leadership.change_in_sync`), so a
  member that may lack a committed record can never be promoted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from kv_manager_service.broadcast_log import LogTruncatedError
from kv_manager_service.server import replication_link
from kv_manager_service.server.pool_identity import pool_description
from kv_manager_service.server.replica import Replica, ReplicationError
from kv_manager_service.server.snapshot import take_snapshot
from kv_manager_service.shared.errors import NotPrimaryError
from kv_manager_service.shared.security import Role, ServerTLS, TokenTable
from kvcache.journal.v1 import journal_pb2 as jpb
from kvcache.replication.v1 import replication_pb2 as rpb

if TYPE_CHECKING:
    from kv_manager_service.server.ha import GroupMember

log = logging.getLogger("kv_manager_service.server.replication")

RECORDS_PER_MESSAGE = 4096
MESSAGE_BYTES = 4 << 20  # a message of records stops growing past this (one record may be larger)
MAX_QUEUED_MESSAGES = 64  # a standby stops reading while this many received messages wait to be applied
HELLO_TIMEOUT_S = 10.0  # a connection that has not said who follows by then is closed
INLINE_RECORDS = 8  # a standby applies a message of at most this many records on the loop (see _apply_inline)


@dataclass
class _Standby:
    acked_seq: int  # it holds every record up to this one
    connections: int = 1  # its open connections (a reconnection may open one before the last ends)
    in_sync: bool = False  # Redis lists it in the in-sync set: every commit waits for it
    joining: bool = False  # its addition to the in-sync set is under way


class Commit:
    """The primary's standbys, what each acknowledged, and the waits for commitment (on the event loop).

    Thread-safe: acknowledgements arrive on the loop, changes of the in-sync set in the thread pool.
    A standby stays known while Redis may list it in the in-sync set, even between two of its
    connections, so no commit stops waiting for it before Redis has dropped it (`left`).
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
        """A standby's connection opened; `acked_seq`: what it holds (an in-sync one keeps what it acknowledged)."""
        with self._changed:
            standby = self._standbys.get(member_id)
            if standby is None:
                self._standbys[member_id] = _Standby(acked_seq)
            else:
                standby.connections += 1

    def disconnect(self, member_id: str) -> bool:
        """A standby's connection ended: True when it has no other and Redis lists it in the in-sync set (it
        must be removed there, then `left`); otherwise it is forgotten once it has no connection."""
        with self._changed:
            standby = self._standbys.get(member_id)
            if standby is None:  # forgotten: this member stepped down
                return False
            standby.connections -= 1
            if standby.connections:
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
                if not standby.connections:
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


class ReplicationListener:
    """The primary's side: accepts standbys on the replication address (see the module docstring).

    Every member listens, so that whichever leads is reachable; a member that
    does not lead refuses a standby with NOT_PRIMARY and names the primary.
    """

    def __init__(self, member: GroupMember, host: str, port: int, tls: ServerTLS | None, tokens: TokenTable | None) -> None:
        self.member = member
        self.tokens = tokens
        self.pool = pool_description(member.replica.manager.config)  # a standby's must be the same
        self.connections: set[_StandbyConnection] = set()  # open, each adding and removing itself
        loop = member.commit.loop
        context = replication_link.server_context(tls)
        self._server = asyncio.run_coroutine_threadsafe(
            loop.create_server(lambda: _StandbyConnection(self), host, port, ssl=context), loop
        ).result()
        self.port: int = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop accepting, and end every standby's connection (from any thread but the loop's)."""

        async def close() -> None:
            self._server.close()
            for connection in list(self.connections):
                connection.close()

        asyncio.run_coroutine_threadsafe(close(), self.member.commit.loop).result()

    def refusal(self, first: rpb.FollowRequest) -> rpb.Refusal | None:
        """Why a standby saying `first` may not follow (token, role, its identity); None when it may."""
        if self.tokens is not None:
            caller = self.tokens.authenticate([("authorization", f"Bearer {first.bearer_token}")])
            if caller is None:
                return rpb.Refusal(reason="UNAUTHENTICATED", message="following needs a token of the member role")
            if caller.role is not Role.MEMBER:
                return rpb.Refusal(reason="PERMISSION_DENIED", message=f"{caller.tenant!r} is not of the member role")
        if not first.member_id or " " in first.member_id:
            return rpb.Refusal(reason="INVALID_ARGUMENT", message=f"member_id must be one word, got {first.member_id!r}")
        if first.pool and first.pool != self.pool:
            return rpb.Refusal(
                reason="FAILED_PRECONDITION",
                message=f"the standby's pool configuration is not the primary's:\n  standby: {first.pool}\n"
                f"  primary: {self.pool}",
            )
        return None


class _StandbyConnection(replication_link.FrameProtocol):
    """One standby's connection to the primary: its first frame says who it is and where it stands;
    the records it lacks go out as they are accepted, and its acknowledgements come back."""

    max_frame_bytes = 1 << 16  # a standby's frames are small: a larger one ends the connection

    def __init__(self, listener: ReplicationListener) -> None:
        super().__init__()
        self.listener = listener
        self.member = listener.member
        self.member_id: str | None = None
        self._sender: asyncio.Task[None] | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.listener.connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.listener.connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._sender is not None:
            self._sender.cancel()

    def on_frame(self, message: bytes) -> None:
        request = rpb.FollowRequest.FromString(message)
        if self.member_id is not None:
            if self.member.commit.acknowledged(self.member_id, request.acked_seq):
                asyncio.get_running_loop().run_in_executor(self.member.pool, self.member.admit_standby, self.member_id)
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        refusal = self.listener.refusal(request)
        if refusal is not None:
            log.warning("refused a standby's connection from %s: %s", self.peer(), refusal.message)
            self.refuse(refusal)
            return
        self.member_id = request.member_id
        self._sender = asyncio.ensure_future(self._send(request))

    def peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if peer else "?"

    def refuse(self, refusal: rpb.Refusal) -> None:
        self.send(rpb.FollowResponse(refusal=refusal).SerializeToString())
        self.close()

    async def _send(self, first: rpb.FollowRequest) -> None:
        """Send the standby what it lacks, then each record as it is accepted, until this member steps
        down or the connection ends."""
        member = self.member
        replica = member.replica
        try:
            if first.highest_token > replica.token:
                member.saw_token(first.highest_token)
            token = member.serving_token()  # NotPrimaryError unless this member serves
            loop = asyncio.get_running_loop()
            start, snapshot = await loop.run_in_executor(member.pool, _start, replica, first)
        except NotPrimaryError as error:
            primary = member.primary
            known = primary.replication_address if primary is not None and primary.member_id != member.member_id else ""
            self.refuse(rpb.Refusal(reason="NOT_PRIMARY", message=str(error), primary=known))
            return
        member_id = first.member_id
        commit = member.commit
        commit.connect(member_id, start - 1 if snapshot is None else 0)
        log.info(
            "standby %s at %s follows from record %d%s", member_id, first.address, start,
            " (after a snapshot)" if snapshot is not None else "", extra={"member_id": member_id},
        )  # fmt: skip
        if snapshot is None and commit.acknowledged(member_id, start - 1):  # it may be in sync already
            loop.run_in_executor(member.pool, member.admit_standby, member_id)
        try:
            if snapshot is not None:
                self.send(rpb.FollowResponse(token=token, records=[snapshot]).SerializeToString())
            async for batch in replica.history.follow(start, RECORDS_PER_MESSAGE):
                if member.token != token or self.closed.is_set():
                    break  # this member stepped down (or its token moved on): the standby reconnects
                for records in _by_size([payload for _, payload in batch], MESSAGE_BYTES):
                    self.send(rpb.FollowResponse(token=token, records=records).SerializeToString())
                await self.drained()
        except LogTruncatedError:
            log.warning("standby %s fell behind the history's retention; it starts over", member_id)
        finally:
            self.close()
            if commit.disconnect(member_id):
                loop.run_in_executor(member.pool, member.drop_standby, member_id)


def _start(replica: Replica, first: rpb.FollowRequest) -> tuple[int, bytes | None]:
    """Where a standby starts: (the first record it is sent, a snapshot record to send before, or None)."""
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
    """A standby's connection to its primary, on the server's event loop: each frame's records are
    acknowledged as they arrive when they surely apply, and applied in order in the thread pool, so
    the loop never waits for the lock."""

    def __init__(self, member: GroupMember, address: str, quiet: bool = False) -> None:
        """`address`: the primary's replication address. `quiet`: a failure to follow is logged at DEBUG
        only (the last try at this address failed too)."""
        self.member = member
        self.quiet = quiet
        self.failed = False
        self.address = address
        self.applied = 0
        self._stopping = False
        self._connection: _PrimaryConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._future = asyncio.run_coroutine_threadsafe(self._run(), member.commit.loop)

    @property
    def alive(self) -> bool:
        return not self._future.done()

    def stop(self) -> None:
        """End the connection, and return once every record received is applied (from any thread but
        the loop's): a standby acknowledges records before applying them, so a promotion must find
        them applied."""

        def close() -> None:
            self._stopping = True
            if self._connection is not None:
                self._connection.close()
            elif self._task is not None:
                self._task.cancel()  # still connecting

        self.member.commit.loop.call_soon_threadsafe(close)
        concurrent.futures.wait([self._future])

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        member = self.member
        started = time.monotonic()
        if self._stopping:
            return
        try:
            connection = await replication_link.connect(
                self.address, lambda: _PrimaryConnection(self), member.client_ssl, member.server_name
            )
        except (OSError, ssl.SSLError) as error:
            self.failed = True
            log.log(logging.DEBUG if self.quiet else logging.INFO, "cannot follow %s: %s", self.address, error)
            return
        self._connection = connection
        if self._stopping:
            connection.close()
        await connection.applying()
        if self.applied:
            log.info("followed %s: %d records in %.2fs", self.address, self.applied, time.monotonic() - started)


# A message's records as received (payloads), parsed, and whether they were acknowledged on arrival.
Batch = tuple[list[bytes], list[jpb.JournalRecord], bool]


def _apply(replica: Replica, batch: Batch) -> ReplicationError | None:
    try:
        replica.apply_records(batch[0], batch[1])
    except ReplicationError as error:
        return error
    return None


class _PrimaryConnection(replication_link.FrameProtocol):
    """A standby's end of the connection (see `Follower`)."""

    def __init__(self, follower: Follower) -> None:
        super().__init__()
        self.follower = follower
        self.member = follower.member
        self.replica = follower.member.replica
        # The last record received, when every record received has been checked to follow the replica's
        # history (then a new one that follows it surely applies); None while that is not known.
        self._received: tuple[int, int] | None = None
        self._batches: asyncio.Queue[Batch | None] = asyncio.Queue()  # None: the connection ended
        self._in_flight = False  # a queued batch is being applied in the pool

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        member, replica = self.member, self.replica
        with replica.lock:
            self._received = (replica.last_seq, replica.last_record_token)
            first = rpb.FollowRequest(
                member_id=member.member_id, address=member.address, last_seq=replica.last_seq,
                last_token=replica.last_record_token, highest_token=replica.token, acked_seq=replica.last_seq,
                bearer_token=member.bearer_token or "", pool=pool_description(replica.manager.config),
            )  # fmt: skip
        self.send(first.SerializeToString())

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.follower.applied:
            self.follower.failed = True
        if exc is not None and not self.follower.applied:
            log.log(logging.DEBUG if self.follower.quiet else logging.INFO,
                    "following %s ended: %s", self.follower.address, exc)  # fmt: skip
        self._batches.put_nowait(None)  # what was received is still applied

    def on_frame(self, message: bytes) -> None:
        response = rpb.FollowResponse.FromString(message)
        follower, replica = self.follower, self.replica
        if response.HasField("refusal"):
            refusal = response.refusal
            follower.failed = True
            log.log(logging.DEBUG if follower.quiet else logging.INFO, "%s refuses to be followed: %s %s",
                    follower.address, refusal.reason, refusal.message)  # fmt: skip
            self.close()
            return
        if response.token < replica.token:
            log.warning("the member at %s sends token %d, older than %d: not following it",
                        follower.address, response.token, replica.token)  # fmt: skip
            self.close()
            return
        if response.token > replica.token:
            self.member.saw_token(response.token)
        records = [jpb.JournalRecord.FromString(payload) for payload in response.records]
        # Without a journal, a record is held once it is in memory: acknowledged before it is applied,
        # when it surely applies (it follows), so applying it is off the primary's round trip.
        early = replica.journal is None and self._received is not None and _follows(records, *self._received)
        if early:
            self._received = (records[-1].seq, records[-1].token)
            self.send(rpb.FollowRequest(acked_seq=records[-1].seq).SerializeToString())
        else:
            self._received = None
        batch = (list(response.records), records, early)
        if not self._apply_inline(batch):
            self._batches.put_nowait(batch)
            if self._batches.qsize() >= MAX_QUEUED_MESSAGES and self.transport is not None:
                self.transport.pause_reading()

    def _apply_inline(self, batch: Batch) -> bool:
        """Apply a small batch here, on the loop, when nothing received before it waits and the lock is free
        at once: no hand-off to the pool and back. False when it must be queued instead."""
        lock = self.replica.lock
        records = batch[1]
        if self._in_flight or not self._batches.empty() or len(records) > INLINE_RECORDS:
            return False
        if any(record.WhichOneof("entry") == "snapshot" for record in records):
            return False
        if not lock.acquire(blocking=False):
            return False
        try:
            error = _apply(self.replica, batch)
        finally:
            lock.release()
        self._applied(batch, error)
        return True

    async def applying(self) -> None:
        """Apply the batches queued, in order, in the pool, until the connection ends and every one is applied."""
        loop = asyncio.get_running_loop()
        while (batch := await self._batches.get()) is not None:
            if self.transport is not None and self._batches.qsize() < MAX_QUEUED_MESSAGES // 2:
                self.transport.resume_reading()
            self._in_flight = True
            try:
                error = await loop.run_in_executor(self.member.pool, _apply, self.replica, batch)
            finally:
                self._in_flight = False
            if not self._applied(batch, error):
                return

    def _applied(self, batch: Batch, error: ReplicationError | None) -> bool:
        """After a batch is applied (on the loop): acknowledge it when that waited for the apply; on an
        error, start over. False when the connection ends."""
        replica = self.replica
        if error is not None:
            log.warning("cannot apply the records of %s (%s); starting over", self.follower.address, error)
            with replica.lock:  # ask for a snapshot next time: no record of ours can match
                replica.last_record_token = 0
            self.close()
            self._drop_queued()
            return False
        _, records, early = batch
        self.follower.applied += len(records)
        if not early:
            self.send(rpb.FollowRequest(acked_seq=replica.last_seq).SerializeToString())
            if self._batches.empty() and not self._in_flight:
                self._received = (replica.last_seq, replica.last_record_token)
        return True

    def _drop_queued(self) -> None:
        while not self._batches.empty():
            self._batches.get_nowait()
