"""Many Redis commands in one round trip per node: RESP packed in bulk, replies parsed with hiredis.

redis-py spends about 9 us of Python per pipelined command (building a
command object, packing it, parsing its reply through its own layers), all
under the GIL of the server whose thread runs it. Here the caller packs its
commands as RESP bytes (`CommandTemplate` makes that one formatting per
command), they go out as one `sendall` per node, and the replies come back
through one `hiredis.Reader` per node: about 1 us of Python per command.

`execute` takes a `redis.Redis` or a `redis.RedisCluster` and uses their
connection pools (so their authentication, TLS, database and timeouts). On
a cluster it groups the commands by the node that owns each key's slot,
writes to every node, then reads every node's replies: one parallel round
trip. A MOVED reply updates the client's slot map and the redirected
commands are sent again, once; an ASK reply is followed to the importing
node with ASKING. A connection error refreshes the slot map (so that the
next call finds a promoted replica) and raises.

Invariants the callers keep: every command names exactly one key, its
first argument, passed alongside; and every command is safe to send twice
(a redirection resends it), as the mirror's HSET / HDEL of one field and
its reads are.
"""

from __future__ import annotations

import socket
from binascii import crc_hqx
from dataclasses import dataclass, field
from typing import Sequence

import hiredis
import redis
from redis.cluster import ClusterNode, NodesManager, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import RedisClusterException

ASKING = b"*1\r\n$6\r\nASKING\r\n"
READ_CHUNK_BYTES = 1 << 16


