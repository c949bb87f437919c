"""``python -m loadtest.two_routers`` and the load tester's ``--shard``: one router against two
on one Redis, clients alternating between them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import two_routers
from loadtest.ceilings import ceilings_summary
from loadtest.cli import build_parser as loadtest_parser
from loadtest.workload import SAMPLE_TRACE, build_workload


def _workload(*flags: str):
    args = loadtest_parser().parse_args(["--trace", str(SAMPLE_TRACE), *flags])
    args.workload = "trace"
    return build_workload(args)


def test_a_shard_sends_every_nth_request_at_its_time_in_the_whole_workload() -> None:
    whole = _workload("--limit", "9", "--speedup", "2")
    odd = _workload("--limit", "9", "--speedup", "2", "--shard", "1/2")
    assert [r.index for r in odd] == [1, 3, 5, 7]
    assert [r.planned_time for r in odd] == [whole[i].planned_time for i in (1, 3, 5, 7)]
    assert odd[0].planned_time > 0  # not moved to the shard's own start
    assert [r.token_ids for r in odd] == [whole[i].token_ids for i in (1, 3, 5, 7)]
    even = _workload("--limit", "9", "--arrival", "closed", "--shard", "0/2")
    assert [r.index for r in even] == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("bad", ["2/2", "-1/2", "1", "a/b", "0/0"])
def test_a_shard_out_of_range_is_refused_with_what_to_write(bad: str, capsys) -> None:
    with pytest.raises(SystemExit):
        loadtest_parser().parse_args(["--shard", bad])
    assert "--shard" in capsys.readouterr().err


def _row(i: int, replica: str, prompt: int, cached: int, ttft: float, ok: bool = True) -> dict:
    return {"index": i, "replica_id": replica, "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft": ttft, "status": "OK" if ok else "UNAVAILABLE"}  # fmt: skip


def test_a_mode_combines_its_routers_requests() -> None:
    router0 = [_row(0, "r0", 100, 0, 1.0), _row(2, "r0", 100, 80, 0.2), _row(4, "r1", 50, 0, 3.0)]
    router1 = [_row(1, "r1", 100, 50, 0.5), _row(3, "r0", 100, 100, 0.1, ok=False)]
    got = two_routers.combine([router0, router1], replicas=3)
    assert got["requests_ok"] == 4 and got["failed"] == 1
    assert got["prompt_tokens"] == 350 and got["cached_tokens"] == 130
    assert got["hit_rate"] == pytest.approx(130 / 350)
    assert got["per_router_hit_rate"] == [pytest.approx(80 / 250), pytest.approx(0.5)]
    # r0: 2 requests, r1: 2, the third replica none: the mean counts it
    assert got["per_replica_requests"] == {"r0": 2, "r1": 2}
    assert got["max_over_mean_requests"] == pytest.approx(2 / (4 / 3))
    assert got["ttft_p50_s"] == pytest.approx((0.5 + 1.0) / 2)
    table = two_routers.markdown([{"mode": "two", **got, "capacity_aware": 0.5}]).splitlines()
    assert "| two | 4 | 37.1% | 74.3% | 32.0% / 50.0% | 2 / 2 | 1.50 | 0.75 s |" == table[2]


def test_both_modes_are_judged_against_the_whole_windows_ceilings(tmp_path: Path) -> None:
    args = two_routers.build_parser().parse_args(
        ["--trace", str(SAMPLE_TRACE), "--limit", "40", "--arrival", "trace"]
    )
    argv = two_routers.loadtest_argv(
        args, "127.0.0.1:1", "127.0.0.1:1", tmp_path, prompt_format="token-ids",
        extra=("--shard", "1/2"),
    )  # fmt: skip
    got = two_routers.window_ceilings(argv, 16, 64)
    want = ceilings_summary(_workload("--limit", "40", "--max-output-tokens", "4"), 16, 64)
    assert got == want and got["capacity_aware"] < got["unlimited"]


@pytest.mark.cluster
def test_two_routers_on_one_redis_keep_what_one_keeps(tiny_model_dir: Path, tmp_path: Path):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    rc = two_routers.main([
        "--model", str(tiny_model_dir), "--trace", str(SAMPLE_TRACE), "--limit", "48",
        "--concurrency", "4", "--startup-timeout", "180", "--replica-arg=--num-blocks=512",
        f"--loadtest-arg=--vocab-size={vocab}", "--loadtest-arg=--min-token-id=3",
        "--out", str(tmp_path),
    ])  # fmt: skip
    assert rc == 0
    one, two = json.loads((tmp_path / "two_routers.json").read_text())
    assert (one["mode"], two["mode"]) == ("one", "two")
    assert one["requests_ok"] == two["requests_ok"] == 48
    # Each router served its half of the window, and the mode's numbers are theirs together.
    halves = [
        [json.loads(line) for line in (tmp_path / "two" / f"router-{k}" / "requests.jsonl").open()]
        for k in (0, 1)
    ]
    assert [[r["index"] % 2 for r in rows] for rows in halves] == [[0] * 24, [1] * 24]
    assert two["cached_tokens"] == sum(r["cached_tokens"] for rows in halves for r in rows)
    assert 0 < two["hit_rate"] <= two["unlimited"] + 1e-9
    assert two["capacity_aware"] == one["capacity_aware"] > 0.5  # the sample trace shares a lot
    # The routers share the map and each other's decisions through Redis: blind to each
    # other they would warm every prefix twice, as two separate clusters would.
    assert two["hit_rate"] > one["hit_rate"] - 0.1


def test_an_unknown_mode_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    assert two_routers.main(["--order", "one,three", "--out", str(tmp_path / "o")]) == 2
    assert "unknown names ['three'] (known: one, two)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
