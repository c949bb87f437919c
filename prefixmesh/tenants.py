"""Per-tenant admission limits, so one tenant cannot starve the others. Torch-free.

A tenant is the request's ``cache_salt`` (the field that already isolates tenants' cached
blocks) or, without one, the API key the caller presented, else ``default``. Each tenant gets
a cap on concurrent requests (``--tenant-max-concurrent``) and on the prompt tokens of its
requests that are admitted but have not produced a token yet (``--tenant-max-queued-tokens``:
the prefill work it may have queued). A request beyond either cap is refused at once with
RESOURCE_EXHAUSTED (HTTP 429) and a retry-after hint, and counted in
``prefixmesh_tenant_rejections_total{tenant, reason}``. 0 turns a cap off (the default: a
single-tenant cluster needs none). Replicas and routers both enforce them.

Tenant names in metrics are fingerprints (``salt:1a2b3c4d5e6f``), never the salt or key. A
router passes the tenant it counted a request against to the replica (``TENANT_METADATA``), so
the replica's caps and its fair step shares (replica/tenant_share.py) see API-key tenants
behind the router, not the router's own key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    tenant_max_concurrent: int = 0
    tenant_max_queued_tokens: int = 0

    @classmethod
    def from_config(cls, config: Any) -> TenantLimits:
        return cls(config.tenant_max_concurrent, config.tenant_max_queued_tokens)

    @property
    def enabled(self) -> bool:
        return self.tenant_max_concurrent > 0 or self.tenant_max_queued_tokens > 0


HELP: dict[str, str] = {
    "tenant_max_concurrent": "most requests one tenant (its cache_salt, else its API key) may "
    "have in flight; beyond it RESOURCE_EXHAUSTED (0 = no cap)",
    "tenant_max_queued_tokens": "most prompt tokens one tenant may have admitted but not yet "
    "started; beyond it RESOURCE_EXHAUSTED (0 = no cap)",
}


def _fingerprint(kind: str, secret: str) -> str:
    return f"{kind}:{hashlib.sha256(secret.encode()).hexdigest()[:12]}"


def tenant_of(cache_salt: str, authorization: str | None = None) -> str:
    """The tenant a request counts against (a fingerprint, safe to log and label)."""
    if cache_salt:
        return _fingerprint("salt", cache_salt)
    if authorization:
        return _fingerprint("key", authorization.removeprefix("Bearer ").strip())
    return DEFAULT_TENANT


# The tenant a router counted a request against, passed on to the replica it forwards it to:
# behind a router, every call reaches the replica with the router's own API key, so a replica
# could tell API-key tenants apart only by this (cache_salt tenants it sees either way).
TENANT_METADATA = "x-prefixmesh-tenant"
MAX_TENANT_CHARS = 64


def tenant_of_call(cache_salt: str, context: Any, forwarded: bool = False) -> str:
    """``tenant_of`` for a gRPC call (reads the ``authorization`` metadata). With
    ``forwarded`` (a replica), a tenant a router named in ``TENANT_METADATA`` wins: callers
    that reach a replica hold its API key, and a salt is the caller's to choose anyway."""
    metadata = dict(context.invocation_metadata() or ())
    if forwarded:
        named = metadata.get(TENANT_METADATA)
        if named and len(named) <= MAX_TENANT_CHARS:
            return named
    return tenant_of(cache_salt, metadata.get("authorization"))


class TenantBusy(Exception):
    """A request over its tenant's cap; the message says which cap."""


class Ticket:
    """One admitted request's share of its tenant's counters; ``close`` is idempotent."""

    __slots__ = ("_limiter", "tenant", "tokens", "_open")

    def __init__(self, limiter: TenantLimiter, tenant: str) -> None:
        self._limiter, self.tenant, self.tokens, self._open = limiter, tenant, 0, True

    def queue_tokens(self, tokens: int) -> None:
        """Count ``tokens`` prompt tokens as queued; raises ``TenantBusy`` over the cap (the
        ticket is then closed)."""
        self._limiter._queue(self, tokens)

    def started(self) -> None:
        """The request produced its first token: its prompt is no longer queued."""
        self._limiter._unqueue(self)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._limiter._close(self)


class TenantLimiter:
    """Counters per tenant (entries vanish when a tenant has nothing in flight)."""

    def __init__(self, limits: TenantLimits, registry: CollectorRegistry | None = None) -> None:
        self.limits = limits
        self.concurrent: dict[str, int] = {}
        self.queued_tokens: dict[str, int] = {}
        self.rejections = Counter(
            "prefixmesh_tenant_rejections",
            "Requests refused because their tenant was over a cap",
            ["tenant", "reason"],
            registry=registry,
        )
        self.inflight = Gauge(
            "prefixmesh_tenants_active", "Tenants with requests in flight", registry=registry
        )

    def admit(self, tenant: str) -> Ticket:
        """A ticket for one more request of ``tenant``; raises ``TenantBusy`` over the cap."""
        cap = self.limits.tenant_max_concurrent
        count = self.concurrent.get(tenant, 0)
        if cap and count >= cap:
            self.rejections.labels(tenant, "concurrent").inc()
            raise TenantBusy(
                f"tenant {tenant} already has {count} requests in flight (the cap is {cap})"
            )
        self.concurrent[tenant] = count + 1
        self.inflight.set(len(self.concurrent))
        return Ticket(self, tenant)

    def _queue(self, ticket: Ticket, tokens: int) -> None:
        cap = self.limits.tenant_max_queued_tokens
        queued = self.queued_tokens.get(ticket.tenant, 0)
        # A lone request longer than the cap still runs: refusing it would refuse it forever.
        if cap and queued and queued + tokens > cap:
            ticket.close()
            self.rejections.labels(ticket.tenant, "queued_tokens").inc()
            raise TenantBusy(
                f"tenant {ticket.tenant} has {queued} prompt tokens queued; {tokens} more would "
                f"exceed the cap of {cap}"
            )
        self.queued_tokens[ticket.tenant] = queued + tokens
        ticket.tokens += tokens

    def _unqueue(self, ticket: Ticket) -> None:
        if ticket.tokens:
            left = self.queued_tokens.get(ticket.tenant, 0) - ticket.tokens
            ticket.tokens = 0
            if left > 0:
                self.queued_tokens[ticket.tenant] = left
            else:
                self.queued_tokens.pop(ticket.tenant, None)

    def _close(self, ticket: Ticket) -> None:
        self._unqueue(ticket)
        left = self.concurrent.get(ticket.tenant, 0) - 1
        if left > 0:
            self.concurrent[ticket.tenant] = left
        else:
            self.concurrent.pop(ticket.tenant, None)
        self.inflight.set(len(self.concurrent))
