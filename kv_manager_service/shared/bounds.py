"""A limit on every string and every list of every `kvcache.v1` request: what one call may make the server hold.

Ids end up in the step log, the journal, the idempotency store and the pool's
tables, so their size is memory the server keeps; the gRPC message limit
alone lets one 64 MiB id through. `LIMITS` gives every string field (in
characters) and every repeated field (in entries) of every message reachable
from a `kvcache.v1` request its bound, keyed by the field's full name. A
bound is either a number, checked here, or the name of a per-server setting
that the handler checks (`Configured`), such as `max_tokens_per_call`.

`violation(request)` walks the request by its descriptor and returns an
InvalidArgumentError for the first field past its limit, naming the field's
path (`ops[3].allocate.request_id`), its size and the limit, never its value;
None when every field is within its limit. Messages outside `kvcache.v1`
(health checks) are not walked. A field of a `kvcache.v1` message without an
entry in `LIMITS` is a bug: the walk asserts, and a test walks every request
of both services.
"""

from __future__ import annotations

from typing import NamedTuple

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from kv_manager_service.shared.errors import InvalidArgumentError

PACKAGE = "kvcache.v1"

MAX_ID_CHARS = 256  # a request id or an idempotency key; a UUID has 36
MAX_WORKER_ID_CHARS = 512  # a host name (at most 253) and a suffix
MAX_NAME_CHARS = 512  # a cache salt, a LoRA name, a multimodal item's identifier
MAX_PATH_CHARS = 1024  # a LoRA path
MAX_IDS_PER_LIST = 1 << 16  # request ids in one list, requests in one Execute
MAX_MM_FEATURES = 4096  # multimodal items of one prompt
MAX_BLOCK_IDS_PER_LIST = 1 << 22  # block ids in one report: more than any pool a worker holds today


class Configured(NamedTuple):
    """A bound that is a per-server setting, checked by the handler (named as in docs/limits.md)."""

    setting: str


class Bound(NamedTuple):
    """What one field may hold: `max_chars` per string, `max_entries` per list (None: not a string / not a list)."""

    max_chars: int | None = None
    max_entries: int | Configured | None = None


_ID = Bound(max_chars=MAX_ID_CHARS)
_IDS = Bound(max_chars=MAX_ID_CHARS, max_entries=MAX_IDS_PER_LIST)
_NAME = Bound(max_chars=MAX_NAME_CHARS)
_PATH = Bound(max_chars=MAX_PATH_CHARS)
_TOKENS = Bound(max_entries=Configured("max_tokens_per_call"))
_MM_FEATURES = Bound(max_entries=MAX_MM_FEATURES)
_WORKER_ID = Bound(max_chars=MAX_WORKER_ID_CHARS)

LIMITS: dict[str, Bound] = {
    # KVManagerService
    "kvcache.v1.AllocateRequest.request_id": _ID,
    "kvcache.v1.AllocateRequest.token_ids": _TOKENS,
    "kvcache.v1.AllocateRequest.cache_salt": _NAME,
    "kvcache.v1.AllocateRequest.lora_name": _NAME,
    "kvcache.v1.AllocateRequest.lora_path": _PATH,
    "kvcache.v1.AllocateRequest.mm_features": _MM_FEATURES,
    "kvcache.v1.MMFeature.identifier": _NAME,
    "kvcache.v1.FreeRequest.request_ids": _IDS,
    "kvcache.v1.FreeRequest.num_computed_tokens": Bound(max_entries=MAX_IDS_PER_LIST),
    "kvcache.v1.ForkRequest.parent_request_id": _ID,
    "kvcache.v1.ForkRequest.child_request_ids": _IDS,
    "kvcache.v1.ExpectRequest.request_id": _ID,
    "kvcache.v1.ExpectRequest.token_ids": _TOKENS,
    "kvcache.v1.ExpectRequest.cache_salt": _NAME,
    "kvcache.v1.ExpectRequest.lora_name": _NAME,
    "kvcache.v1.ExpectRequest.lora_path": _PATH,
    "kvcache.v1.ExpectRequest.mm_features": _MM_FEATURES,
    "kvcache.v1.FindCacheHitRequest.token_ids": _TOKENS,
    "kvcache.v1.FindCacheHitRequest.cache_salt": _NAME,
    "kvcache.v1.FindCacheHitRequest.lora_name": _NAME,
    "kvcache.v1.FindCacheHitRequest.lora_path": _PATH,
    "kvcache.v1.FindCacheHitRequest.mm_features": _MM_FEATURES,
    "kvcache.v1.StepRequest.ops": Bound(max_entries=Configured("max_ops_per_step")),
    "kvcache.v1.StepRequest.idempotency_key": _ID,
    # A decode entry is an op of the step: both columns count towards max_ops_per_step.
    "kvcache.v1.DecodeBatch.request_ids": Bound(max_chars=MAX_ID_CHARS, max_entries=Configured("max_ops_per_step")),
    "kvcache.v1.DecodeBatch.token_ids": Bound(max_entries=Configured("max_ops_per_step")),
    "kvcache.v1.GetBlockTablesRequest.request_ids": _IDS,
    "kvcache.v1.WatchStepsRequest.worker_id": _WORKER_ID,
    "kvcache.v1.AckStepsRequest.worker_id": _WORKER_ID,
    "kvcache.v1.UnregisterWorkerRequest.worker_id": _WORKER_ID,
    "kvcache.v1.ReportMissingKVRequest.worker_id": _WORKER_ID,
    "kvcache.v1.ReportMissingKVRequest.device_block_ids": Bound(max_entries=MAX_BLOCK_IDS_PER_LIST),
    "kvcache.v1.ReportMissingKVRequest.host_block_ids": Bound(max_entries=MAX_BLOCK_IDS_PER_LIST),
    "kvcache.v1.ReportMissingKVRequest.request_ids": _IDS,
    # WorkerService
    "kvcache.v1.ExecuteRequest.requests": Bound(max_entries=MAX_IDS_PER_LIST),
    "kvcache.v1.ScheduledRequest.request_id": _ID,
    # The worker refuses tokens past the request's block table, which max_model_len bounds.
    "kvcache.v1.ScheduledRequest.token_ids": Bound(max_entries=Configured("max_model_len")),
}


