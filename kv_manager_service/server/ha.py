"""One member of a high-availability group: a primary that serves, or a standby that follows it.

Managers started with the same `--replica-id` and `--ha-url` form a group
for one replica. Redis decides who leads (leadership.py); records flow from
the primary to the standbys (replication.py). This module runs the member's
role, in one thread:

- a standby reads the lease every `poll_s`, follows whoever holds it, and
  takes the lease once it is free, if it is in the in-sync set;
- a primary renews the lease every quarter of its TTL, and steps down when
  it cannot: another took it, or its own clock says it may have lapsed.

Rules each role change keeps:

- the core is deterministic, so a standby that applied the same records in
  the same order holds the same pool, tables, step ids and keyed-Step memory;
- a member serves only while `Leadership.valid_until` is ahead on its own
  monotonic clock (`check`): mutations are refused before they apply, and a
  call's answer is checked again after its records are committed, so a
  primary that was paused past its lease answers nothing it accepted;
- on promotion, the new token is taken before anything is accepted, the
  workers' leases restart (they had no chance to call), and the serving
  callbacks (health, mirror, worker expiry) run; on stepping down they are
  undone, and the streams of workers and the connections of standbys end, so they look for the
  new primary;
- a member that has seen a higher token than the lease's (Redis lost its
  data and handed out an older one) follows no one under it, and says so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import Executor
from typing import Callable

import redis

from kv_manager_service.server.ha_options import HAOptions, MemberLink
from kv_manager_service.server.leadership import Leadership, LeaseHolder, NoGroupError, NotInSyncError
from kv_manager_service.server.replica import Replica
from kv_manager_service.server import replication_link
from kv_manager_service.server.replication import Commit, Follower, ReplicationListener
from kv_manager_service.shared.errors import NotPrimaryError

log = logging.getLogger("kv_manager_service.server.ha")


class GroupMember:
    """The member's role and its changes (see the module docstring)."""

    def __init__(
        self,
        replica: Replica,
        client: redis.Redis,
        address: str,
        options: HAOptions,
        pool: Executor,
        loop: asyncio.AbstractEventLoop,
        on_serving: Callable[[bool], None],
        link: MemberLink = MemberLink(),
    ) -> None:
        """`address`: what the other members and clients reach this one at; its host with the port of
        the replication listener (`link`) is the replication address. `on_serving(True)` runs once this
        member is primary, `on_serving(False)` once it no longer is."""
        self.replica = replica
        self.options = options
        self.member_id = replica.journal.member_id if replica.journal is not None else uuid.uuid4().hex
        self.address = address
        self.pool = pool
        self.bearer_token = link.bearer_token
        self.client_ssl = replication_link.client_context(link.client_tls)
        self.server_name = link.client_tls.server_name if link.client_tls is not None else None
        self.on_serving = on_serving
        self.commit = Commit(loop)
        self.token = 0  # the token this member serves under; 0 while it is a standby
        self.led_token = 0  # the token of this member's last term as primary (0: it never led)
        self.primary: LeaseHolder | None = None  # the lease's holder as last read
        self._follower: Follower | None = None
        self._retry_s = options.poll_s  # the wait before following the same primary again after a failure
        self._retry_at = 0.0  # monotonic
        self._absent_since: float | None = None  # monotonic: since when no lease and no in-sync set were seen
        self._warned: str | None = None  # the last warning `_warn_once` logged
        self._stopped = threading.Event()
        self.listener = ReplicationListener(self, link.host, link.port, link.server_tls, link.tokens)
        host, _ = replication_link.split_address(address)
        self.replication_address = f"{host}:{self.listener.port}"
        self.leadership = Leadership(
            client, replica.replica_id, self.member_id, address, self.replication_address, options.lease_s
        )
        replica.enable_history(options.history_retention, options.history_retention_bytes)
        replica.primary_check = self.check
        self._thread = threading.Thread(target=self._run, name="ha-member", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop following or leading; a primary gives its lease up, so a standby takes over at once."""
        self._stopped.set()
        self._thread.join()
        if self._follower is not None:
            self._follower.stop()
        self.listener.close()
        if self.token:
            token = self.token
            # The last holder of a state no journal keeps: the group starts over, empty, with its next member.
            dissolve = self.replica.journal is None and not self.commit.in_sync()
            self._step_down("stopping")
            try:
                self.leadership.release(token, dissolve)
                if dissolve:
                    log.warning("this primary had no journal and no standby in sync: the group's state ends "
                                "with it, and its next member starts it over, empty")  # fmt: skip
            except redis.RedisError as error:
                log.warning("cannot give the lease up (%s): a standby takes over once it lapses", error)

    # -- serving ----------------------------------------------------------------------

    def check(self) -> None:
        """NotPrimaryError unless this member serves now, by its own clock."""
        if self.token and time.monotonic() < self.leadership.valid_until:
            return
        primary = self.primary
        known = primary.address if primary is not None and primary.member_id != self.member_id else None
        if self.token:
            raise NotPrimaryError("this manager's leadership lease may have lapsed: it accepts nothing now", known)
        where = f"the primary is {known}" if known else "no primary is known yet"
        raise NotPrimaryError(f"this manager is a standby of replica {self.replica.replica_id!r}: {where}", known)

    def serving_token(self) -> int:
        self.check()
        return self.token

    def saw_token(self, token: int) -> None:
        """A higher token exists: remember it (never go below it); a primary under a lower one steps down."""
        replica = self.replica
        with replica.lock:
            replica.token = max(replica.token, token)
        if self.token and token > self.token:
            self.leadership.valid_until = 0.0  # refuse from now; the thread steps down

    async def committed(self) -> None:
        """Until every record accepted so far is committed; then NotPrimaryError unless this member still
        serves. A lagging in-sync standby is dropped from the set (in Redis first) after the sync timeout."""
        replica = self.replica
        seq = replica.last_seq
        loop = asyncio.get_running_loop()
        while not await self.commit.wait(seq, lambda: replica.last_seq, self.options.sync_timeout_s):
            self.check()
            for member_id in self.commit.laggards(seq):
                await loop.run_in_executor(self.pool, self.drop_standby, member_id)
        self.check()

    def admit_standby(self, member_id: str) -> None:
        """Add a standby that has caught up to the in-sync set (in the thread pool). The lock is held
        while it acknowledges the last record and Redis records it, so no record is committed without it
        that it lacks; mutations wait that long (a round trip, and at most the sync timeout)."""
        replica = self.replica
        admitted = False
        try:
            with replica.lock:
                if self.token and self.commit.wait_acked(member_id, replica.last_seq, self.options.sync_timeout_s):
                    admitted = self.leadership.change_in_sync(self.token, True, member_id)
                    if admitted:
                        self.commit.joined(member_id, True)
                        seq = replica.last_seq
        except redis.RedisError as error:
            log.warning("cannot add standby %s to the in-sync set (%s); trying at its next acknowledgement",
                        member_id, error)  # fmt: skip
        finally:
            if not admitted:
                self.commit.joined(member_id, False)
        if admitted:
            log.info("standby %s is in sync at record %d", member_id, seq, extra={"member_id": member_id})

    def drop_standby(self, member_id: str) -> None:
        """Remove a standby from the in-sync set, in Redis first, then stop waiting for it (in the thread
        pool). When Redis refuses, the waits go on: a commit never skips a member Redis still lists."""
        token = self.token
        try:
            if token and self.leadership.change_in_sync(token, False, member_id):
                log.warning("standby %s left the in-sync set: it lags or is gone", member_id,
                            extra={"member_id": member_id})  # fmt: skip
                self.commit.left(member_id)
            elif token:
                self.leadership.valid_until = 0.0  # the lease is no longer ours
        except redis.RedisError as error:
            log.warning("cannot remove standby %s from the in-sync set (%s)", member_id, error)

    # -- the role's thread ------------------------------------------------------------------

    def _run(self) -> None:
        redis_down = False
        while not self._stopped.is_set():
            try:
                if self.token:
                    self._lead()
                else:
                    self._follow()
                if redis_down:
                    log.info("the group's Redis answers again")
                redis_down = False
            except redis.RedisError as error:
                log.log(logging.DEBUG if redis_down else logging.WARNING, "the group's Redis: %s", error)
                redis_down = True
            except Exception:
                log.exception("bug in the group member's thread")
            if self.token:
                # Renew four times a lease; sooner when the clock runs out earlier than that.
                left = self.leadership.valid_until - time.monotonic()
                self._stopped.wait(max(0.01, min(self.options.lease_s / 4, left / 2)))
            else:
                self._stopped.wait(self.options.poll_s)

    def _lead(self) -> None:
        try:
            renewed = self.leadership.renew(self.token)
        except redis.RedisError:
            if time.monotonic() >= self.leadership.valid_until:
                self._step_down("the lease could not be renewed in time (Redis unreachable)")
            raise
        if renewed:
            return
        if renewed is None:  # lapsed, or Redis lost it: take it again if no one else did
            try:
                outcome = self.leadership.acquire(self.replica.token, may_found=True)
            except NotInSyncError:
                outcome = None
            if isinstance(outcome, int):
                log.warning("the lease had lapsed (or Redis lost it): serving on under token %d", outcome)
                self._serve_under(outcome)
                return
        self._step_down("another member holds the lease")

    def _follow(self) -> None:
        holder = self.leadership.holder()
        self.primary = holder
        if holder is not None:
            self._absent_since = None
            if holder.token < self.replica.token or (holder.token <= self.led_token and holder.member_id != self.member_id):
                self._warn_once(f"the lease names token {holder.token}, below {self.replica.token} already seen: "
                                "Redis lost its data; not following it (docs/high-availability.md)")
                return
            if holder.member_id == self.member_id:
                return  # our own lease from before a restart: it lapses, then we may take it again
            follower = self._follower
            address = holder.replication_address
            if follower is None or not follower.alive or follower.address != address:
                again = follower is not None and follower.failed and follower.address == address
                if again and time.monotonic() < self._retry_at:
                    return
                # Failing again at the same address: wait longer each time, up to a lease, and log it once.
                self._retry_s = min(self._retry_s * 2, self.options.lease_s) if again else self.options.poll_s
                self._retry_at = time.monotonic() + self._retry_s
                if follower is not None:
                    follower.stop()
                self._follower = Follower(self, address, quiet=again)
            return
        try:
            try:
                outcome = self.leadership.acquire(self.replica.token, may_found=False)
            except NoGroupError:
                if not self._may_found():
                    return
                outcome = self.leadership.acquire(self.replica.token, may_found=True)
        except NotInSyncError:
            self._warn_once("the lease is free, but this member is not in the in-sync set: it may lack "
                            "acknowledged steps, so it waits for a member that is")
            return
        except NoGroupError:
            return
        if isinstance(outcome, int):
            self._promote(outcome)

    def _may_found(self) -> bool:
        """Whether this member may start the group: Redis has held no lease and no in-sync set for a whole
        lease (a live primary whose Redis lost its data has re-established them by then), and this member
        has seen no token, or led under the highest it has seen (a primary that stepped down while Redis
        was away: every committed record went through it). Any other member knows the group existed, so
        Redis lost its data, and it may lack committed records."""
        now = time.monotonic()
        if self._absent_since is None:
            self._absent_since = now
        if self.replica.token and self.replica.token != self.led_token:
            self._warn_once("Redis holds no record of this group, which this member has seen under token "
                            f"{self.replica.token}: Redis lost its data, and no member is promoted until the "
                            "primary re-establishes it")
            return False
        return now - self._absent_since >= self.options.lease_s

    def _promote(self, token: int) -> None:
        if self._follower is not None:
            self._follower.stop()
            self._follower = None
        replica = self.replica
        with replica.lock:
            self._serve_under(token)
            replica.workers.renew_all(time.monotonic())
        self.primary = LeaseHolder(token, self.member_id, self.address, self.replication_address)
        log.warning("this member is the primary of replica %s now, under token %d, at record %d (step %d)",
                    replica.replica_id, token, replica.last_seq, replica.manager.last_step_id,
                    extra={"token": token})  # fmt: skip
        self.on_serving(True)

    def _serve_under(self, token: int) -> None:
        with self.replica.lock:
            self.replica.token = max(self.replica.token, token)
            self.token = self.led_token = token

    def _step_down(self, why: str) -> None:
        replica = self.replica
        with replica.lock:
            self.token = 0
            self.leadership.valid_until = 0.0
            # End the workers' streams and the standbys' connections: they look for the new primary.
            replica.steps.end_followers()
            replica.history.end_followers()
        self.commit.clear()
        if not self._stopped.is_set():
            log.error("this member stepped down: %s; it follows the new primary from record %d", why, replica.last_seq)
        self.on_serving(False)

    def _warn_once(self, message: str) -> None:
        if self._warned != message:
            self._warned = message
            log.warning(message)