def pack_command(*args: bytes | str) -> bytes:
    """One command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


@dataclass(frozen=True)
class CommandTemplate:
    """`name key *trailing` in RESP for any key, with everything but the key packed once.

    E.g. CommandTemplate(b"HSET", (field, value)).pack(key).
    """

    name: bytes
    trailing: tuple[bytes, ...] = ()
    head: bytes = field(init=False, repr=False)  # RESP of the array header and `name`
    tail: bytes = field(init=False, repr=False)  # RESP of `trailing`

    def __post_init__(self) -> None:
        head = b"*%d\r\n$%d\r\n%b\r\n" % (2 + len(self.trailing), len(self.name), self.name)
        tail = b"".join(b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in self.trailing)
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "tail", tail)

    def pack(self, key: bytes | str) -> bytes:
        data = key.encode() if isinstance(key, str) else key
        return b"%b$%d\r\n%b\r\n%b" % (self.head, len(data), data, self.tail)

    def pack_each(self, keys: Sequence[bytes]) -> list[bytes]:
        """`pack` of every key. Keys of one length (one group's block keys) cost two concatenations each:
        everything but the key is formatted once, which is half the cost of a format per key."""
        lengths = set(map(len, keys))
        if len(lengths) != 1:
            return [self.pack(key) for key in keys]
        before_key, after_key = self.head + b"$%d\r\n" % lengths.pop(), b"\r\n" + self.tail
        return [before_key + key + after_key for key in keys]


class HashWrites:
    """HSET and HDEL of single fields over many keys, sent by `execute` in one round trip per node.

    The calls of a redis-py pipeline (transaction=False) that the mirror's
    writer makes, at a fraction of their cost: each command is packed at
    once, from a template per (command, field, value). `hset_each` and
    `hdel_each` pack a whole run of keys that share the field and value:
    the writer's batches are thousands of such keys, packed with one
    template look-up and one comprehension.

    With `page_commands`, every time that many commands are pending they
    are sent (a round trip), so that a write of millions of keys holds one
    page of commands at a time; `execute` sends the rest.
    """

    def __init__(self, client: redis.Redis | RedisCluster, page_commands: int | None = None) -> None:
        self.client = client
        self.page_commands = page_commands
        self._keys: list[bytes] = []
        self._commands: list[bytes] = []
        self._templates: dict[tuple[str, ...], CommandTemplate] = {}

    def hset(self, key: bytes | str, field: str, value: str) -> None:
        self.hset_each([key.encode() if isinstance(key, str) else key], field, value)

    def hdel(self, key: bytes | str, field: str) -> None:
        self.hdel_each([key.encode() if isinstance(key, str) else key], field)

    def hset_each(self, keys: Sequence[bytes], field: str, value: str) -> None:
        """HSET `field` to `value` in every key of `keys`."""
        self._add(self._template("HSET", field, value), keys)

    def hdel_each(self, keys: Sequence[bytes], field: str) -> None:
        """HDEL `field` from every key of `keys`."""
        self._add(self._template("HDEL", field), keys)

    def _add(self, template: CommandTemplate, keys: Sequence[bytes]) -> None:
        self._keys.extend(keys)
        self._commands.extend(template.pack_each(keys))
        if self.page_commands is not None and len(self._commands) >= self.page_commands:
            self.execute()

    def _template(self, name: str, *trailing: str) -> CommandTemplate:
        template = self._templates.get((name, *trailing))
        if template is None:
            template = CommandTemplate(name.encode(), tuple(arg.encode() for arg in trailing))
            self._templates[(name, *trailing)] = template
        return template

    def __len__(self) -> int:
        return len(self._commands)

    def execute(self) -> list:
        """Send every command pending; their replies in order. Raises like `execute`."""
        keys, commands = self._keys, self._commands
        self._keys, self._commands = [], []
        return execute(self.client, keys, commands)


def execute(client: redis.Redis | RedisCluster, keys: Sequence[bytes | str], commands: Sequence[bytes]) -> list:
    """The replies of `commands` (RESP, `keys[i]` the key of `commands[i]`), in order.

    Raises a redis.RedisError when a node cannot be read within its
    socket timeout (ConnectionError / TimeoutError) or a command fails
    (ResponseError, the first in order); the callers' connections are
    left clean either way.
    """
    assert len(keys) == len(commands), f"{len(keys)} keys for {len(commands)} commands"
    if not commands:
        return []
    # A cluster client, or a stand-in that resolves to one on first use (mirror.connect.DeferredRedis).
    nodes_manager = getattr(client, "nodes_manager", None)
    if nodes_manager is not None:
        try:
            replies = _execute_on_cluster(nodes_manager, keys, commands)
        except RedisClusterException as error:  # no node reachable, a slot no node serves: not a RedisError
            raise redis.ConnectionError(f"Redis Cluster: {error}") from error
    else:
        replies = _round_trip([_Batch(client.connection_pool, list(commands))])[0]
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
    return replies


@dataclass
class _Batch:
    """Commands for one node, sent as one buffer."""

    pool: redis.ConnectionPool
    commands: list[bytes]


def _round_trip(batches: Sequence[_Batch]) -> list[list]:
    """Send every batch, each on a connection of its node, then read each batch's replies.

    Writing to every node before reading any makes the nodes work in
    parallel. A connection whose replies were not all read is closed, not
    returned to its pool half-read. Error replies come back as
    redis.ResponseError values, not raised.
    """
    connections = []
    done: list[bool] = []
    try:
        for batch in batches:
            connection = batch.pool.get_connection()
            connections.append(connection)
            done.append(False)
            connection.send_packed_command([b"".join(batch.commands)], check_health=False)
        results = []
        for index, (batch, connection) in enumerate(zip(batches, connections)):
            results.append(_read_replies(connection, len(batch.commands)))
            done[index] = True
        return results
    finally:
        for batch, connection, clean in zip(batches, connections, done):
            if not clean:
                connection.disconnect()
            batch.pool.release(connection)


def _read_replies(connection: redis.Connection, count: int) -> list:
    """`count` replies from the connection's socket, parsed by a fresh hiredis.Reader.

    redis-py has no public raw read; its connection's socket is used here
    between two of its own calls, with nothing of ours left in its parser.
    """
    sock = connection._sock
    if sock is None:
        raise redis.ConnectionError(f"connection to {connection.host}:{connection.port} closed while reading")
    reader = hiredis.Reader(replyError=redis.ResponseError)
    buffer = bytearray(READ_CHUNK_BYTES)
    replies: list = []
    append, gets = replies.append, reader.gets
    try:
        while len(replies) < count:
            reply = gets()
            if reply is False:
                num_bytes = sock.recv_into(buffer)
                if num_bytes == 0:
                    raise redis.ConnectionError(
                        f"{connection.host}:{connection.port} closed the connection with "
                        f"{count - len(replies)} of {count} replies unread"
                    )
                reader.feed(buffer, 0, num_bytes)
            elif not isinstance(reply, hiredis.PushNotification):  # RESP3 out-of-band messages are not replies
                append(reply)
    except socket.timeout:
        raise redis.TimeoutError(
            f"timeout reading {count} replies from {connection.host}:{connection.port} "
            f"({len(replies)} read)"
        ) from None
    except OSError as error:
        raise redis.ConnectionError(
            f"error reading from {connection.host}:{connection.port}: {error}"
        ) from error
    except hiredis.ProtocolError as error:
        raise redis.ConnectionError(f"protocol error from {connection.host}:{connection.port}: {error}") from error
    return replies


def _execute_on_cluster(nodes_manager: NodesManager, keys: Sequence[bytes | str], commands: Sequence[bytes]) -> list:
    """`execute` on a cluster: one parallel round trip; redirected commands once more."""
    replies: list = [None] * len(commands)
    pending = range(len(commands))
    for _ in range(2):
        moved = _send_by_slot(nodes_manager, keys, commands, pending, replies)
        if not moved:
            return replies
        pending = moved
    raise redis.exceptions.ClusterError(
        f"{len(pending)} of {len(commands)} commands were still redirected (MOVED) after the slot map was updated"
    )


def _send_by_slot(nodes_manager: NodesManager, keys: Sequence[bytes | str], commands: Sequence[bytes],
                  indexes: Sequence[int], replies: list) -> list[int]:
    """Send commands `indexes` to their slots' masters and store their replies; returns the MOVED ones.

    ASK replies are followed at once (ASKING, then the command, on the node
    that imports the slot).
    """
    # The slot map itself, not get_node_from_slot: that call costs ~10 us (argument checks) per key.
    slots = nodes_manager.slots_cache
    groups: dict[str, tuple[redis.ConnectionPool, list[int]]] = {}
    members_of_slot: dict[int, list[int]] = {}
    for index in indexes:
        key = keys[index]
        data = key.encode() if key.__class__ is str else key
        slot = key_slot(data) if b"{" in data else crc_hqx(data, 0) % REDIS_CLUSTER_HASH_SLOTS
        members = members_of_slot.get(slot)
        if members is None:
            nodes = slots.get(slot)
            node = nodes[0] if nodes else nodes_manager.get_node_from_slot(slot)  # raises: no node serves it
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (_pool_of(nodes_manager, node), [])
            members = members_of_slot[slot] = group[1]
        members.append(index)
    results = _cluster_round_trip(
        nodes_manager, [_Batch(pool, [commands[i] for i in members]) for pool, members in groups.values()]
    )
    moved: list[int] = []
    asked: dict[tuple[str, int], list[int]] = {}
    for (_, members), node_replies in zip(groups.values(), results):
        for index, reply in zip(members, node_replies):
            if isinstance(reply, redis.ResponseError):
                text = str(reply)
                if text.startswith("MOVED "):
                    nodes_manager.move_slot(redis.exceptions.MovedError(text[len("MOVED "):]))
                    moved.append(index)
                    continue
                if text.startswith("ASK "):
                    ask = redis.exceptions.AskError(text[len("ASK "):])
                    asked.setdefault((ask.host, ask.port), []).append(index)
                    continue
            replies[index] = reply
    if asked:
        _follow_ask(nodes_manager, commands, asked, replies)
    return moved


def _follow_ask(nodes_manager: NodesManager, commands: Sequence[bytes], asked: dict[tuple[str, int], list[int]],
                replies: list) -> None:
    """Send each ASK-redirected command to its importing node, after ASKING; store the second reply."""
    batches, members_of = [], []
    for (host, port), members in asked.items():
        node = nodes_manager.get_node(host, port)
        if node is None:
            raise redis.exceptions.ClusterError(f"ASK redirected {len(members)} commands to {host}:{port}, "
                                                "a node not in the slot map")  # fmt: skip
        pairs = [part for i in members for part in (ASKING, commands[i])]
        batches.append(_Batch(_pool_of(nodes_manager, node), pairs))
        members_of.append(members)
    for members, node_replies in zip(members_of, _cluster_round_trip(nodes_manager, batches)):
        for position, index in enumerate(members):
            replies[index] = node_replies[2 * position + 1]


def _pool_of(nodes_manager: NodesManager, node: ClusterNode) -> redis.ConnectionPool:
    """The connection pool of a node; a node that the slot map learned from a MOVED reply has none yet."""
    if node.redis_connection is None:
        nodes_manager.create_redis_connections([node])
    return node.redis_connection.connection_pool


def _cluster_round_trip(nodes_manager: NodesManager, batches: Sequence[_Batch]) -> list[list]:
    """`_round_trip`, refreshing the slot map when a node cannot be reached (it may have failed over)."""
    try:
        return _round_trip(batches)
    except (redis.ConnectionError, redis.TimeoutError):
        try:
            nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException):
            pass  # no node answers now: the next call refreshes again
        raise
