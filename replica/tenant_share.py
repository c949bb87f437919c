"""Fair shares of the engine step across tenants (``--tenant-fairness``; one tenant: no effect).

A tenant is what ``prefixmesh/tenants.py`` says (the request's ``cache_salt``, else its API key;
the engine falls back to the ``cache_salt``). Each tenant has a virtual token counter (VTC, as in
Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): the tokens the engine
has computed for it, prompt and output alike. A tenant that starts sending again after a pause
is lifted to one step's budget below the least-served tenant with work, so idleness banks at
most one step of credit.

While more than one tenant is *present* (has work, or had some in the last ``window_s``
seconds), the present tenant with the lowest counter (ties: the one with less prompt left to
prefill) is the head: its prefill is bounded only by the step's token budget. Every other tenant
is over its share: together they get at most ``prefill_chunk`` prefill tokens per step, and
none in a step that carries the head's prefill. Waiting requests are admitted head first.
Decodes are never held back.

Why a cap and not only an order: a step cannot be interrupted, so a light tenant's first token
also waits for the step in flight when its request arrives. Short steps for the heavy tenant
bound that wait, and the step that carries the light tenant's prompt carries no other
tenant's prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from replica.sequence import Sequence


@dataclass(slots=True)
class StepShares:
    """One step's prefill allowance: the head tenant's is the budget; the others share
    ``chunk_left`` tokens, and get none once the head's prefill is in the step. ``rank``
    orders tenants, least served first."""

    head: str
    rank: dict[str, int]
    chunk_left: int
    head_prefill: bool = False  # the head tenant has prefill tokens in this step

    def defers(self, seq: Sequence) -> bool:
        """A prefill that waits until the head tenant's work is planned."""
        return seq.is_prefill and seq.request.tenant != self.head

    def limit(self, seq: Sequence, num_new: int) -> int:
        """How many of ``num_new`` tokens ``seq`` may compute this step."""
        if not self.defers(seq):
            return num_new
        return 0 if self.head_prefill else min(num_new, self.chunk_left)

    def take(self, seq: Sequence, num_new: int) -> None:
        if self.defers(seq):
            self.chunk_left -= num_new
        elif seq.is_prefill:
            self.head_prefill = True

    def order(self, seq: Sequence) -> int:
        return self.rank.get(seq.request.tenant, len(self.rank))


class TenantShares:
    """Per-tenant counters and presence; the scheduler calls ``enter`` / ``leave`` as a
    tenant's sequences join and leave its queues, ``plan`` once a step and ``charge`` for
    every scheduled token."""

    def __init__(
        self,
        prefill_chunk: int,
        window_s: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefill_chunk = prefill_chunk
        self.window_s = window_s
        self.burst = burst  # credit a returning tenant gets below the least-served busy one
        self.clock = clock
        self.served: dict[str, float] = {}
        self.seqs: dict[str, int] = {}  # sequences in the scheduler's queues, per busy tenant
        self.last_seen: dict[str, float] = {}

    def enter(self, tenant: str) -> None:
        if not self.seqs.get(tenant):
            busy = [self.served[t] for t in self.seqs if t != tenant]
            idle = [v for t, v in self.served.items() if t != tenant]
            reference = min(busy) if busy else max(idle, default=float(self.burst))
            floor = reference - self.burst
            self.served[tenant] = max(self.served.get(tenant, floor), floor)
        self.seqs[tenant] = self.seqs.get(tenant, 0) + 1
        self.last_seen[tenant] = self.clock()

    def leave(self, tenant: str) -> None:
        left = self.seqs.get(tenant, 0) - 1
        if left > 0:
            self.seqs[tenant] = left
        else:
            self.seqs.pop(tenant, None)
        self.last_seen[tenant] = self.clock()

    def charge(self, tenant: str, tokens: int) -> None:
        self.served[tenant] = self.served.get(tenant, 0.0) + tokens

    def present(self) -> list[str]:
        """Tenants with work or seen in the last ``window_s`` seconds; forgets the others."""
        now = self.clock()
        gone = [t for t, seen in self.last_seen.items() if now - seen > self.window_s]
        for t in gone:
            if t not in self.seqs:
                del self.last_seen[t]
                self.served.pop(t, None)
        return list(self.last_seen)

    def plan(self, queued: Iterable[Sequence]) -> StepShares | None:
        """This step's shares, or ``None`` when fewer than two tenants are present."""
        present = self.present()
        if len(present) < 2:
            return None
        backlog = dict.fromkeys(present, 0)
        for seq in queued:
            if seq.is_prefill:
                backlog[seq.request.tenant] += seq.num_tokens - seq.num_computed_tokens
        order = sorted(present, key=lambda t: (self.served.get(t, 0.0), backlog[t], t))
        return StepShares(order[0], {t: i for i, t in enumerate(order)}, self.prefill_chunk)
