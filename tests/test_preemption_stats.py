"""Preemption and queue-time counters (replica/preemption_stats.py) on a crafted pool that must
preempt: exact counts for recompute and swap, the block pool's integrity after each, and the
counters reaching ReplicaStats and Prometheus."""

from __future__ import annotations

import random

from replica import LLM, SamplingParams
from replica.preemption_stats import PreemptionStats

# Two 32-token prompts fill a 4-block pool of 16-token blocks exactly; the first decode of the
# older one needs a fifth block, so the newer one must be preempted, once.
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 400) for _ in range(32)] for _ in range(2)]


def _run(tiny_model_dir, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=16, num_kv_blocks=4,
              max_num_batched_tokens=256, **kwargs)  # fmt: skip
    outputs = llm.generate(_prompts(), PARAMS)
    llm.engine.check_integrity()
    return llm, [o.token_ids for o in outputs]


def test_recompute_preemption_counts(tiny_model_dir):
    roomy = LLM(str(tiny_model_dir), dtype="float32", block_size=16, num_kv_blocks=64)
    expected = [o.token_ids for o in roomy.generate(_prompts(), PARAMS)]
    llm, got = _run(tiny_model_dir)
    assert got == expected  # preemption never changes greedy output
    s = llm.engine.get_stats()
    p = s.preempt
    assert (p.recompute_preemptions, p.swap_preemptions) == (1, 0)
    assert p.preemptions == s.preemptions == 1
    # The victim had computed its 32 prompt tokens; at its return whatever of its prompt blocks
    # were still cached came back as hits (the prompts share nothing, so every hit is that), and
    # the rest was computed again.
    assert p.recomputed_tokens + s.prefix_cache_hits == 32
    assert p.recomputed_tokens >= 16  # the older sequence's new block evicted one of its blocks
    assert (p.swapped_out_blocks, p.swapped_in_blocks) == (0, 0)
    assert p.admissions == 3  # two arrivals and one return
    assert p.queue_time_s > 0
    assert s.free_blocks == s.num_blocks  # nothing leaked
    assert llm.engine.scheduler.preempt_stats.tracked == 0


def test_swap_preemption_counts(tiny_model_dir):
    llm, _ = _run(tiny_model_dir, preemption_mode="swap", num_host_blocks=8)
    p = llm.engine.get_stats().preempt
    assert (p.recompute_preemptions, p.swap_preemptions) == (0, 1)
    assert (p.swapped_out_blocks, p.swapped_in_blocks) == (2, 2)  # its two full prompt blocks
    assert p.recomputed_tokens == 0
    assert p.admissions == 3
    assert llm.engine.host_pool.num_free_blocks == 8


def test_queue_time_and_forgetting_with_a_fake_clock():
    now = [10.0]
    stats = PreemptionStats(clock=lambda: now[0])
    stats.queued(1)
    stats.queued(2)
    now[0] = 12.5
    stats.admitted(1, 0)
    stats.recomputing(1, 40)
    stats.queued(1)
    now[0] = 13.0
    stats.admitted(1, 16)  # 16 of the 40 came back from the prefix cache
    stats.finished(2)  # aborted while waiting: its wait is not an admission
    c = stats.counts()
    assert (c.admissions, c.queue_time_s, c.recomputed_tokens) == (2, 3.0, 24)
    assert stats.tracked == 0


def _sample(text: str, name: str, label: str = "") -> float:
    lines = [x for x in text.splitlines() if x.startswith(name + "{") and label in x]
    assert len(lines) == 1, (name, label, lines)
    return float(lines[0].split()[-1])


def test_counters_reach_replica_stats_and_prometheus(tiny_model_dir):
    from prometheus_client import generate_latest

    from proto import prefixmesh_pb2 as pb
    from replica.server.metrics import ReplicaMetrics
    from replica.server.servicers import asdict

    llm, _ = _run(tiny_model_dir, preemption_mode="swap", num_host_blocks=8)
    s = llm.engine.get_stats()
    text = generate_latest(ReplicaMetrics(lambda: s, "m", "r0").registry).decode()
    assert _sample(text, "prefixmesh_preemptions_by_kind_total", 'kind="swap"') == 1
    assert _sample(text, "prefixmesh_preemptions_by_kind_total", 'kind="recompute"') == 0
    assert _sample(text, "prefixmesh_swapped_out_blocks_total") == 2
    assert _sample(text, "prefixmesh_queue_time_seconds_total") == s.preempt.queue_time_s
    msg = pb.ReplicaStats(**asdict(s.preempt))  # what Replica.GetStats sends
    assert (msg.swap_preemptions, msg.swapped_in_blocks, msg.admissions) == (1, 2, 3)


def test_load_tester_summary_counts_the_runs_preemptions():
    from loadtest.cluster import PREEMPTION_FIELDS, ClusterSnapshot, ReplicaCounters, cluster_delta
    from loadtest.report import preemption_line

    def snap(recompute: int, recomputed: int, queue_s: float, admissions: int) -> ClusterSnapshot:
        pre = dict.fromkeys(PREEMPTION_FIELDS, 0) | {
            "recompute_preemptions": recompute, "recomputed_tokens": recomputed,
            "queue_time_s": queue_s, "admissions": admissions,
        }  # fmt: skip
        s = ClusterSnapshot("cache_aware", routing={"requests": admissions})
        s.replicas["r0"] = ReplicaCounters("r0", requests=admissions, preemption=pre)
        return s

    delta = cluster_delta(snap(2, 100, 1.0, 10), snap(5, 400, 4.0, 16))
    assert delta["replicas"]["r0"]["preemption"]["recompute_preemptions"] == 3
    p = delta["preemption"]
    assert (p["recompute_preemptions"], p["recomputed_tokens"], p["admissions"]) == (3, 300, 6)
    assert preemption_line(p).startswith("3 recompute, 0 swap; 300 tokens recomputed")
    assert "queue 500.0 ms mean" in preemption_line(p)
