"""Validation of a step against the live requests and the limits: raises, never mutates."""

from __future__ import annotations

from array import array
from typing import Container, Iterable, Sequence

from kv_manager_service.shared.config import KVCacheConfig
from kv_manager_service.shared.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    RequestExistsError,
    RequestNotFoundError,
    ResourceExhaustedError,
)
from kv_manager_service.core.hashing import MMFeature
from kv_manager_service.shared.ops import (
    MAX_RETENTION_PRIORITY,
    AllocateOp,
    DecodeBatch,
    ExpectOp,
    ForkOp,
    FreeOp,
    Op,
    Retention,
)
from kv_manager_service.core.request import RequestState

MAX_TOKEN_ID = (1 << 32) - 1
_NO_RETENTION = Retention()


class StepValidator:
    """Checks ops before a step applies any of them.

    It reads the manager's live requests and expected request ids (the same
    containers, not copies) and its config; every mistake raises a typed
    error naming the field.
    """

    def __init__(self, requests: dict[str, RequestState], expected: Container[str], config: KVCacheConfig) -> None:
        self.requests = requests
        self.expected = expected
        self.config = config

    def validate_step(self, ops: Sequence[Op], decode: DecodeBatch | None = None) -> None:
        """Raise on the first invalid op, its field named `ops[i].<field>`. Changes nothing.

        The live-request limit is checked as the ops would run: a free earlier
        in the step makes room for an admission after it. Entry i of `decode`
        is checked as op len(ops) + i.
        """
        seen: set[str] = set()
        num_live = len(self.requests)
        over_limit: ResourceExhaustedError | None = None
        for index, op in enumerate(ops):
            try:
                kind = type(op)
                if kind is AllocateOp:
                    named_ids: Iterable[tuple[str, str]] = ((op.request_id, "request_id"),)
                    num_live += self._validate_allocate(op)
                elif kind is FreeOp:
                    if not op.request_ids:
                        raise InvalidArgumentError("free needs at least one request id", "request_ids")
                    num_withdrawn = 0
                    for request_id in op.request_ids:
                        if request_id in self.expected:
                            num_withdrawn += 1
                        else:
                            self.get(request_id, "request_ids")
                    if op.num_computed_tokens:
                        self._validate_computed_counts(op)
                    named_ids = ((request_id, "request_ids") for request_id in op.request_ids)
                    num_live -= len(set(op.request_ids)) - num_withdrawn
                elif kind is ExpectOp:
                    self._validate_expect(op)
                    named_ids = ((op.request_id, "request_id"),)
                elif kind is ForkOp:
                    num_live += self._validate_fork(op)
                    named_ids = (
                        (op.parent_request_id, "parent_request_id"),
                        *((child_id, "child_request_ids") for child_id in op.child_request_ids),
                    )
                else:
                    raise InvalidArgumentError(f"unknown op type {kind.__name__}", None)
                for request_id, field in named_ids:
                    if request_id in seen:
                        raise InvalidArgumentError(
                            f"request id {request_id!r} appears in more than one op of the step, or twice in one op", field
                        )
                    seen.add(request_id)
                if num_live > self.config.max_num_requests and over_limit is None:
                    over_limit = ResourceExhaustedError(
                        f"the step would make {num_live} live requests; "
                        f"the limit max_num_requests is {self.config.max_num_requests}",
                    )
                    over_limit.locate(index)
            except KVCacheError as error:
                error.locate(index)
                raise
        if decode is not None:
            self._validate_decode(decode, len(ops), seen)
        if over_limit is not None:  # reported after every op's own mistakes
            raise over_limit

    def _validate_computed_counts(self, op: FreeOp) -> None:
        """A free's `num_computed_tokens`: one per request id, none past what the request has scheduled."""
        counts = op.num_computed_tokens
        if len(counts) != len(op.request_ids):
            raise InvalidArgumentError(
                f"free has {len(op.request_ids)} request_ids but {len(counts)} num_computed_tokens; "
                "give none, or one per request id",
                "num_computed_tokens",
            )
        for request_id, count in zip(op.request_ids, counts):
            request = self.requests.get(request_id)
            scheduled = 0 if request is None else request.num_computed_tokens  # an expected request has none
            if not isinstance(count, int) or not 0 <= count <= scheduled:
                raise InvalidArgumentError(
                    f"request {request_id!r}: num_computed_tokens {count!r} must be an integer in 0..{scheduled} "
                    "(the tokens it has been scheduled)",
                    "num_computed_tokens",
                )

    def _validate_decode(self, batch: DecodeBatch, first_index: int, seen: set[str]) -> None:
        """Checks a decode batch as the allocate ops it stands for, entry i located at op `first_index` + i.

        `seen`: the request ids of the step's other ops. An entry must continue a live request.
        """
        request_ids, token_ids = batch
        if len(request_ids) != len(token_ids):
            raise InvalidArgumentError(
                f"decode has {len(request_ids)} request_ids but {len(token_ids)} token_ids; they must pair up",
                "decode.token_ids",
            )
        try:
            array("I", token_ids)  # one C pass over the column; the loop below runs only to locate a mistake
        except (OverflowError, TypeError, ValueError):
            for index, token_id in enumerate(token_ids, first_index):
                try:
                    check_token_ids((token_id,), "token_ids")
                except KVCacheError as error:
                    error.locate(index)
                    raise
        requests = self.requests
        max_model_len = self.config.max_model_len
        for index, request_id in enumerate(request_ids, first_index):
            try:
                request = requests.get(request_id)
                if request is None:
                    raise RequestNotFoundError(
                        f"decode entry {index - first_index}: unknown request id {request_id!r} "
                        "(decode continues live requests)",
                        "request_id",
                    )
                if request.num_tokens >= max_model_len:
                    self._check_length(AllocateOp(request_id, (), 1), request.num_tokens + 1)
                if request_id in seen:
                    raise InvalidArgumentError(
                        f"request id {request_id!r} appears in more than one op of the step, or twice in one op",
                        "request_id",
                    )
                seen.add(request_id)
            except KVCacheError as error:
                error.locate(index)
                raise

    def _validate_allocate(self, op: AllocateOp) -> int:
        """Checks one allocate op; returns 1 if it admits a new request, else 0."""
        request_id, token_ids, num_new_tokens, num_lookahead_tokens, num_encoder_tokens = op[:5]
        if type(request_id) is not str or not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string", "request_id")
        if type(num_new_tokens) is not int or num_new_tokens < 1:
            raise InvalidArgumentError(f"num_new_tokens must be >= 1, got {num_new_tokens!r}", "num_new_tokens")
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            raise InvalidArgumentError(
                f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens!r}", "num_lookahead_tokens"
            )
        if type(num_encoder_tokens) is not int or num_encoder_tokens < 0:
            raise InvalidArgumentError(f"num_encoder_tokens must be >= 0, got {num_encoder_tokens!r}", "num_encoder_tokens")
        if token_ids:
            check_token_ids(token_ids, "token_ids")
        request = self.requests.get(request_id)
        if request is None:
            if not token_ids:
                raise InvalidArgumentError(
                    f"the first allocate of request {request_id!r} must carry its prompt in token_ids", "token_ids"
                )
            self._check_length(op, len(token_ids))
            check_mm_features(op.mm_features, len(token_ids))
            if op.retention is not None:
                self._check_retention(op)
            return 1
        num_tokens = request.num_tokens + len(token_ids)
        if num_tokens == request.num_computed_tokens:
            raise FailedPreconditionError(
                f"request {request_id!r} has no tokens left to compute: all {num_tokens} are computed; "
                "append the sampled token in token_ids",
                "token_ids",
            )
        if num_tokens + num_lookahead_tokens > self.config.max_model_len:
            self._check_length(op, num_tokens)
        if op.cache_salt or op.lora is not None or op.mm_features or num_encoder_tokens or op.retention is not None:
            extras = request.extras
            if op.retention is not None and (request.retention or _NO_RETENTION) != op.retention:
                raise InvalidArgumentError(
                    f"retention is fixed by the first allocate of request {request_id!r}; a continuation may "
                    "repeat it, not change it",
                    "retention",
                )
            if (
                (op.cache_salt and op.cache_salt != extras.cache_salt)
                or (op.lora is not None and op.lora != extras.lora)
                or (op.mm_features and tuple(op.mm_features) != extras.mm_features)
                or (num_encoder_tokens and num_encoder_tokens != request.num_encoder_tokens)
            ):
                raise InvalidArgumentError(
                    f"cache_salt, lora, mm_features and num_encoder_tokens are fixed by the first allocate of "
                    f"request {request_id!r}; a continuation may not change them",
                    "cache_salt",
                )
        return 0

    def _validate_expect(self, op: ExpectOp) -> None:
        """An expect op names a request neither live nor expected, with a prompt a first allocate could carry."""
        request_id = op.request_id
        if type(request_id) is not str or not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string", "request_id")
        if request_id in self.requests:
            raise RequestExistsError(
                f"request {request_id!r} is live: only a waiting request is expected", "request_id"
            )
        if request_id in self.expected:
            raise RequestExistsError(
                f"request {request_id!r} is already expected; free its id to withdraw it first", "request_id"
            )
        if not op.token_ids:
            raise InvalidArgumentError(f"the expect of request {request_id!r} must carry its prompt", "token_ids")
        check_token_ids(op.token_ids, "token_ids")
        if len(op.token_ids) > self.config.max_model_len:
            raise InvalidArgumentError(
                f"request {request_id!r} would hold {len(op.token_ids)} tokens; the limit max_model_len is "
                f"{self.config.max_model_len}",
                "token_ids",
            )
        check_mm_features(tuple(op.mm_features), len(op.token_ids))

    def _check_retention(self, op: AllocateOp) -> None:
        """A first allocate's retention (docs/retention.md): a priority in range, a TTL >= 0, and a pin
        the quota could hold at all: a prompt whose full blocks alone exceed it is refused."""
        retention = op.retention
        if type(retention) is not Retention:
            raise InvalidArgumentError(f"retention must be a Retention, got {type(retention).__name__}", "retention")
        priority, ttl_ms = retention
        if type(priority) is not int or not 0 <= priority <= MAX_RETENTION_PRIORITY:
            raise InvalidArgumentError(
                f"retention.priority must be an integer in 0..{MAX_RETENTION_PRIORITY}, got {priority!r}",
                "retention.priority",
            )
        if type(ttl_ms) is not int or ttl_ms < 0:
            raise InvalidArgumentError(f"retention.ttl_ms must be an integer >= 0, got {ttl_ms!r}", "retention.ttl_ms")
        if (priority or ttl_ms) and not self.config.enable_prefix_caching:
            raise FailedPreconditionError("retention keeps cached blocks, and this pool has prefix caching off", "retention")
        if ttl_ms:
            limit = self.config.max_pinned_blocks
            num_blocks = sum(len(op.token_ids) // g.block_size for g in self.config.groups if g.cacheable)
            if not limit or num_blocks > limit:
                raise InvalidArgumentError(
                    f"retention.ttl_ms pins the request's cached blocks, and its prompt alone fills {num_blocks}; "
                    f"the limit retention_max_pinned_blocks is {limit}",
                    "retention.ttl_ms",
                )

    def _check_length(self, op: AllocateOp, num_tokens: int) -> None:
        limit = self.config.max_model_len
        if num_tokens + op.num_lookahead_tokens > limit:
            raise InvalidArgumentError(
                f"request {op.request_id!r} would hold {num_tokens} tokens plus {op.num_lookahead_tokens} "
                f"lookahead tokens; the limit max_model_len is {limit}",
                "token_ids",
            )

    def _validate_fork(self, op: ForkOp) -> int:
        self.get(op.parent_request_id, "parent_request_id")
        children = op.child_request_ids
        if not children:
            raise InvalidArgumentError("fork needs at least one child request id", "child_request_ids")
        for child_id in children:
            if not isinstance(child_id, str) or not child_id:
                raise InvalidArgumentError("child request ids must be non-empty strings", "child_request_ids")
            if child_id in self.requests:
                raise RequestExistsError(f"request {child_id!r} already exists", "child_request_ids")
            if child_id in self.expected:
                raise RequestExistsError(
                    f"request {child_id!r} is expected: admit it with an allocate, or free its id first",
                    "child_request_ids",
                )
        return len(children)

    def get(self, request_id: str, field: str) -> RequestState:
        request = self.requests.get(request_id)
        if request is None:
            raise RequestNotFoundError(f"unknown request id {request_id!r}", field)
        return request


def check_token_ids(token_ids: Sequence[int], field: str) -> None:
    """Token ids are integers in 0..2**32-1 (one C pass: array rejects the rest)."""
    try:
        array("I", token_ids)
    except (OverflowError, TypeError, ValueError):
        raise InvalidArgumentError(f"{field} must be integers in 0..{MAX_TOKEN_ID}", field) from None


def check_mm_features(mm_features: tuple[MMFeature, ...], num_prompt_tokens: int) -> None:
    for i, mm in enumerate(mm_features):
        if not mm.identifier or mm.offset < 0 or mm.length < 1 or mm.offset + mm.length > num_prompt_tokens:
            raise InvalidArgumentError(
                f"mm_features[{i}] must have an identifier and lie inside the {num_prompt_tokens}-token prompt "
                f"(offset >= 0, length >= 1), got offset {mm.offset} length {mm.length}",
                f"mm_features[{i}]",
            )
