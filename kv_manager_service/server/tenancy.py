"""Multi-tenant mode: each tenant's cache salt, request-id namespace, block quota and figures.

With `--multi-tenant` every call comes from a tenant (its bearer token names
it; see security.py), and the servicer rewrites the call into the tenant's
scope before anything else reads it (`Tenancy.scope_request`):

- **Request ids** become `tenant/request_id` (a tenant name holds no '/'),
  so two tenants' ids never collide and no tenant can name another's
  requests. Replies and error messages show a tenant its own ids; workers
  (`WatchSteps`, `GetBlockTables`), operators, the journal and the logs see
  the internal ids.
- **Cache salts.** Every allocate and cache lookup gets the salt

      tenant_key = HMAC-SHA256(secret, tenant name)
      cache_salt = hex(HMAC-SHA256(tenant_key, the client's salt or ""))

  The salt enters the hash of a prompt's first block, and block hashes
  chain, so every block hash of a tenant depends on its key: equal prompts
  of two tenants never share a block, and since a client's salt is only
  ever an input of its own tenant's HMAC, no salt a client chooses can
  reach another tenant's blocks. Without the secret nobody can compute a
  tenant's block hashes, so the hashes in events and in the Redis mirror do
  not tell whether a tenant cached a given prompt. Replicas of one
  deployment share the secret, so their mirrored hashes agree. An allocate
  that continues a request keeps its first call's salt: it may repeat the
  client's salt or leave it empty.
- **Idempotency keys** become `tenant/key`.

Quotas. A tenant's blocks are the blocks taken out of the free queue for
its requests that have not gone back: the distinct non-null blocks of its
live requests' tables, plus blocks that only its unacknowledged copies
still hold. No block is ever shared between tenants (their hashes differ;
forks and copies stay within a tenant), so the tenants' counts add up to
the pool's used blocks. The count is kept from the pool's free count around
each step, which all belongs to one tenant (O(1) a step), and around each
release of a tenant's copies. A step runs with the budget `quota - blocks`
(`KVCacheManager.step(max_new_blocks=...)`): an allocate that would take
the tenant past its quota gets NO_SPACE and changes nothing, as when the
pool is full, while other tenants go on allocating.

All methods that touch the counts run under the replica's lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from dataclasses import dataclass
from typing import Callable, MutableSequence, Sequence

from google.protobuf.message import Message

from kv_manager_service.core import (
    AllocateOp,
    FailedPreconditionError,
    AllocateResult,
    AllocateStatus,
    ForkOp,
    FreeOp,
    KVCacheError,
    KVCacheManager,
    StepResult,
)
from kv_manager_service.shared.ops import DecodeBatch, Op
from kv_manager_service.shared.security import TokenTable
from kvcache.v1 import kv_manager_pb2 as pb

SEPARATOR = "/"


def tenant_key(secret: bytes, tenant: str) -> bytes:
    """The tenant's own key: HMAC-SHA256(secret, tenant name)."""
    return hmac.new(secret, tenant.encode("utf-8"), hashlib.sha256).digest()


def derive_cache_salt(secret: bytes, tenant: str, client_salt: str | None) -> str:
    """The cache salt the core uses for `tenant`'s call with `client_salt`."""
    return hmac.new(tenant_key(secret, tenant), (client_salt or "").encode("utf-8"), hashlib.sha256).hexdigest()


@dataclass
class TenantUsage:
    """One tenant's figures (see the module docstring for what a tenant's blocks are)."""

    quota_blocks: int | None
    num_blocks: int = 0
    num_requests: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    # Allocate ops answered NO_SPACE in a step whose budget (the quota's room)
    # was smaller than the pool's free blocks: the quota, not the pool, was the limit.
    num_quota_refusals: int = 0


