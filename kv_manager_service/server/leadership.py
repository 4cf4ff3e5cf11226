"""Who leads a high-availability group, decided by Redis: one lease, a fencing token, the in-sync set.

Keys, under one hash tag so a Redis Cluster keeps them in one slot:

    kvcache:ha:{<replica id>}:lease   STRING "<token> <member id> <address> <replication address>", with a TTL
    kvcache:ha:{<replica id>}:token   STRING the last fencing token given out
    kvcache:ha:{<replica id>}:isr     SET    the members that hold every acknowledged record

Every change is one script, so each is atomic:

- `acquire`: the lease is free, and the caller is in the in-sync set (or the
  group has no set at all and the caller may found it): the token grows past
  both the stored one and the highest the caller has seen, the lease names
  the caller, and the set becomes the caller alone (the others rejoin once
  they have caught up with it);
- `renew`: the lease still names this token and member;
- `change_in_sync`: adds or removes a member, only under the lease's token,
  so a primary that lost its lease can no longer change the set.

The token never goes backwards, even when Redis restarts without its data:
each member passes the highest token it has seen, and a new one is past it.

The caller's lease is valid, on its own monotonic clock, until the time it
sent the successful call plus the TTL less a margin (`valid_until`): Redis
starts the TTL when it receives the call, later, so the member stops acting
as primary before Redis lets anyone else take over. A process that was
paused past it finds it over when it resumes, before talking to Redis.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import redis

# KEYS: lease, token, isr. ARGV: member id, its two addresses (one string), TTL ms, highest token seen, '1' if it may found the group.
# Returns {token, ''} when acquired; {0, lease} when another holds it; {-1, ''} when the caller is not in
# the in-sync set; {-2, ''} when the group has no in-sync set and the caller may not found it.
_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current then return {0, current} end
if redis.call('EXISTS', KEYS[3]) == 1 then
  if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then return {-1, ''} end
elseif ARGV[5] ~= '1' then
  return {-2, ''}
end
local token = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(ARGV[4])) + 1
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[3])
redis.call('SADD', KEYS[3], ARGV[1])
return {token, ''}
"""

# KEYS: lease. ARGV: the lease's value, TTL ms. 1: renewed; 0: no lease; -1: another's.
_RENEW = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
if current ~= ARGV[1] then return -1 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: lease, isr. ARGV: token, 'add' or 'remove', member id. 1: done; 0: the lease is not this token's.
_CHANGE_IN_SYNC = """
local current = redis.call('GET', KEYS[1])
if not current or string.match(current, '^(%d+) ') ~= ARGV[1] then return 0 end
if ARGV[2] == 'add' then redis.call('SADD', KEYS[2], ARGV[3]) else redis.call('SREM', KEYS[2], ARGV[3]) end
return 1
"""

# KEYS: lease, isr. ARGV: the lease's value, '1' to delete the in-sync set too. Deletes the lease only if
# it is still that.
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '1' then redis.call('DEL', KEYS[2]) end
return redis.call('DEL', KEYS[1])
"""


class LeaseHolder(NamedTuple):
    token: int
    member_id: str
    address: str  # where clients and workers call it
    replication_address: str  # where standbys follow it (replication_link.py)

    @classmethod
    def parse(cls, value: bytes | str) -> LeaseHolder | None:
        """The holder a lease's value names; None for a value that is no lease (it is nobody's)."""
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = text.split(" ")
        if len(parts) != 4 or not parts[0].isdigit():
            return None
        return cls(int(parts[0]), parts[1], parts[2], parts[3])

    def value(self) -> str:
        return f"{self.token} {self.member_id} {self.address} {self.replication_address}"


class NotInSyncError(Exception):
    """The lease is free, but this member may not take it: it is not in the in-sync set."""


class NoGroupError(Exception):
    """The lease is free and Redis holds no in-sync set: a new group, or a Redis that lost its data."""


class Leadership:
    """One member's view of its group's lease in Redis (see the module docstring)."""

    def __init__(
        self, client: redis.Redis, replica_id: str, member_id: str, address: str, replication_address: str, lease_s: float
    ) -> None:
        if " " in member_id or not member_id:
            raise ValueError(f"a member id is one word, got {member_id!r}")
        self.client = client
        self.member_id = member_id
        self.address = address
        self.replication_address = replication_address
        self.lease_s = lease_s
        self.margin_s = max(lease_s / 10, 0.05)  # for the clocks' rates, and the time the reply takes
        prefix = f"kvcache:ha:{{{replica_id}}}"
        self.keys = (f"{prefix}:lease", f"{prefix}:token", f"{prefix}:isr")
        self.valid_until = 0.0  # monotonic: this member may act as primary before it
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._change = client.register_script(_CHANGE_IN_SYNC)
        self._release = client.register_script(_RELEASE)

    @property
    def ttl_ms(self) -> int:
        return int(self.lease_s * 1000)

    def holder(self) -> LeaseHolder | None:
        """Who holds the lease now; None when it is free (or holds no lease)."""
        value = self.client.get(self.keys[0])
        return None if value is None else LeaseHolder.parse(value)

    def acquire(self, highest_token: int, may_found: bool) -> LeaseHolder | int:
        """Take the free lease: the new token; or the holder when another has it.

        NotInSyncError when this member is not in the in-sync set; NoGroupError when there is no
        set and not `may_found`. Raises redis.RedisError when Redis cannot be reached.
        """
        sent = time.monotonic()
        addresses = f"{self.address} {self.replication_address}"
        code, value = self._acquire(keys=self.keys, args=[self.member_id, addresses, self.ttl_ms, highest_token, int(may_found)])
        if code > 0:
            self.valid_until = sent + self.lease_s - self.margin_s
            return int(code)
        if code == -1:
            raise NotInSyncError(f"member {self.member_id} is not in the in-sync set")
        if code == -2:
            raise NoGroupError("Redis holds no in-sync set for this group")
        holder = LeaseHolder.parse(value)
        return holder if holder is not None else LeaseHolder(0, "?", "", "")

    def renew(self, token: int) -> bool | None:
        """Extend our lease: True; None when there is no lease (it lapsed, or Redis lost it); False
        when another member holds it. Raises redis.RedisError when Redis cannot be reached."""
        sent = time.monotonic()
        outcome = self._renew(keys=self.keys[:1], args=[self._value(token), self.ttl_ms])
        if outcome == 1:
            self.valid_until = sent + self.lease_s - self.margin_s
            return True
        self.valid_until = 0.0
        return None if outcome == 0 else False

    def change_in_sync(self, token: int, add: bool, member_id: str) -> bool:
        """Add a member to the in-sync set or remove one, under our token: False when the lease is not ours."""
        return bool(self._change(keys=[self.keys[0], self.keys[2]], args=[token, "add" if add else "remove", member_id]))

    def release(self, token: int, dissolve: bool = False) -> None:
        """Give the lease up now (a clean stop), so a standby need not wait for it to lapse. `dissolve`:
        delete the in-sync set too (no member holds the group's state any more), so a new member may
        found the group again."""
        self.valid_until = 0.0
        self._release(keys=[self.keys[0], self.keys[2]], args=[self._value(token), int(dissolve)])

    def _value(self, token: int) -> str:
        return LeaseHolder(token, self.member_id, self.address, self.replication_address).value()
