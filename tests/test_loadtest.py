"""Fast tests of the load tester: workloads, arrivals, statistics, and the whole pipeline
(workload -> scheduler -> gRPC client -> results -> summary -> plots) against the echo server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from helpers import Proc, free_port, wait_until

from loadtest.arrivals import ArrivalSpec, schedule
from loadtest.best_hit_rate import best_hit_rate
from loadtest.cli import main as loadtest_main
from loadtest.client import Chunk, ClientError, GenerateClient
from loadtest.cluster import ClusterSnapshot, ReplicaCounters, cluster_delta
from loadtest.request import LoadRequest, RequestResult
from loadtest.runner import RunLimits, run_phase
from loadtest.slo import Slo, parse_slo
from loadtest.summary import latency_stats, summarize
from loadtest.synthetic import RandomSpec, SharedPrefixSpec, random_requests, shared_prefix_requests
from loadtest.tokens import TokenBlocks
from loadtest.trace import TraceOptions, TraceRow, scaled_input_length, trace_requests
from loadtest.workload import SAMPLE_TRACE

# --- workloads ---------------------------------------------------------------------------------


def test_token_blocks_are_deterministic_and_in_range() -> None:
    a, b = TokenBlocks(16, vocab_size=1000, min_token_id=100), TokenBlocks(16, 1000, 100)
    assert a.block(7) == b.block(7)
    assert a.block(7) != a.block(8)
    assert TokenBlocks(16, 1000, 100, seed=1).block(7) != a.block(7)
    assert all(100 <= t < 1000 for h in range(50) for t in a.block(h))
    assert len(a.block(3)) == 16
    with pytest.raises(ValueError, match="min_token_id"):
        TokenBlocks(16, vocab_size=100, min_token_id=100)


def test_trace_rows_share_prefixes_through_hash_ids() -> None:
    rows = [
        TraceRow(1000.0, 1024, 50, (1, 2)),  # two full blocks
        TraceRow(1500.0, 1300, 500, (1, 2, 3)),  # 2 full + partial (276 of 512 tokens)
        TraceRow(3000.0, 100, 5, (9,)),
    ]
    opts = TraceOptions(tokens_per_hash_id=16, max_output_tokens=64)
    reqs = trace_requests(rows, TokenBlocks(16), opts)
    assert [len(r.token_ids) for r in reqs] == [32, 41, 4]  # ceil(1300 * 16 / 512) = 41
    assert reqs[1].token_ids[:32] == reqs[0].token_ids
    assert reqs[1].token_ids[32:] == TokenBlocks(16).block(3)[:9]
    assert reqs[2].token_ids != reqs[0].token_ids[:4]
    assert [r.max_tokens for r in reqs] == [50, 64, 5]
    assert [r.planned_time for r in reqs] == [0.0, 0.5, 2.0]
    assert scaled_input_length(rows[1], 512) == 1300
    window = trace_requests(rows, TokenBlocks(16), TraceOptions(16, start_s=0.2, window_s=1.0))
    assert [r.trace_timestamp_ms for r in window] == [1500.0]
    assert len(trace_requests(rows, TokenBlocks(16), TraceOptions(16, limit=2))) == 2


def test_shared_prefix_groups_and_multi_turn_growth() -> None:
    spec = SharedPrefixSpec(
        num_groups=3,
        prompts_per_group=4,
        system_prompt_len=40,
        question_len=8,
        output_len=5,
        turns=3,
    )
    reqs = shared_prefix_requests(spec, TokenBlocks(1))
    assert len(reqs) == 3 * 4 * 3
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(tuple(r.token_ids[:40]))
        assert r.max_tokens == 5
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({p for s in by_group.values() for p in s}) == 3
    assert sum(r.turn == 0 for r in reqs) == 12
    assert [r.turn for r in reqs] == sorted(r.turn for r in reqs)  # turn t+1 after turn t
    # Every later turn extends exactly one earlier turn of the same conversation.
    for r in reqs:
        if r.turn:
            assert len(r.token_ids) == 40 + (r.turn + 1) * 8 + r.turn * 5
            parents = [
                p
                for p in reqs
                if p.turn == r.turn - 1 and r.token_ids[: len(p.token_ids)] == p.token_ids
            ]
            assert len(parents) == 1
    assert shared_prefix_requests(spec, TokenBlocks(1))[5].token_ids == reqs[5].token_ids


def test_zipf_skews_group_popularity_and_random_prompts_are_unique() -> None:
    spec = SharedPrefixSpec(
        num_groups=10, prompts_per_group=50, system_prompt_len=4, question_len=2, zipf=1.5
    )
    counts = [0] * 10
    for r in shared_prefix_requests(spec, TokenBlocks(1)):
        counts[r.group] += 1
    assert counts[0] > 3 * counts[9]
    reqs = random_requests(RandomSpec(20, 30, 7, range_ratio=0.5), TokenBlocks(1))
    assert len({tuple(r.token_ids[:8]) for r in reqs}) == 20
    assert all(15 <= len(r.token_ids) <= 45 and 3 <= r.max_tokens <= 10 for r in reqs)


def test_arrival_schedules() -> None:
    def make(n: int) -> list[LoadRequest]:
        return [LoadRequest(i, [1], 1, planned_time=float(i)) for i in range(n)]

    reqs = make(2000)
    schedule(reqs, ArrivalSpec("poisson", rate=100.0))
    times = [r.planned_time for r in reqs]
    assert times[0] == 0.0 and times == sorted(times)
    assert 18.0 < times[-1] < 22.0  # 2000 requests at 100/s
    bursty, smooth = make(2000), make(2000)
    schedule(bursty, ArrivalSpec("gamma", rate=100.0, burstiness=0.2))
    schedule(smooth, ArrivalSpec("gamma", rate=100.0, burstiness=5.0))

    def gap_cv(rs: list[LoadRequest]) -> float:
        import numpy as np

        gaps = np.diff([r.planned_time for r in rs])
        return float(gaps.std() / gaps.mean())

    assert gap_cv(bursty) > 1.5 > 0.7 > gap_cv(smooth)
    trace = make(5)
    schedule(trace, ArrivalSpec("trace", speedup=2.0))
    assert [r.planned_time for r in trace] == [0.0, 0.5, 1.0, 1.5, 2.0]
    closed = make(3)
    schedule(closed, ArrivalSpec("closed", concurrency=2))
    assert all(r.planned_time is None for r in closed)
    with pytest.raises(ValueError, match="arrival must be one of"):
        schedule(make(1), ArrivalSpec("uniform"))


# --- statistics --------------------------------------------------------------------------------


def test_best_hit_rate_counts_leading_blocks_seen_before() -> None:
    a = LoadRequest(0, list(range(40)), 1)  # blocks of 16: [0..15], [16..31], partial
    b = LoadRequest(1, list(range(32)) + [99] * 17, 1)  # 2 blocks shared, then new
    c = LoadRequest(2, list(range(32)), 1)  # fully seen, but the last token is never cached
    d = LoadRequest(3, list(range(40)), 1, cache_salt="other")  # another tenant: nothing
    best = best_hit_rate([a, b, c, d], block_size=16)
    assert best.prompt_tokens == 40 + 49 + 32 + 40
    assert best.cacheable_tokens == 0 + 32 + 16 + 0
    warm = best_hit_rate([c], 16, warmup=[a])
    assert (warm.prompt_tokens, warm.cacheable_tokens) == (32, 16)


def test_slo_parsing_and_goodput() -> None:
    slo = parse_slo("ttft=500ms, tpot=0.05s,e2e=2000")
    assert slo == Slo(ttft=0.5, tpot=0.05, e2e=2.0)
    with pytest.raises(ValueError, match="bad --slo item"):
        parse_slo("latency=5")
    fast = RequestResult(0, send_time=0.0, first_token_time=0.1, end_time=0.5, output_tokens=11)
    slow = RequestResult(1, send_time=0.0, first_token_time=0.9, end_time=1.0, output_tokens=11)
    failed = RequestResult(2, status="UNAVAILABLE", end_time=0.2)
    assert fast.tpot == pytest.approx(0.04)
    assert slo.met_by(fast) and not slo.met_by(slow) and not slo.met_by(failed)


def test_summary_percentiles_errors_and_warmup_exclusion() -> None:
    results = [
        RequestResult(
            i,
            send_time=float(i),
            first_token_time=i + 0.01 * (i + 1),
            end_time=i + 1.0,
            output_tokens=4,
            expected_output_tokens=4,
            prompt_tokens=100,
            cached_tokens=50,
            replica_id=f"r{i % 2}",
            finish_reason="length",
        )
        for i in range(10)
    ]
    results.append(RequestResult(10, status="UNAVAILABLE", send_time=10.0, end_time=10.5))
    results.append(RequestResult(11, warmup=True, send_time=0.0, end_time=99.0))
    s = summarize(results, parse_slo("ttft=55ms"))
    assert s["requests"]["sent"] == 11 and s["requests"]["ok"] == 10
    assert s["requests"]["by_status"] == {"OK": 10, "UNAVAILABLE": 1}
    assert s["requests"]["warmup"] == 1
    assert s["duration_s"] == pytest.approx(10.5)
    ttft = s["latency_ms"]["ttft"]
    assert ttft["mean"] == pytest.approx(55.0) and ttft["p50"] == pytest.approx(55.0)
    assert ttft["p99"] == pytest.approx(99.1)
    assert s["goodput"]["requests"] == 5
    assert s["hit_rate"] == 0.5
    assert s["per_replica"]["r0"]["requests"] == 5
    assert latency_stats([])["p50"] is None


def test_cluster_delta_handles_counters_and_resets() -> None:
    def snap(requests: int, prompt: int, cached: int, decisions: dict[str, int]) -> ClusterSnapshot:
        s = ClusterSnapshot("cache_aware", decisions=decisions)
        s.replicas["a"] = ReplicaCounters("a", "x:1", 16, requests, prompt, cached)
        s.routing = {"requests": requests, "prompt_tokens": prompt, "actual_cached_tokens": cached}
        return s

    d = cluster_delta(snap(10, 1000, 100, {"warm": 3}), snap(30, 3000, 1100, {"warm": 13}))
    assert d["replicas"]["a"]["requests"] == 20
    assert d["replicas"]["a"]["hit_rate"] == pytest.approx(0.5)
    assert d["decisions"] == {"warm": 10} and d["hit_rate"] == pytest.approx(0.5)
    reset = cluster_delta(snap(10, 1000, 100, {"warm": 3}), snap(4, 400, 40, {"cold": 4}))
    assert reset["replicas"]["a"]["requests"] == 4 and reset["decisions"] == {"cold": 4}


# --- runner with an in-memory client -----------------------------------------------------------


class FakeClient(GenerateClient):
    """Streams ``max_tokens`` tokens after ``delay`` s; request ``fail_index`` fails."""

    def __init__(self, delay: float = 0.0, fail_index: int = -1, hang_index: int = -1) -> None:
        self.delay, self.fail_index, self.hang_index = delay, fail_index, hang_index
        self.in_flight = self.max_in_flight = 0

    async def stream(self, request: LoadRequest, timeout: float | None) -> AsyncIterator[Chunk]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if request.index == self.fail_index:
                raise ClientError("RESOURCE_EXHAUSTED", "queue full")
            if request.index == self.hang_index:
                await asyncio.sleep(3600)
            for _ in range(request.max_tokens - 1):
                yield Chunk(1, replica_id="fake")
            yield Chunk(1, "length", len(request.token_ids), request.max_tokens, 0, "fake")
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        return None


def test_open_loop_does_not_wait_for_responses_and_records_errors() -> None:
    reqs = [LoadRequest(i, [5] * 8, 3, planned_time=0.002 * i) for i in range(20)]
    client = FakeClient(delay=0.05, fail_index=3)
    phase = asyncio.run(run_phase(client, reqs, RunLimits()))
    assert client.max_in_flight >= 10  # open loop: later requests left before earlier answers
    statuses = [r.status for r in phase.results]
    assert statuses.count("OK") == 19 and statuses[3] == "RESOURCE_EXHAUSTED"
    ok = [r for r in phase.results if r.ok]
    assert all(r.output_tokens == 3 and len(r.itl) == 2 and r.finish_reason == "length" for r in ok)
    assert all(r.send_lag is not None and r.send_lag >= 0 for r in phase.results)


def test_closed_loop_concurrency_and_time_bounds() -> None:
    reqs = [LoadRequest(i, [5], 2) for i in range(12)]
    client = FakeClient(delay=0.01)
    phase = asyncio.run(run_phase(client, reqs, RunLimits(concurrency=3)))
    assert client.max_in_flight == 3 and len(phase.results) == 12
    # A request that never finishes is cancelled at max_duration + drain_timeout; requests
    # planned after max_duration are not sent.
    timed = [LoadRequest(i, [5], 2, planned_time=0.01 * i) for i in range(3)]
    timed.append(LoadRequest(3, [5], 2, planned_time=5.0))
    phase = asyncio.run(
        run_phase(FakeClient(hang_index=1), timed, RunLimits(max_duration=0.2, drain_timeout=0.2))
    )
    assert [r.status for r in phase.results] == ["OK", "RUN_TIMEOUT", "OK"]
    assert phase.not_sent == 1 and phase.wall_s < 5


# --- the whole pipeline over gRPC against the echo server --------------------------------------


@pytest.fixture(scope="module")
def echo_target() -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    echo = Proc("echo", [sys.executable, "-m", "loadtest.echo_replica", "--tokens-per-message", "2",
                         "--port", address.rsplit(":", 1)[1]])  # fmt: skip
    try:
        wait_until([echo], lambda: echo.logs() == address, "echo replica", 30.0)  # it serves
        yield address
    finally:
        echo.stop()


def test_trace_replay_end_to_end(echo_target: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = loadtest_main(
        [
            "--target",
            echo_target,
            "--trace",
            str(SAMPLE_TRACE),
            "--tokens-per-hash-id",
            "16",
            "--max-output-tokens",
            "6",
            "--speedup",
            "50",
            "--limit",
            "60",
            "--warmup",
            "5",
            "--slo",
            "ttft=10s,tpot=1s",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 60 and sum(r["warmup"] for r in rows) == 5
    assert summary["requests"]["sent"] == summary["requests"]["ok"] == 55
    assert summary["requests"]["wrong_output_length"] == 0
    assert all(r["output_tokens"] == r["expected_output_tokens"] <= 6 for r in rows)
    assert summary["goodput"]["requests"] == 55
    # The echo server simulates an unlimited prefix cache, so routing to it reaches exactly the
    # best possible hit rate, and the Cluster deltas agree with the responses' usage.
    assert summary["cluster"]["replicas"]["echo-0"]["requests"] == 55
    assert summary["best_hit_rate"] > 0.3
    assert summary["cluster"]["hit_rate"] == pytest.approx(summary["best_hit_rate"])
    assert summary["hit_rate"] == pytest.approx(summary["best_hit_rate"])
    assert summary["block_size"] == 16
    assert all((out / name).stat().st_size > 0 for name in summary["plots"])


def test_compare_uses_a_fresh_cache_salt_per_policy(echo_target: str, tmp_path: Path) -> None:
    rc = loadtest_main(
        [
            "--target",
            echo_target,
            "--workload",
            "shared-prefix",
            "--num-groups",
            "3",
            "--prompts-per-group",
            "4",
            "--system-prompt-len",
            "64",
            "--question-len",
            "8",
            "--output-len",
            "4",
            "--turns",
            "2",
            "--arrival",
            "closed",
            "--concurrency",
            "4",
            "--compare",
            "cache_aware,round_robin",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--no-plots",
        ]
    )
    assert rc == 0
    policies = json.loads((tmp_path / "compare.json").read_text())["policies"]
    assert list(policies) == ["cache_aware", "round_robin"]
    salts = {s["cache_salt"] for s in policies.values()}
    assert len(salts) == 2
    for s in policies.values():
        assert s["requests"]["ok"] == 24
        assert s["cluster"]["policy"] in ("cache_aware", "round_robin")
        # No warming across runs: each policy run starts from a cold cache.
        assert s["cluster"]["hit_rate"] == pytest.approx(s["best_hit_rate"])
    assert (tmp_path / "round_robin" / "requests.jsonl").exists()


def test_loadtest_never_imports_torch() -> None:
    code = (
        "import sys, loadtest.cli, loadtest.bench, loadtest.overhead, "
        "loadtest.make_sample_trace; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sample_trace_is_reproducible(tmp_path: Path) -> None:
    from loadtest.make_sample_trace import main as make_trace

    assert make_trace(["--out", str(tmp_path / "t.jsonl")]) == 0
    assert (tmp_path / "t.jsonl").read_text() == SAMPLE_TRACE.read_text()