class _Check(NamedTuple):
    """One field of a message that needs a look: a string, a list, or a message that holds either."""

    name: str
    max_chars: int | None  # of the string, or of each string of the list
    max_entries: int | None  # None: no count checked here
    repeated: bool
    fields: tuple[_Check, ...] | None  # a message field's own checks (walked), else None


_PLANS: dict[Descriptor, tuple[_Check, ...]] = {}


def violation(request: Message) -> InvalidArgumentError | None:
    """The error for the first field of `request` past its limit, or None (messages outside kvcache.v1: None)."""
    descriptor = request.DESCRIPTOR
    if descriptor.file.package != PACKAGE:
        return None
    found = _first_violation(request, plan(descriptor))
    if found is None:
        return None
    path, size, unit, limit = found
    return InvalidArgumentError(f"{path} has {size} {unit}; the limit is {limit}", path)


def plan(descriptor: Descriptor) -> tuple[_Check, ...]:
    """The fields of `descriptor` to check, in field order (built once per message type).

    Asserts that every string and every repeated field has an entry in LIMITS.
    """
    cached = _PLANS.get(descriptor)
    if cached is not None:
        return cached
    checks = []
    for field in descriptor.fields:
        repeated = field.is_repeated
        is_string = field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
        fields = plan(field.message_type) if field.type == FieldDescriptor.TYPE_MESSAGE else None
        if not (repeated or is_string or fields):
            continue
        bound = LIMITS.get(field.full_name)
        assert bound is not None or not (repeated or is_string), f"{field.full_name} has no limit in bounds.LIMITS"
        bound = bound or Bound()
        assert (bound.max_chars is not None) == is_string, f"{field.full_name}: max_chars is for strings only"
        assert (bound.max_entries is not None) == repeated, f"{field.full_name}: max_entries is for lists only"
        max_entries = bound.max_entries if type(bound.max_entries) is int else None
        if is_string or fields or max_entries is not None:
            checks.append(_Check(field.name, bound.max_chars, max_entries, repeated, fields or None))
    _PLANS[descriptor] = result = tuple(checks)
    return result


def _first_violation(message: Message, checks: tuple[_Check, ...]) -> tuple[str, int, str, int] | None:
    """(path, size, unit, limit) of the first field past its limit; the path is built only on failure."""
    for name, max_chars, max_entries, repeated, fields in checks:
        if repeated:
            values = getattr(message, name)
            if max_entries is not None and len(values) > max_entries:
                return name, len(values), "entries", max_entries
            if max_chars is not None:
                if values and max(map(len, values)) > max_chars:
                    index = next(i for i, value in enumerate(values) if len(value) > max_chars)
                    return f"{name}[{index}]", len(values[index]), "characters", max_chars
            elif fields is not None:
                for index, value in enumerate(values):
                    found = _first_violation(value, fields)
                    if found is not None:
                        return (f"{name}[{index}].{found[0]}", *found[1:])
        elif max_chars is not None:
            size = len(getattr(message, name))
            if size > max_chars:
                return name, size, "characters", max_chars
        elif message.HasField(name):
            found = _first_violation(getattr(message, name), fields)
            if found is not None:
                return (f"{name}.{found[0]}", *found[1:])
    return None