class Tenancy:
    """Salts, namespaces, quotas and per-tenant figures of a multi-tenant deployment."""

    def __init__(self, secret: bytes, tokens: TokenTable, default_quota_blocks: int | None = None) -> None:
        if not tokens.names_tenants:
            raise ValueError("--multi-tenant needs a token file that maps tenant names to tokens")
        if default_quota_blocks is not None and default_quota_blocks < 0:
            raise ValueError(f"--tenant-quota-blocks must be >= 0, got {default_quota_blocks}")
        self.default_quota_blocks = default_quota_blocks
        self._keys = {p.tenant: tenant_key(secret, p.tenant) for p in tokens.principals}
        self._base_salts = {tenant: self._salt(tenant, "") for tenant in self._keys}
        self.usage = {
            p.tenant: TenantUsage(p.quota_blocks if p.quota_blocks is not None else default_quota_blocks)
            for p in tokens.principals
        }
        self._copy_owners: dict[int, str] = {}  # step id -> tenant, for steps whose copies are not released yet

    def _salt(self, tenant: str, client_salt: str) -> str:
        return hmac.new(self._keys[tenant], client_salt.encode("utf-8"), hashlib.sha256).hexdigest()

    # -- scoping (no lock: pure rewriting of one call's message) ------------------------

    def scope_request(self, tenant: str, request: Message) -> None:
        """Rewrite `request` in place into `tenant`'s scope: ids, salts, idempotency key."""
        kind = type(request)
        if kind is pb.AllocateRequest:
            self._scope_allocate(tenant, request)
        elif kind is pb.FreeRequest or kind is pb.GetBlockTablesRequest:
            _scope_ids(tenant, request.request_ids)
        elif kind is pb.ForkRequest:
            request.parent_request_id = scoped_id(tenant, request.parent_request_id)
            _scope_ids(tenant, request.child_request_ids)
        elif kind is pb.StepRequest:
            for op in request.ops:
                which = op.WhichOneof("op")
                if which is not None:
                    self.scope_request(tenant, getattr(op, which))
            _scope_ids(tenant, request.decode.request_ids)
            if "idempotency_key" in request.DESCRIPTOR.fields_by_name and request.idempotency_key:
                request.idempotency_key = tenant + SEPARATOR + request.idempotency_key
        elif kind is pb.FindCacheHitRequest:
            request.cache_salt = self._salt(tenant, request.cache_salt)
        elif kind is pb.ExpectRequest:
            # As a priority would, it keeps one tenant's blocks at the expense of the others'.
            raise FailedPreconditionError(
                "expect ops are not available in multi-tenant mode (docs/host-tier.md, expected requests)", "expect"
            )
        else:
            raise AssertionError(f"no tenant scope for {kind.__name__}")

    def _scope_allocate(self, tenant: str, request: pb.AllocateRequest) -> None:
        if request.HasField("retention"):
            # A priority or a pin would keep one tenant's blocks at the expense of the others', and a
            # pin outlives its request, past the tenant's quota accounting.
            raise FailedPreconditionError(
                "retention is not available in multi-tenant mode (docs/retention.md)", "retention"
            )
        request.request_id = scoped_id(tenant, request.request_id)
        # Every allocate carries the tenant's salt, first call or not, so a
        # message (and its idempotency fingerprint) does not depend on state;
        # `step` drops the salt of a continuation that sent none.
        request.cache_salt = self._salt(tenant, request.cache_salt)

    def owned_by(self, tenant: str) -> Callable[[str], bool]:
        """Whether an internal request id is `tenant`'s."""
        prefix = tenant + SEPARATOR
        return lambda request_id: request_id.startswith(prefix)

    def unscope_response(self, tenant: str, response: pb.GetBlockTablesResponse) -> None:
        """A tenant's view of block tables: its own ids, no pool-wide pending copies."""
        cut = len(tenant) + len(SEPARATOR)
        for table in response.tables:
            table.request_id = table.request_id[cut:]
        del response.pending_copies[:]

    def unscope_lost_requests(self, tenant: str, response: pb.StepResponse) -> None:
        """A tenant's view of a Step's lost requests: its own, in its own ids."""
        prefix = tenant + SEPARATOR
        own = [
            pb.LostRequest(request_id=lost.request_id[len(prefix) :], cause=lost.cause)
            for lost in response.lost_requests
            if lost.request_id.startswith(prefix)
        ]
        del response.lost_requests[:]
        response.lost_requests.extend(own)

    def tenant_stats(self, tenant: str, response: pb.GetStatsResponse) -> None:
        """A tenant's view of GetStats: its own requests and prefix-cache counters; occupancy,
        evictions, step ids and the host tier's occupancy and copies stay pool-wide (they tell how busy
        the pool is, not what it holds); no event sequence (the event stream is the operator's), and
        no host hits (they are not counted per tenant)."""
        usage = self.usage.get(tenant) or TenantUsage(None)
        response.num_requests = usage.num_requests
        response.prefix_cache_queries = usage.prefix_cache_queries
        response.prefix_cache_hits = usage.prefix_cache_hits
        response.last_event_sequence = 0
        response.prefix_cache_host_hits = 0

    def unscope_error(self, tenant: str, error: KVCacheError) -> KVCacheError:
        """The error as `tenant` should read it: its ids without the internal prefix."""
        message = str(error)
        for quote in ("'", '"'):
            message = message.replace(quote + tenant + SEPARATOR, quote)
        if message != str(error):
            error.args = (message,)
        return error

    # -- accounting (the replica's lock held) --------------------------------------------

    def step(self, manager: KVCacheManager, ops: Sequence[Op], decode: DecodeBatch | None = None) -> StepResult:
        """Run one tenant's scoped step with its quota's budget, and count what it changed."""
        tenant = _tenant_of(ops, decode)
        if tenant is None:  # an empty step
            return manager.step(ops, decode=decode)
        usage = self._usage(tenant)
        base_salt = self._base_salts.get(tenant)
        live = manager.has_request
        ops = [
            op._replace(cache_salt=None)
            if type(op) is AllocateOp and op.cache_salt == base_salt and live(op.request_id)
            else op
            for op in ops
        ]
        assert all(op.cache_salt for op in ops if type(op) is AllocateOp and not live(op.request_id)), (
            "an admission without its tenant's salt"
        )
        before = manager.stats()
        budget = None if usage.quota_blocks is None else usage.quota_blocks - usage.num_blocks
        result = manager.step(ops, max_new_blocks=budget, decode=decode)
        after = manager.stats()
        usage.num_blocks += before.num_free_blocks - after.num_free_blocks
        usage.num_requests += after.num_requests - before.num_requests
        usage.prefix_cache_queries += after.prefix_cache_queries - before.prefix_cache_queries
        usage.prefix_cache_hits += after.prefix_cache_hits - before.prefix_cache_hits
        decoded = result.decode
        if budget is not None and budget < before.num_free_blocks:
            usage.num_quota_refusals += sum(
                1 for r in result.results if type(r) is AllocateResult and r.status is AllocateStatus.NO_SPACE
            )
            if decoded is not None:
                usage.num_quota_refusals += decoded.statuses.count(AllocateStatus.NO_SPACE)
        if any(type(r) is AllocateResult and r.copies for r in result.results) or (decoded and decoded.copies):
            self._copy_owners[result.step_id] = tenant
        return result

    def copy_owners(self) -> dict[int, str]:
        """Step id -> tenant of each step whose copies are pending (for a snapshot)."""
        return dict(self._copy_owners)

    def restore(self, usage: dict[str, TenantUsage], copy_owners: dict[int, str]) -> None:
        """Take a snapshot's counts (each tenant keeps the quota it has now) and copy owners."""
        for tenant, counts in usage.items():
            self.usage[tenant] = dataclasses.replace(counts, quota_blocks=self._usage(tenant).quota_blocks)
        self._copy_owners = dict(copy_owners)

    def _usage(self, tenant: str) -> TenantUsage:
        # A tenant missing from the token file: only a journal written under an older file names one.
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage(self.default_quota_blocks)
        return usage

    def ack(self, manager: KVCacheManager, step_id: int) -> int:
        """`manager.ack(step_id)`, crediting each tenant with the blocks its released copies return."""
        owners = self._copy_owners
        num_released = 0
        for copy_step_id in sorted(s for s in owners if s <= step_id):
            free_before = manager.stats().num_free_blocks
            num_released += manager.ack(copy_step_id)
            self._usage(owners.pop(copy_step_id)).num_blocks -= manager.stats().num_free_blocks - free_before
        return num_released + manager.ack(step_id)


def scoped_id(tenant: str, request_id: str) -> str:
    """`tenant/request_id`; an empty id stays empty, for the core to refuse."""
    return tenant + SEPARATOR + request_id if request_id else request_id


def _scope_ids(tenant: str, ids: MutableSequence[str]) -> None:
    if len(ids):
        ids[:] = [scoped_id(tenant, request_id) for request_id in ids]


def _tenant_of(ops: Sequence[Op], decode: DecodeBatch | None) -> str | None:
    """The tenant whose scoped ids the step names (every id of a step is its caller's), or None."""
    request_ids = [] if decode is None else list(decode.request_ids[:1])
    for op in ops:
        if type(op) is AllocateOp:
            request_ids.append(op.request_id)
        elif type(op) is FreeOp:
            request_ids += op.request_ids[:1]
        else:
            assert type(op) is ForkOp
            request_ids.append(op.parent_request_id)
    for request_id in request_ids:
        tenant, separator, _ = request_id.partition(SEPARATOR)
        if separator:
            return tenant
    return None
