"""The Redis commands the shared prefix index needs, counted as the routing simulation runs.

Writes, per replica (`mirror/writer.py`): one HSET when a block hash becomes
cached on it (its count of cached blocks goes 0 -> 1 within a step) and one
HDEL when it stops being cached (1 -> 0); a hash stored and dropped within
one write batch costs nothing. Heartbeats: `HEARTBEAT_COMMANDS` per replica
every TTL/3. Lookups, one per routed request, in one of three designs; each
reads SMEMBERS of the replica set and one GET per replica's lease, then one
command (HGETALL or HMGET) per block entry it reads:

- `per-block`, the pipelined lookup: every full block of the prompt,
  whatever the replicas hold;
- `chunked`, the lookup that reads entries in growing chunks (the first
  `CHUNKED_FIRST_BLOCKS`, each later one ending `CHUNKED_GROWTH` times as
  far) and stops after the chunk in which the last replica stopped
  matching;
- `early-stop`, the floor of any design that keeps one entry per block:
  entries up to the longest prefix some replica holds, plus the one block
  that shows where it ends.

Counts are real-valued: the simulation runs a scaled trace (a 512-token
trace block becomes 512 x scale tokens), so it records each of its blocks as
1 / scale real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEARTBEAT_COMMANDS = 2  # EVALSHA of CLAIM_LEASE, then SADD to the replica set (MirrorWriter._renew)
LOOKUP_DESIGNS = ("per-block", "chunked", "early-stop")
CHUNKED_FIRST_BLOCKS = 64
CHUNKED_GROWTH = 8  # chunks end at 64, 512, 4096 blocks


def lookup_commands(design: str, num_prompt_blocks: float, num_replicas: int, longest_prefix_blocks: float) -> float:
    """Commands of one lookup: SMEMBERS + one lease GET per replica + the HGETALLs the design reads."""
    if design == "per-block":
        num_entries = num_prompt_blocks
    elif design == "chunked":
        num_entries = min(num_prompt_blocks, CHUNKED_FIRST_BLOCKS)
        while num_entries < num_prompt_blocks and longest_prefix_blocks >= num_entries:
            num_entries = min(num_prompt_blocks, num_entries * CHUNKED_GROWTH)
    elif design == "early-stop":
        num_entries = min(num_prompt_blocks, longest_prefix_blocks + 1)
    else:
        raise ValueError(f"lookup design {design!r} is not supported; choose one of {', '.join(LOOKUP_DESIGNS)}")
    return 1 + num_replicas + num_entries


KINDS = ("hset", "hdel", "heartbeat", *(f"lookup {design}" for design in LOOKUP_DESIGNS))
WRITES = ("hset", "hdel")


def served(design: str) -> tuple[str, ...]:
    """The kinds of command the index serves with lookups of `design`: writes, heartbeats, lookups."""
    return (*WRITES, "heartbeat", f"lookup {design}")


@dataclass
class RedisOps:
    """Redis commands of one simulated run, per kind and per tick.

    Rates are over the arrival span (`span_ticks`: from the first tick to
    the one of the last arrival, set by the simulation), so the drain after
    the last arrival does not dilute them; totals count every tick.
    """

    tick_s: float
    window_ticks: int
    span_ticks: int = 0
    num_lookups: int = 0
    per_tick: dict[str, dict[int, float]] = field(default_factory=lambda: {kind: {} for kind in KINDS})

    def add_writes(self, tick: int, num_hset: float, num_hdel: float) -> None:
        self._add("hset", tick, num_hset)
        self._add("hdel", tick, num_hdel)

    def add_heartbeats(self, tick: int, num_replicas: int) -> None:
        self._add("heartbeat", tick, HEARTBEAT_COMMANDS * num_replicas)

    def add_lookup(self, tick: int, num_prompt_blocks: float, num_replicas: int, longest_prefix_blocks: float) -> None:
        self.num_lookups += 1
        for design in LOOKUP_DESIGNS:
            commands = lookup_commands(design, num_prompt_blocks, num_replicas, longest_prefix_blocks)
            self._add(f"lookup {design}", tick, commands)

    def _add(self, kind: str, tick: int, commands: float) -> None:
        if commands:
            ticks = self.per_tick[kind]
            ticks[tick] = ticks.get(tick, 0.0) + commands

    def total(self, *kinds: str) -> float:
        """Commands of `kinds` over the whole run."""
        return sum(sum(self.per_tick[kind].values()) for kind in kinds)

    @property
    def span_s(self) -> float:
        return self.span_ticks * self.tick_s

    def rate(self, *kinds: str) -> float:
        """Commands of `kinds` per second over the arrival span."""
        if not self.span_ticks:
            return 0.0
        span = self.span_ticks
        return sum(c for kind in kinds for t, c in self.per_tick[kind].items() if t < span) / self.span_s

    def peak_rate(self, *kinds: str) -> float:
        """Commands of `kinds` per second in the busiest window of `window_ticks` ticks (of the whole run)."""
        windows: dict[int, float] = {}
        for kind in kinds:
            for tick, commands in self.per_tick[kind].items():
                windows[tick // self.window_ticks] = windows.get(tick // self.window_ticks, 0.0) + commands
        return max(windows.values(), default=0.0) / (self.window_ticks * self.tick_s)

