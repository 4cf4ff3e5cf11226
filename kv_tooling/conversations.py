"""A seeded generator of multi-turn chat traces in the Mooncake format.

Every conversation is one growing context: a system prompt (optional, one of a
few shared by many conversations), then user messages and model outputs in
turn. Turn k's prompt is turn k-1's prompt, then turn k-1's output, then the
new message. `hash_ids` follow the Mooncake rule (one id per 512 prompt tokens,
equal ids at equal positions mean an equal prefix), so turn k keeps the ids of
turn k-1's *full* blocks and takes new ids from there on:

    turn k-1 prompt:  | A | B | C |d·····|                      d: partial last block, id D
    turn k prompt:    | A | B | C |d·····out····|··msg········|··|
                                   ^ new id E: its 512 tokens are not D's

D never reappears: E's block holds turn k-1's tail, then its output, so its
tokens differ from D's. Every id past the shared full blocks is new: no
earlier request has it. The same rule joins a system prompt to the
first message: the system prompt's full blocks carry ids shared by every
conversation that opens with it, the block where it ends and the message
begins is the conversation's own. The format carries prompts only, so a turn's
output enters the next prompt under new ids: an engine that caches the blocks
it generates hits more on real traffic than on a replay of this trace, unless
the replay splices each turn's real tokens into the next prompt
(`kv-manager replay --splice-turns`, turn_splicing.py).

Time. Conversations arrive as a Poisson process (`conversations_per_s`). A
turn's successor arrives when the turn has completed and the user has thought:

    arrival(k) = arrival(k-1) + completion(k-1) + think(k)
    completion = ceil(1000 * (input_length / assumed_prefill_tokens_per_s
                              + output_length / assumed_decode_tokens_per_s)) ms

The generator runs no engine: `completion` is an *assumption* of the
generator (the whole prompt prefilled, the output decoded at a steady
per-request rate), not a measurement, and a replay that honours timestamps
will finish turns sooner or later than that. Think times are lognormal
(sigma 1) or exponential with mean `mean_think_time_s`. Conversations start
arriving `warmup_s` before time 0 and only arrivals from time 0 on are kept,
so the trace opens in a steady state, with conversations already under way
(their first turns in the trace find none of their own earlier context
cached);
`warmup_s = 0` starts from no conversation at all. The trace is the
`num_requests` earliest arrivals; the trace of N requests is the first N of
the trace of more with the same options and seed (ids are numbered in order
of first appearance, as in the Mooncake release).

Lengths. Turns per conversation are geometric with mean `mean_turns`, cut at
`max_turns`; a conversation also ends before a prompt past
`max_prompt_tokens`. Messages and outputs are lognormal with the given means
(sigma 1 for messages, 0.8 for outputs, 0.5 for the system prompts' lengths,
drawn once per seed). System prompt i is picked with weight 1/(i+1), by the
`system_prompt_share` of conversations that open with one.

Defaults, aimed at the workload the project is judged on (about 4,000
requests of multi-turn chat, prompts near 13k tokens on average, each turn's
ids extending the one before, ~3 requests and ~41k prompt tokens per second):

- 6 turns per conversation on average (at most 40) and 0.5 conversations/s:
  about 3 requests/s in the steady state (rate x mean turns);
- 8 system prompts of ~2,000 tokens opening 90% of conversations, a
  4,000-token first message (a pasted document or file), 1,200-token
  follow-ups and 350-token outputs: the prompt grows ~1,550 tokens a turn,
  from ~5.7k at turn 1 to ~13k at turn 6 and ~21k at turn 11, and averages
  ~13k tokens, ~40k prompt tokens/s (seed 0, 4,000 requests: 12.9k tokens,
  2.98 requests/s, 38.5k prompt tokens/s; seeds vary by some 10%);
- 45 s of thinking on average; a completion assumed at 10,000 prefill and 30
  decode tokens/s (~12 s for a 350-token answer);
- a 3,600 s warm-up, several times a typical conversation's ~6 minutes;
- prompts of at most 131,072 tokens, a 128k context.

    python -m kv_tooling.conversations --requests 4000 --seed 0 --output conv.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass, fields
from itertools import count
from pathlib import Path
from typing import Iterator, Sequence

from kv_tooling.workload import TRACE_BLOCK_SIZE, TraceRecord

THINK_TIME_DISTRIBUTIONS = ("lognormal", "exponential")
THINK_TIME_SIGMA = 1.0
MESSAGE_SIGMA = 1.0
OUTPUT_SIGMA = 0.8
SYSTEM_PROMPT_SIGMA = 0.5
# Fields whose flag is not `--` + the field name with dashes.
_FLAG_NAMES = {"num_requests": "--requests", "num_system_prompts": "--system-prompts"}


def flag_name(field_name: str) -> str:
    """The command-line flag of a `ConversationOptions` field."""
    return _FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


@dataclass(frozen=True)
class ConversationOptions:
    """What to generate; each field is the flag of the same name (see `flag_name`).

    Raises ValueError, naming the flag and its limit, on a value out of range.
    """

    num_requests: int = 4000
    seed: int = 0
    conversations_per_s: float = 0.5
    mean_turns: float = 6.0
    max_turns: int = 40
    mean_think_time_s: float = 45.0
    think_time_distribution: str = "lognormal"
    num_system_prompts: int = 8
    mean_system_prompt_tokens: int = 2000
    system_prompt_share: float = 0.9
    mean_first_message_tokens: int = 4000
    mean_message_tokens: int = 1200
    mean_output_tokens: int = 350
    max_prompt_tokens: int = 131072
    assumed_prefill_tokens_per_s: float = 10000.0
    assumed_decode_tokens_per_s: float = 30.0
    warmup_s: float = 3600.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{flag_name(field.name)} must be a finite number, got {value}")
        at_least = {
            "num_requests": 1,
            "mean_turns": 1,
            "max_turns": 1,
            "mean_think_time_s": 0,
            "num_system_prompts": 0,
            "mean_system_prompt_tokens": 1,
            "mean_first_message_tokens": 1,
            "mean_message_tokens": 1,
            "mean_output_tokens": 1,
            "max_prompt_tokens": 2 * TRACE_BLOCK_SIZE,
            "warmup_s": 0,
        }
        for name, limit in at_least.items():
            value = getattr(self, name)
            if value < limit:
                raise ValueError(f"{flag_name(name)} must be >= {limit}, got {value}")
        for name in ("conversations_per_s", "assumed_prefill_tokens_per_s", "assumed_decode_tokens_per_s"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{flag_name(name)} must be > 0, got {value}")
        if not 0 <= self.system_prompt_share <= 1:
            raise ValueError(f"--system-prompt-share must be in [0, 1], got {self.system_prompt_share}")
        if self.think_time_distribution not in THINK_TIME_DISTRIBUTIONS:
            raise ValueError(
                f"--think-time-distribution must be one of {', '.join(THINK_TIME_DISTRIBUTIONS)}, "
                f"got {self.think_time_distribution!r}"
            )


@dataclass(frozen=True)
class Conversation:
    """One conversation's turns in the trace, in order.

    `conversation_id` numbers conversations in arrival order, counting those
    that arrived during the warm-up; `first_turn_index` is 0 for one that
    began in the trace, k when its first k turns came before time 0.
    """

    conversation_id: int
    system_prompt_id: int | None
    system_prompt_tokens: int
    first_turn_index: int
    turns: tuple[TraceRecord, ...]


@dataclass(frozen=True)
class TraceSummary:
    """Rates are over the span from the first arrival to the last."""

    num_requests: int
    num_conversations: int
    mean_prompt_tokens: float
    requests_per_s: float
    prompt_tokens_per_s: float
    shared_block_fraction: float  # prompt blocks whose whole prefix an earlier request had


def assumed_completion_ms(record: TraceRecord, options: ConversationOptions) -> int:
    """The generator's assumed time from `record`'s arrival to its last output token; at least 1 ms."""
    seconds = (
        record.input_length / options.assumed_prefill_tokens_per_s
        + record.output_length / options.assumed_decode_tokens_per_s
    )
    return max(1, math.ceil(1000 * seconds))


def generate_conversations(options: ConversationOptions) -> list[TraceRecord]:
    """The trace: `options.num_requests` records sorted by timestamp (ties: by conversation)."""
    return trace_records(sample_conversations(options))


def trace_records(conversations: Sequence[Conversation]) -> list[TraceRecord]:
    """The turns of `conversations` sorted by timestamp, ties by conversation id."""
    keyed = [(turn.timestamp_ms, c.conversation_id, turn) for c in conversations for turn in c.turns]
    keyed.sort(key=lambda item: item[:2])
    return [turn for _, _, turn in keyed]


def sample_conversations(options: ConversationOptions) -> list[Conversation]:
    """The conversations of the trace, in arrival order, each with its turns in the trace.

    Deterministic in `options`. Conversations are drawn in arrival order
    until the next one arrives after the `num_requests`-th earliest kept
    arrival, which no later conversation can precede.
    """
    rng = random.Random(options.seed)
    system_prompt_tokens = [
        min(_lognormal_int(rng, options.mean_system_prompt_tokens, SYSTEM_PROMPT_SIGMA), options.max_prompt_tokens // 2)
        for _ in range(options.num_system_prompts)
    ]
    new_ids = count()
    system_prompt_ids = [[next(new_ids) for _ in range(n // TRACE_BLOCK_SIZE)] for n in system_prompt_tokens]
    system_prompt_weights = [1 / (i + 1) for i in range(options.num_system_prompts)]

    earliest: list[int] = []  # the num_requests earliest kept arrivals, negated: a max-heap
    candidates: list[tuple[int, int, int, TraceRecord]] = []  # (timestamp, conversation, turn index, record)
    openings: dict[int, int | None] = {}
    arrival_s = -options.warmup_s
    for conversation_id in count():
        arrival_s += rng.expovariate(options.conversations_per_s)
        start_ms = round(arrival_s * 1000)
        if len(earliest) == options.num_requests and start_ms > -earliest[0]:
            break
        conversation_rng = random.Random(rng.getrandbits(64))
        system_prompt_id = None
        if options.num_system_prompts and conversation_rng.random() < options.system_prompt_share:
            system_prompt_id = conversation_rng.choices(range(options.num_system_prompts), system_prompt_weights)[0]
        openings[conversation_id] = system_prompt_id
        if system_prompt_id is None:
            turns = _turns(conversation_rng, start_ms, 0, [], new_ids, options)
        else:
            turns = _turns(
                conversation_rng, start_ms, system_prompt_tokens[system_prompt_id],
                system_prompt_ids[system_prompt_id], new_ids, options,
            )  # fmt: skip
        for turn_index, turn in enumerate(turns):
            if turn.timestamp_ms < 0:
                continue
            candidates.append((turn.timestamp_ms, conversation_id, turn_index, turn))
            if len(earliest) < options.num_requests:
                heapq.heappush(earliest, -turn.timestamp_ms)
            elif turn.timestamp_ms < -earliest[0]:
                heapq.heapreplace(earliest, -turn.timestamp_ms)
    candidates.sort(key=lambda item: item[:2])
    del candidates[options.num_requests :]

    remap: dict[int, int] = {}
    by_conversation: dict[int, list[tuple[int, TraceRecord]]] = {}
    for _, conversation_id, turn_index, turn in candidates:
        hash_ids = tuple(remap.setdefault(h, len(remap)) for h in turn.hash_ids)
        record = TraceRecord(turn.timestamp_ms, turn.input_length, turn.output_length, hash_ids)
        by_conversation.setdefault(conversation_id, []).append((turn_index, record))
    conversations = []
    for conversation_id in sorted(by_conversation):
        turns_in_trace = by_conversation[conversation_id]
        system_prompt_id = openings[conversation_id]
        conversations.append(
            Conversation(
                conversation_id,
                system_prompt_id,
                0 if system_prompt_id is None else system_prompt_tokens[system_prompt_id],
                turns_in_trace[0][0],
                tuple(record for _, record in turns_in_trace),
            )
        )
    return conversations


def _turns(
    rng: random.Random,
    start_ms: int,
    context_tokens: int,
    context_ids: list[int],
    new_ids: Iterator[int],
    options: ConversationOptions,
) -> list[TraceRecord]:
    """One conversation's turns after a context of `context_tokens` that shares the blocks `context_ids`.

    Takes new ids from `new_ids`. Each turn's ids are the shared ids, then new
    ones. The next context is the prompt and the output, and it shares the
    prompt's full blocks only: the prompt's partial tail and the output go
    into new blocks of the next prompt.
    """
    num_turns = min(_geometric(rng, options.mean_turns), options.max_turns)
    message_tokens = min(
        _lognormal_int(rng, options.mean_first_message_tokens, MESSAGE_SIGMA),
        options.max_prompt_tokens - context_tokens,
    )
    arrival_ms = start_ms
    turns: list[TraceRecord] = []
    for _ in range(num_turns):
        if turns:
            message_tokens = _lognormal_int(rng, options.mean_message_tokens, MESSAGE_SIGMA)
            if context_tokens + message_tokens > options.max_prompt_tokens:
                break
            arrival_ms += assumed_completion_ms(turns[-1], options) + _think_time_ms(rng, options)
        input_length = context_tokens + message_tokens
        assert len(context_ids) <= context_tokens // TRACE_BLOCK_SIZE
        num_new_blocks = -(-input_length // TRACE_BLOCK_SIZE) - len(context_ids)
        hash_ids = (*context_ids, *(next(new_ids) for _ in range(num_new_blocks)))
        output_tokens = _lognormal_int(rng, options.mean_output_tokens, OUTPUT_SIGMA)
        turns.append(TraceRecord(arrival_ms, input_length, output_tokens, hash_ids))
        context_tokens = input_length + output_tokens
        context_ids = list(hash_ids[: input_length // TRACE_BLOCK_SIZE])
    return turns


def _lognormal_int(rng: random.Random, mean: float, sigma: float) -> int:
    """A lognormal draw of mean `mean`, rounded, at least 1."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def _geometric(rng: random.Random, mean: float) -> int:
    """A geometric draw on 1, 2, ... of mean `mean` (>= 1)."""
    if mean == 1:
        return 1
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1 - 1 / mean))


