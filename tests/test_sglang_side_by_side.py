"""``python -m loadtest.sglang_side_by_side``: both routers get the same load tester command.
(The comparison itself needs sglang-router, which is not a project dependency.)"""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import sglang_side_by_side as sbs
from loadtest.request import RequestResult
from loadtest.summary import summarize


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_a_closed_loop_by_default_and_trace_arrivals_on_request() -> None:
    closed = sbs.build_parser().parse_args(["--limit", "300", "--concurrency", "4"])
    argv = sbs.loadtest_argv(closed, "127.0.0.1:1", "127.0.0.1:2", Path("o"))
    assert _flag(argv, "--arrival") == "closed" and _flag(argv, "--concurrency") == "4"
    assert "--speedup" not in argv and _flag(argv, "--limit") == "300"
    assert _flag(argv, "--prompt-format") == "text"

    paced = sbs.build_parser().parse_args(
        ["--arrival", "trace", "--speedup", "2", "--trace-start", "781.6"]
    )
    argv = sbs.loadtest_argv(paced, "127.0.0.1:1", "127.0.0.1:2", Path("o"))
    assert _flag(argv, "--arrival") == "trace" and _flag(argv, "--speedup") == "2.0"
    assert "--concurrency" not in argv and _flag(argv, "--trace-start") == "781.6"


def test_the_report_counts_fetched_tokens_from_the_replicas_usage() -> None:
    """A claim that fetches cost or saved time needs the fetch count next to it."""
    results = [
        RequestResult(index=i, send_time=0.0, first_token_time=0.5, end_time=1.0,
                      prompt_tokens=64, output_tokens=4, expected_output_tokens=4,
                      cached_tokens=32, fetched_tokens=fetched, replica_id=f"replica-{i}")
        for i, fetched in enumerate([16, 0, 32])
    ]  # fmt: skip
    r = sbs.row("prefixmesh", summarize(results))
    assert r["fetched_tokens"] == 48 and r["hit_rate"] == 0.5
    table = sbs.markdown([r]).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert len(header) == len(cells) == table[1].count("---")
    assert dict(zip(header, cells))["fetched tokens"] == "48"


def test_requests_whose_cached_tokens_differ_between_the_two_runs() -> None:
    def run(cached: list[int]) -> list[dict]:
        return [{"index": i, "cached_tokens": c} for i, c in enumerate(cached)]

    a = run([0, 64, 1200, 32, 0, 16, 16, 16, 16])
    b = run([0, 64, 0, 48, 0, 0, 0, 0, 0])
    d = sbs.differing(a, b)
    assert d["requests"] == 9 and d["differ"] == 6
    assert d["net_cached_tokens"] == 1200 - 16 + 4 * 16
    # The five largest: 1200, 16, 16, 16, 16 of 1200 + 16 + 4 * 16 in all.
    assert d["top5_share"] == (1200 + 4 * 16) / (1200 + 16 + 4 * 16)
    assert sbs.differing(a, a)["differ"] == 0 and sbs.differing(a, a)["top5_share"] == 0.0
    # A request the other run lacks (a failed one, say) is left out, not counted as a gap.
    assert sbs.differing(a, b[:3])["requests"] == 3


def test_the_two_runs_are_compared_from_their_request_files(tmp_path) -> None:
    from loadtest.results import write_requests

    def run(cached: list[int]) -> list[RequestResult]:
        return [
            RequestResult(index=i, send_time=0.0, first_token_time=0.5, end_time=1.0,
                          prompt_tokens=64, output_tokens=4, expected_output_tokens=4,
                          cached_tokens=c, replica_id="replica-0")
            for i, c in enumerate(cached)
        ]  # fmt: skip

    write_requests(run([0, 32, 48]), tmp_path / "sglang" / "requests.jsonl")
    write_requests(run([0, 48, 48]), tmp_path / "prefixmesh" / "requests.jsonl")
    line = sbs.compare_runs(tmp_path, ["sglang", "prefixmesh"])
    assert line.startswith("cached tokens differ on 1 of 3 requests (sglang less prefixmesh: -16")
    saved = json.loads((tmp_path / "differing.json").read_text())
    assert saved == {"requests": 3, "differ": 1, "net_cached_tokens": -16, "top5_share": 1.0}
