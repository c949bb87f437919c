"""Routing policies as pure functions on fake replica states (no processes, no I/O)."""

from __future__ import annotations

import random

import pytest

from router.policy import (
    COLD,
    FALLBACK,
    FETCH_AUTO,
    FETCH_OFF,
    SPILLOVER,
    WARM,
    CacheAwarePolicy,
    Candidate,
    Decision,
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RouteRequest,
    decide,
    fetch_knob,
    hit_tokens,
    make_policy,
    rendezvous,
    weight,
)

BS = 16


def req(prompt_tokens: int = 320, decode: int = 16, affinity: bytes = b"p0") -> RouteRequest:
    return RouteRequest(prompt_tokens, prompt_tokens // BS, BS, decode, affinity)


def cand(rid: str, cached: int = 0, predicted: int = 0, inflight: int = 0, queued: int = 0):
    return Candidate(rid, cached, predicted, inflight, queued)


def test_hit_tokens_never_cover_the_last_prompt_token() -> None:
    r = req(prompt_tokens=64)
    assert hit_tokens(r, 4) == 63
    assert hit_tokens(r, 2) == 32
    assert hit_tokens(RouteRequest(0, 0, BS, 16), 3) == 0
    assert weight(r, cand("a", cached=2)) == (64 - 32) + 16


def test_cost_prefers_the_replica_holding_the_prefix() -> None:
    policy = CacheAwarePolicy(epsilon=0.5, slack_tokens=512, tie_tokens=0)
    cands = [cand("a"), cand("b", cached=18), cand("c", cached=4)]
    d = policy.choose(req(), cands)
    assert (d.replica_id, d.outcome) == ("b", WARM)
    assert d.predicted_cached_tokens == 18 * BS
    assert d.weight_tokens == 320 - 288 + 16
    assert policy.cost(req(), cands[1]) == 32
    assert policy.cost(req(), cands[2]) == 320 - 64


def test_queued_work_outweighs_a_short_prefix() -> None:
    """Cost = uncached prompt tokens + load: a busy warm replica loses to an idle cold one
    when its queue costs more than prefilling the prefix elsewhere."""
    policy = CacheAwarePolicy(epsilon=10.0, slack_tokens=10_000, tie_tokens=0)
    r = req(prompt_tokens=320)
    busy_warm = cand("a", cached=10, inflight=600)  # cost 160 + 600
    idle_cold = cand("b")  # cost 320
    d = policy.choose(r, [busy_warm, idle_cold])
    assert (d.replica_id, d.outcome) == ("b", SPILLOVER)
    lightly_loaded = cand("a", cached=10, inflight=100)  # cost 260 < 320
    assert policy.choose(r, [lightly_loaded, idle_cold]).replica_id == "a"


def test_load_is_the_larger_of_router_and_replica_counts() -> None:
    assert cand("a", inflight=50, queued=200).load == 200
    assert cand("a", inflight=300, queued=200).load == 300
    assert cand("a", cached=2, predicted=5).matched_blocks == 5


def test_cold_burst_sticks_through_predicted_entries() -> None:
    """A burst with a new prefix: the first request goes somewhere cold, records predicted
    entries, and every following request (same prefix) follows it although nothing is cached."""
    policy = CacheAwarePolicy(epsilon=0.5, slack_tokens=512, tie_tokens=32)
    loads = {"a": 0, "b": 0, "c": 0}
    predicted: dict[str, int] = {}
    placed = []
    for _ in range(8):
        cands = [cand(rid, predicted=predicted.get(rid, 0), inflight=loads[rid]) for rid in loads]
        d = policy.choose(req(), cands)
        placed.append((d.replica_id, d.outcome))
        loads[d.replica_id] += d.weight_tokens
        predicted[d.replica_id] = 20  # what the router records after routing
    assert placed[0][1] == COLD
    assert {rid for rid, _ in placed} == {placed[0][0]}
    assert all(outcome == WARM for _, outcome in placed[1:])


def test_hot_prefix_spills_to_a_second_replica_and_load_stays_bounded() -> None:
    """A flood of one prefix: the warm replica takes requests until the bound bites, then the
    next best replica warms up (spillover) and shares the prefix; max load stays within
    (1 + eps) x mean + slack after every decision."""
    eps, slack = 0.5, 256
    policy = CacheAwarePolicy(epsilon=eps, slack_tokens=slack, tie_tokens=32)
    loads = {"a": 0, "b": 0, "c": 0}
    matched = {"a": 20, "b": 0, "c": 0}  # a holds the hot prefix
    outcomes = []
    for _ in range(60):  # nothing finishes: demand keeps growing
        cands = [cand(rid, cached=matched[rid], inflight=loads[rid]) for rid in loads]
        d = policy.choose(req(), cands)
        outcomes.append((d.replica_id, d.outcome))
        loads[d.replica_id] += d.weight_tokens
        matched[d.replica_id] = 20
        mean = sum(loads.values()) / len(loads)
        assert max(loads.values()) <= (1 + eps) * mean + slack + d.weight_tokens
    spilled = [rid for rid, outcome in outcomes if outcome == SPILLOVER]
    assert spilled, "the hot prefix never spilled over"
    assert outcomes[0] == ("a", WARM)
    assert {rid for rid, _ in outcomes} == {"a", "b", "c"}  # with more demand, a third warms
    # Once warm, the second replica serves the prefix as a warm hit, not a cold prefill.
    assert sum(1 for rid, o in outcomes if rid == spilled[0] and o == WARM) > 0


def test_bound_never_lets_a_replica_run_far_above_the_mean_while_others_idle() -> None:
    policy = CacheAwarePolicy(epsilon=0.25, slack_tokens=0, tie_tokens=0)
    # a holds everything but already carries 4x the mean: it is out of bounds.
    cands = [cand("a", cached=20, inflight=3000), cand("b", inflight=0), cand("c", inflight=0)]
    d = policy.choose(req(), cands)
    assert d.replica_id != "a"
    assert d.outcome == SPILLOVER


def test_demand_cooling_shrinks_back_to_one_replica() -> None:
    """Both a and b hold the prefix; with no load, ties go to the same rendezvous winner for
    every request (and every router), so the second copy stops being used and ages out."""
    policy = CacheAwarePolicy(epsilon=0.5, slack_tokens=512, tie_tokens=32)
    chosen = {
        policy.choose(req(), [cand("a", cached=20), cand("b", cached=20), cand("c")]).replica_id
        for _ in range(10)
    }
    assert len(chosen) == 1 and chosen <= {"a", "b"}
    # Small load differences (within tie_tokens) do not flip the choice either.
    winner = chosen.pop()
    other = "b" if winner == "a" else "a"
    cands = [cand(winner, cached=20, inflight=20), cand(other, cached=20), cand("c")]
    assert policy.choose(req(), cands).replica_id == winner


def test_outcomes_cold_and_fallback() -> None:
    policy = CacheAwarePolicy()
    assert policy.choose(req(), [cand("a"), cand("b")]).outcome == COLD
    untokenized = RouteRequest(0, 0, 0, 16, b"x")
    assert policy.choose(untokenized, [cand("a"), cand("b")]).outcome == FALLBACK


def test_round_robin_cycles_in_id_order() -> None:
    policy = RoundRobinPolicy()
    cands = [cand("c"), cand("a", cached=20), cand("b")]
    assert [policy.choose(req(), cands).replica_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_and_random() -> None:
    cands = [cand("a", inflight=50), cand("b", queued=10), cand("c", inflight=30)]
    assert LeastLoadedPolicy().choose(req(), cands).replica_id == "b"
    picks = {RandomPolicy(seed=s).choose(req(), cands).replica_id for s in range(20)}
    assert picks == {"a", "b", "c"}


@pytest.mark.parametrize("name", ["cache_aware", "round_robin", "least_loaded", "random"])
def test_make_policy_by_name(name: str) -> None:
    assert make_policy(name).name == name


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


# --- request bound and cold placement (router/balance.py) --------------------------------------


def test_recent_requests_counts_a_sliding_window() -> None:
    from router.balance import RecentRequests

    recent = RecentRequests(window=3)
    for rid in ("a", "a", "b", "c"):  # the first "a" falls out of the window
        recent.add(rid)
    assert (recent.count("a"), recent.count("b"), recent.count("c"), len(recent)) == (1, 1, 1, 3)
    with pytest.raises(ValueError, match="window"):
        RecentRequests(0)


def test_request_bound_spills_a_warm_replica_with_too_many_recent_requests() -> None:
    policy = CacheAwarePolicy(request_epsilon=0.1, request_slack=2)
    warm = Candidate("a", cached_blocks=18, recent_requests=20)
    others = [Candidate("b", recent_requests=10), Candidate("c", recent_requests=10)]
    # 21 > 1.1 x 41 / 3 + 2 = 17.03: the warm replica is out of bounds, the prefix spills
    d = policy.choose(req(), [warm, *others])
    assert d.replica_id in ("b", "c") and d.outcome == SPILLOVER
    # within bounds it stays warm
    d = policy.choose(req(), [Candidate("a", cached_blocks=18, recent_requests=13), *others])
    assert (d.replica_id, d.outcome) == ("a", WARM)
    # off (None): no request bound at all
    d = CacheAwarePolicy().choose(req(), [warm, *others])
    assert (d.replica_id, d.outcome) == ("a", WARM)


def test_request_bound_waits_for_enough_decisions_in_its_window() -> None:
    # 5 of the router's last 7 decisions on the warm replica: far above 1.1 x the mean + 2,
    # but 7 decisions say nothing about balance: below request_min the prefix stays warm.
    warm = Candidate("a", cached_blocks=18, recent_requests=5)
    others = [Candidate("b", recent_requests=1), Candidate("c", recent_requests=1)]
    policy = CacheAwarePolicy(request_epsilon=0.1, request_slack=2, request_min=32)
    assert policy.choose(req(), [warm, *others]).replica_id == "a"
    assert policy.within_request_bound(warm, 7, 3)
    strict = CacheAwarePolicy(request_epsilon=0.1, request_slack=2, request_min=0)
    assert strict.choose(req(), [warm, *others]).outcome == SPILLOVER
    assert not strict.within_request_bound(warm, 7, 3)


def test_cold_requests_leave_a_warm_replica_its_headroom() -> None:
    # 14 of the last 32 decisions went to "a", which holds a hot prefix and has the least
    # load. The mean share with this request is 33 / 3 = 11: a cold request may go only
    # where it keeps a replica within 1.1 x 11 + 2 = 14.1, a warm one within 1.2 x 11 + 2 =
    # 15.2.
    def cluster(cached: int) -> list[Candidate]:
        return [
            Candidate("a", cached_blocks=cached, recent_requests=14),
            Candidate("b", inflight_tokens=100, recent_requests=9),
            Candidate("c", inflight_tokens=100, recent_requests=9),
        ]

    policy = CacheAwarePolicy(request_epsilon=0.2, request_slack=2, request_cold_epsilon=0.1)
    cold = policy.choose(req(), cluster(cached=0))
    assert cold.replica_id in ("b", "c") and cold.outcome == COLD
    assert not policy.within_request_bound(cluster(0)[0], 32, 3, req())
    warm = policy.choose(req(), cluster(cached=18))
    assert (warm.replica_id, warm.outcome) == ("a", WARM)
    assert policy.within_request_bound(cluster(18)[0], 32, 3, req())
    # The cold share as loose as the warm one (the router's flag at 0.2 or above): the cold
    # request takes the least-loaded replica, and its warm requests would soon spill.
    loose = CacheAwarePolicy(request_epsilon=0.2, request_slack=2, request_cold_epsilon=0.2)
    assert loose.choose(req(), cluster(cached=0)).replica_id == "a"
    # The router's default: as loose as its request bound (docs/benchmarks.md, "Cold prompts to
    # the least content"), which the content count needs to place cold prompts.
    assert make_policy("cache_aware", request_epsilon=0.2).request_cold_epsilon == 0.25


def test_make_policy_passes_the_request_bound() -> None:
    p = make_policy("cache_aware", request_epsilon=0.1)
    assert isinstance(p, CacheAwarePolicy) and p.request_epsilon == 0.1
    off = make_policy("cache_aware", request_epsilon=None)
    assert isinstance(off, CacheAwarePolicy) and off.request_epsilon is None


def test_fetch_source_names_a_replica_holding_more_cached_blocks() -> None:
    from router.policy import fetch_source

    warm = Candidate("warm", cached_blocks=10)
    spill = Candidate("spill", cached_blocks=2, predicted_blocks=12)
    cold = Candidate("cold")
    assert fetch_source([warm, spill, cold], cold) is warm
    assert fetch_source([warm, spill, cold], spill) is warm  # predicted is not held yet
    assert fetch_source([warm, spill, cold], warm) is None
    assert fetch_source([cold, Candidate("c2")], cold) is None


def test_fetch_weight_prices_a_prefix_held_elsewhere_as_a_fetch() -> None:
    warm, idle = cand("warm", cached=63, inflight=3000), cand("idle")
    request = req(1024)
    # Without it the idle replica pays a full prefill (8 x 1,024) and the queue wins.
    plain = make_policy("cache_aware", epsilon=10.0)
    assert plain.choose(request, [warm, idle]).replica_id == "warm"
    # A fetch costs 1 per token: 8 x 16 + 1,008 < 8 x 16 + 3,000 queued.
    fetching = make_policy("cache_aware", epsilon=10.0, fetch_weight=1.0)
    assert isinstance(fetching, CacheAwarePolicy) and fetching.fetch_weight == 1.0
    assert fetching.cost(request, idle, held_blocks=63) == 8 * 16 + 1008
    assert fetching.choose(request, [warm, idle]).replica_id == "idle"
    assert make_policy("cache_aware").fetch_weight is None  # off unless asked for


def _reference_choose(policy: CacheAwarePolicy, request: RouteRequest, candidates) -> Decision:
    """CacheAwarePolicy.choose as first written, from its public pieces: the fast version must
    decide exactly as this does."""
    total = sum(c.load for c in candidates)
    recent = sum(c.recent_requests for c in candidates)
    n = len(candidates)
    eligible = [
        c
        for c in candidates
        if policy.within_bound(request, c, total, n)
        and policy.within_request_bound(c, recent, n, request)
    ]
    if not eligible:
        eligible = [min(candidates, key=lambda c: (c.load, c.recent_requests))]
    held = max(c.cached_blocks for c in candidates)
    duplicated = max(c.matched_blocks for c in candidates) if policy.saturated(candidates) else 0
    costs = {c.replica_id: policy.cost(request, c, held, duplicated) for c in eligible}
    best = min(costs.values())
    tied = [c for c in eligible if costs[c.replica_id] <= best + policy.tie_tokens]
    chosen = max(tied, key=lambda c: (c.matched_blocks, rendezvous(request.affinity, c.replica_id)))
    return decide(request, candidates, chosen)


@pytest.mark.parametrize("seed", range(8))
def test_cache_aware_choose_decides_as_the_reference(seed: int) -> None:
    """Random clusters (loads near the bounds, ties, untokenized requests, fetch pricing, the
    request bound): every decision equals the straightforward implementation's."""
    rng = random.Random(seed)
    policies = [
        CacheAwarePolicy(),
        CacheAwarePolicy(epsilon=0.2, slack_tokens=0, tie_tokens=0, prefill_weight=8.0),
        CacheAwarePolicy(
            epsilon=1.0,
            slack_tokens=512,
            tie_tokens=64,
            prefill_weight=8.0,
            request_epsilon=0.1,
            request_slack=2,
        ),  # fmt: skip
        CacheAwarePolicy(epsilon=0.5, tie_tokens=32, prefill_weight=8.0, fetch_weight=1.0),
        CacheAwarePolicy(epsilon=0.0, slack_tokens=0, request_epsilon=0.0, fetch_weight=0.0),
        CacheAwarePolicy(request_epsilon=0.2, request_slack=0, request_min=0),
        CacheAwarePolicy(request_epsilon=0.3, request_min=0, request_cold_epsilon=0.1),
        CacheAwarePolicy(epsilon=0.5, tie_tokens=32, prefill_weight=8.0, fetch_auto=True),
        CacheAwarePolicy(prefill_weight=8.0, saturation_tokens=100, duplicate_weight=4.0),
        CacheAwarePolicy(saturation_tokens=0, duplicate_weight=16.0, fetch_weight=1.0),
    ]
    for _ in range(400):
        prompt = rng.choice([0, 1, 15, 16, 17, 64, 320, 1024])
        request = RouteRequest(prompt, prompt // BS, BS, rng.choice([1, 16, 256]),
                               rng.randbytes(rng.choice([0, 16])))  # fmt: skip
        candidates = []
        for i in range(rng.randint(1, 5)):
            cached = rng.choice([0, 0, 1, prompt // BS, prompt // BS + 2, rng.randint(0, 70)])
            predicted = rng.choice([0, cached, cached + rng.randint(0, 8)])
            load = rng.choice([0, 0, 16, 100, 500, 3000])
            candidates.append(
                Candidate(
                    f"r{i}",
                    cached,
                    predicted,
                    load + rng.randint(-1, 1) * load // 3,
                    rng.choice([0, load]),
                    rng.randint(0, 40),
                    rng.choice([None, 0.125, 0.5, 3.0]),
                    rng.choice([None, 0, 1, 4, 100]),
                )
            )
        for policy in policies:
            assert policy.choose(request, candidates) == _reference_choose(
                policy, request, candidates
            ), (policy.__dict__, request, candidates)


def test_auto_fetch_weight_is_each_replicas_measured_fetch_cost() -> None:
    # --fetch-weight auto: a held-elsewhere token costs the prefill
    # weight times the fetch_cost the replica's lease publishes (capped at a full prefill); a
    # replica that does not fetch (no fetch_cost) pays a full prefill.
    warm, request = cand("warm", cached=63, inflight=3000), req(1024)
    auto = make_policy("cache_aware", epsilon=10.0, fetch_weight="auto")
    assert isinstance(auto, CacheAwarePolicy) and auto.fetch_auto and auto.fetch_weight is None
    fast = Candidate("fast", fetch_cost=0.125)  # fetching a token costs 1/8 of prefilling it
    assert auto.cost(request, fast, held_blocks=63) == 8 * 16 + 1 * 1008
    assert auto.choose(request, [warm, fast]).replica_id == "fast"
    for slow in (Candidate("slow", fetch_cost=3.0), Candidate("no-fetch")):
        assert auto.cost(request, slow, held_blocks=63) == 8 * 1024  # a full prefill
        assert auto.choose(request, [warm, slow]).replica_id == "warm"
    # A copy that does not fit in the replica's empty blocks would evict cached ones: only
    # what fits is priced as a fetch, the rest as a prefill; a full pool fetches nothing.
    roomy = Candidate("fast", fetch_cost=0.125, empty_blocks=100)
    assert auto.cost(request, roomy, held_blocks=63) == 8 * 16 + 1 * 1008
    some = Candidate("fast", fetch_cost=0.125, empty_blocks=10)
    assert auto.cost(request, some, held_blocks=63) == 8 * (16 + 1008 - 160) + 1 * 160
    full = Candidate("fast", fetch_cost=0.125, empty_blocks=0)
    assert auto.cost(request, full, held_blocks=63) == 8 * 1024
    assert auto.choose(request, [warm, roomy]).replica_id == "fast"
    assert auto.choose(request, [warm, full]).replica_id == "warm"
    # A fixed weight is the operator's price: no cap.
    fixed = make_policy("cache_aware", epsilon=10.0, fetch_weight=1.0)
    assert fixed.cost(request, full, held_blocks=63) == 8 * 16 + 1 * 1008
    assert fetch_knob("off") == fetch_knob(None) == FETCH_OFF
    assert fetch_knob("auto") == FETCH_AUTO and fetch_knob("1.5") == 1.5
    with pytest.raises(ValueError, match="auto, off or a number"):
        fetch_knob("-1")


def test_under_saturation_a_request_stays_where_its_prefix_is_being_computed() -> None:
    # A is computing the request's 1,024-token prefix for an earlier request (predicted, not
    # cached) behind a long queue; B's queue is 11,000 tokens shorter. Moving the request saves
    # it that wait at the price of computing the prefix twice.
    request = RouteRequest(1024, 64, BS, 16)
    policy = CacheAwarePolicy(prefill_weight=8.0)  # saturation at 8,192 queued tokens
    holder = Candidate("a", 0, 64, 20_000)

    def choice(other_load: int, p: CacheAwarePolicy = policy) -> str:
        return p.choose(request, [holder, Candidate("b", 0, 0, other_load)]).replica_id

    assert choice(8_000) == "b"  # B is not queueing that long: the cluster is not saturated
    # Every queue is past 8,192 tokens: the 1,023 tokens B would compute again cost 16 more each.
    assert choice(9_000) == "a"
    off = CacheAwarePolicy(prefill_weight=8.0, duplicate_weight=0.0)
    assert choice(9_000, off) == "b"
    assert policy.cost(request, Candidate("b", 0, 0, 9_000), duplicated_blocks=64) == (
        8 * 1024 + 16 * 1023 + 9_000
    )


def test_routed_content_counts_distinct_blocks_over_two_epochs() -> None:
    from router.balance import RoutedContent

    content = RoutedContent(epoch_blocks=10)
    content.add("a", [b"1", b"2", b"3"])
    content.add("a", [b"1", b"2", b"4"])  # two of them again: one new block
    content.add("b", [b"1"])  # the same block sent to another replica counts there too
    assert (content.count("a"), content.count("b"), content.count("c")) == (4, 1, 0)
    content.add("b", [bytes([i]) for i in range(5)])  # 10 pairs in this epoch: it ends
    assert (content.count("a"), content.count("b")) == (4, 6)  # the previous epoch still counts
    content.add("a", [b"1", b"9"])  # "1" again: counted once, in the new epoch
    assert content.count("a") == 5
    content.add("c", [bytes([100 + i]) for i in range(8)])  # 10 more pairs: another epoch ends
    # only the last two epochs count: "a" keeps what it was sent since the first ended
    assert (content.count("a"), content.count("b"), content.count("c")) == (2, 0, 8)
    with pytest.raises(ValueError, match="epoch_blocks"):
        RoutedContent(0)


def test_cold_prompts_go_to_the_replica_sent_the_least_content() -> None:
    def cluster(b_load: int = 300, c_routed: int = 200) -> list[Candidate]:
        return [
            Candidate("a", routed_blocks=500),
            Candidate("b", inflight_tokens=b_load, routed_blocks=100),
            Candidate("c", routed_blocks=c_routed),
        ]

    policy = make_policy("cache_aware")
    # the least content, though not the least loaded
    assert policy.choose(req(), cluster()) == decide(req(), cluster(), cluster()[1])
    assert policy.choose(req(), cluster()).outcome == COLD
    # placed by load, the same prompt goes to an idle replica
    assert make_policy("cache_aware", cold_by="load").choose(req(), cluster()).replica_id != "b"
    # equal content: the lesser load
    assert policy.choose(req(), cluster(c_routed=100)).replica_id == "c"
    # a replica loaded beyond 8 x the least loaded's + 16,384 tokens takes no cold prompt
    assert policy.choose(req(), cluster(b_load=16_384)).replica_id == "b"
    assert policy.choose(req(), cluster(b_load=16_385)).replica_id == "c"
    # a prefix some replica holds is not cold: the cost model places it
    warm = [cluster()[0]._replace(cached_blocks=10), *cluster()[1:]]
    assert (policy.choose(req(), warm).replica_id, policy.choose(req(), warm).outcome) == (
        "a", WARM,
    )  # fmt: skip
    # without a count (a candidate built elsewhere): by load, as before
    plain = [c._replace(routed_blocks=None) for c in cluster()]
    assert policy.choose(req(), plain).replica_id != "b"
    with pytest.raises(ValueError, match="cold_by"):
        make_policy("cache_aware", cold_by="tree")


def test_cold_placement_by_content_keeps_the_request_bound() -> None:
    # "b" was sent the least content but took 15 of the last 32 decisions: above 1.25 x 11 + 2
    # = 15.75 with this one, so the cold prompt goes to the next least content, "c".
    cands = [
        Candidate("a", recent_requests=9, routed_blocks=500),
        Candidate("b", recent_requests=15, routed_blocks=100),
        Candidate("c", recent_requests=8, routed_blocks=200),
    ]
    policy = make_policy("cache_aware", request_epsilon=0.25)
    assert policy.choose(req(), cands).replica_id == "c"
    # the bound waits for 32 decisions, as for any request
    early = [c._replace(recent_requests=c.recent_requests // 4) for c in cands]
    assert policy.choose(req(), early).replica_id == "b"