def _think_time_ms(rng: random.Random, options: ConversationOptions) -> int:
    mean = options.mean_think_time_s
    if mean == 0:
        return 0
    if options.think_time_distribution == "exponential":
        seconds = rng.expovariate(1 / mean)
    else:
        seconds = rng.lognormvariate(math.log(mean) - THINK_TIME_SIGMA**2 / 2, THINK_TIME_SIGMA)
    return round(seconds * 1000)


def write_trace(records: Sequence[TraceRecord], path: str | Path) -> None:
    """Writes `records` as Mooncake JSON lines, in order; `load_trace` reads them back equal."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            line = {"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": r.output_length}
            f.write(json.dumps({**line, "hash_ids": list(r.hash_ids)}) + "\n")


def summarize(records: Sequence[TraceRecord], num_conversations: int) -> TraceSummary:
    """The trace's rates and its ideal prefix sharing (an unbounded cache, requests in list order)."""
    assert records, "summarize needs a request"
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000
    num_prompt_tokens = sum(r.input_length for r in records)
    children: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node: a trie of the prompts seen
    num_shared = num_blocks = 0
    for record in records:
        node, matching = 0, True
        for hash_id in record.hash_ids:
            child = children.get((node, hash_id))
            if child is None:
                matching = False
                child = children[(node, hash_id)] = len(children) + 1
            num_shared += matching
            node = child
        num_blocks += len(record.hash_ids)
    return TraceSummary(
        num_requests=len(records),
        num_conversations=num_conversations,
        mean_prompt_tokens=num_prompt_tokens / len(records),
        requests_per_s=len(records) / span_s if span_s else math.inf,
        prompt_tokens_per_s=num_prompt_tokens / span_s if span_s else math.inf,
        shared_block_fraction=num_shared / num_blocks,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The generator's flags, one per `ConversationOptions` field, and `--output`."""
    d = ConversationOptions()
    helps = {
        "num_requests": "requests in the trace: the earliest arrivals from time 0 (default %(default)s)",
        "seed": "seed of every draw; the same options and seed give the same trace (default %(default)s)",
        "conversations_per_s": "conversations arriving per second, a Poisson process; requests/s is about this "
        "times the mean turns (default %(default)s)",
        "mean_turns": "mean turns per conversation, geometric (default %(default)s)",
        "max_turns": "most turns in a conversation (default %(default)s)",
        "mean_think_time_s": "mean seconds from a turn's assumed completion to the next turn's arrival; 0 for "
        "none (default %(default)s)",
        "think_time_distribution": "distribution of think times; lognormal has sigma 1 (default %(default)s)",
        "num_system_prompts": "distinct system prompts, picked with weight 1/rank; 0 for none (default %(default)s)",
        "mean_system_prompt_tokens": "mean length of a system prompt, drawn once per seed (default %(default)s)",
        "system_prompt_share": "fraction of conversations that open with a system prompt (default %(default)s)",
        "mean_first_message_tokens": "mean tokens of a conversation's first user message (default %(default)s)",
        "mean_message_tokens": "mean tokens of a later user message (default %(default)s)",
        "mean_output_tokens": "mean output tokens of a turn (default %(default)s)",
        "max_prompt_tokens": "a conversation ends before a prompt longer than this (default %(default)s)",
        "assumed_prefill_tokens_per_s": "ASSUMED prefill speed that places the next turn: a turn completes "
        "input/this + output/--assumed-decode-tokens-per-s seconds after it arrives (default %(default)s)",
        "assumed_decode_tokens_per_s": "ASSUMED decode speed of one request, tokens/s (default %(default)s)",
        "warmup_s": "conversations start arriving this long before time 0, so the trace opens in a steady "
        "state; 0 starts with no conversation under way (default %(default)s)",
    }
    parser.add_argument("--output", type=Path, required=True, metavar="PATH", help="the JSON-lines trace to write")
    for field in fields(ConversationOptions):
        default = getattr(d, field.name)
        if field.name == "think_time_distribution":
            extra: dict[str, object] = {"choices": THINK_TIME_DISTRIBUTIONS}
        elif field.name.endswith("_per_s"):
            extra = {"metavar": "RATE"}
        else:
            extra = {"metavar": "S" if field.name.endswith("_s") else "N" if isinstance(default, int) else "X"}
        parser.add_argument(
            flag_name(field.name), dest=field.name, type=type(default), default=default, help=helps[field.name], **extra
        )


def options_from_args(args: argparse.Namespace) -> ConversationOptions:
    return ConversationOptions(**{field.name: getattr(args, field.name) for field in fields(ConversationOptions)})


def run(args: argparse.Namespace) -> int:
    """Generates the trace the flags ask for, writes it to `--output` and prints a one-line summary.

    Raises ValueError, naming the flag, on a bad value or an output folder that does not exist.
    """
    options = options_from_args(args)
    if not args.output.parent.is_dir():
        raise ValueError(f"--output {args.output}: folder {args.output.parent} does not exist")
    conversations = sample_conversations(options)
    records = trace_records(conversations)
    write_trace(records, args.output)
    s = summarize(records, len(conversations))
    print(
        f"{s.num_requests} requests in {s.num_conversations} conversations, mean prompt "
        f"{s.mean_prompt_tokens:,.0f} tokens, {s.requests_per_s:.2f} requests/s, "
        f"{s.prompt_tokens_per_s:,.0f} prompt tokens/s, {s.shared_block_fraction:.1%} of prompt blocks "
        f"shared with an earlier request -> {args.output}"
    )
    return 0


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _OneLineErrorParser(
        prog="python -m kv_tooling.conversations",
        description="Writes a seeded multi-turn chat trace in the Mooncake format. Conversations arrive as a "
        "Poisson process; each turn's prompt is the turn before's prompt and output and a new message, sharing "
        "the earlier prompt's full 512-token blocks; the next turn arrives a think time after the turn's "
        "completion, which is ASSUMED from the --assumed-* speeds (no engine runs).",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        parser.error(str(e))
    return 2


if __name__ == "__main__":
    sys.exit(main())
