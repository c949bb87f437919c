"""The load tester's text prompts (``--prompt-format text``): one fixed sentence per trace hash
id, sent as ``prompt`` text over OpenAI HTTP (for routers that match text, like sglang-router)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from helpers import Proc, free_port, start_redis, stop_all

from loadtest.cli import build_parser
from loadtest.cli import main as loadtest_main
from loadtest.grpc_client import build_request
from loadtest.http_client import build_body
from loadtest.text import WORDS, TextBlocks, trace_text
from loadtest.workload import build_workload

# Rows sharing hash ids 1, 2 (and 3): shared prefixes of 2 and 3 blocks.
ROWS = [(0, (1, 2, 3)), (100, (1, 2, 4)), (200, (1, 2, 3, 5)), (300, (6,)), (400, (1, 2, 3))]


def _write_trace(path: Path, input_tokens_per_block: int = 512) -> Path:
    with path.open("w") as f:
        for ts, ids in ROWS:
            row = {"timestamp": ts, "input_length": len(ids) * input_tokens_per_block,
                   "output_length": 3, "hash_ids": list(ids)}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


def test_same_hash_id_same_sentence() -> None:
    a, b = TextBlocks(15, seed=0), TextBlocks(15, seed=0)
    assert a.block(7) == b.block(7) == a.block(7)  # across instances and calls
    assert a.block(7) != a.block(8)
    assert TextBlocks(15, seed=1).block(7) != a.block(7)
    words = a.block(7).strip().rstrip(".").split()
    assert len(words) == 15 and set(words) <= set(WORDS)
    assert a.block(7).startswith(" ") and a.block(7).endswith(".")
    assert a.prefix(7, 4) == " " + " ".join(words[:4])
    assert a.prefix(7, 99) == a.block(7)


def test_trace_text_keeps_shared_prefixes() -> None:
    t = TextBlocks(15)
    one = trace_text((1, 2, 3), 48, 16, t)
    two = trace_text((1, 2, 4), 48, 16, t)
    shared = (t.block(1) + t.block(2)).lstrip(" ")
    assert one.startswith(shared) and two.startswith(shared)
    assert one == shared + t.block(3) and two == shared + t.block(4)
    # a last block cut to 8 of 16 tokens keeps about half of its words
    assert trace_text((1, 2, 3), 40, 16, t) == shared + t.prefix(3, 8)
    assert trace_text((), 20, 16, t) == trace_text((), 20, 16, t)  # no hash ids: still fixed


def _args(trace: Path, *extra: str) -> argparse.Namespace:
    args = build_parser().parse_args(["--trace", str(trace), "--arrival", "closed", *extra])
    args.workload = "trace"
    return args


def test_workload_text_mode(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    reqs = build_workload(_args(trace, "--prompt-format", "text"))
    assert [r.text is not None for r in reqs] == [True] * len(ROWS)
    assert reqs[0].text == reqs[4].text  # the same hash ids: the same prompt
    assert reqs[2].text.startswith(reqs[0].text)
    assert build_body(reqs[0], "m")["prompt"] == reqs[0].text
    assert build_request(reqs[0]).text == reqs[0].text
    # token ids stay the default, and the token twin keeps the same block structure
    plain = build_workload(_args(trace))
    assert all(r.text is None for r in plain)
    assert [len(r.token_ids) for r in plain] == [len(r.token_ids) for r in reqs]
    assert build_body(plain[0], "m")["prompt"] == plain[0].token_ids
    with pytest.raises(ValueError, match="needs a trace"):
        args = _args(trace, "--prompt-format", "text")
        args.workload = "shared-prefix"
        build_workload(args)


@pytest.mark.cluster
def test_text_prompts_against_a_replica_over_http(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real replica's ``/v1/completions`` serves the text prompts; the hit rate comes from
    its usage (``prompt_tokens_details.cached_tokens``): the repeated prefixes hit."""
    trace = _write_trace(tmp_path / "t.jsonl")
    redis = start_redis()
    rg, rh = free_port(), free_port()
    procs = [
        Proc.cli(
            "t0",
            *[
                "replica",
                "--port",
                str(rg),
                "--http-port",
                str(rh),
                "--redis",
                redis.url,
                "--model",
                str(tiny_model_dir),
                "--replica-id",
                "t0",
                "--threads",
                "1",
                "--num-blocks",
                "256",
            ],
        )  # fmt: skip
    ]
    try:
        procs[0].wait_serving(f"127.0.0.1:{rg}", 120.0)
        rc = loadtest_main([
            "--target", f"http://127.0.0.1:{rh}", "--cluster", "none", "--model", "tiny",
            "--trace", str(trace), "--prompt-format", "text", "--arrival", "closed",
            "--concurrency", "1", "--max-output-tokens", "3", "--out", str(tmp_path / "out"),
            "--no-progress", "--no-plots", "--request-timeout", "60", "--max-duration", "60",
        ])  # fmt: skip
        assert rc == 0
    finally:
        stop_all(procs)
        redis.stop()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["requests"]["ok"] == len(ROWS)
    assert summary["settings"]["prompt_format"] == "text"
    rows = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").open()]
    # the replica tokenized the text itself: prompt lengths are its counts, not the token twin's
    assert rows[0]["prompt_tokens"] == rows[4]["prompt_tokens"] > 0
    assert rows[0]["cached_tokens"] == 0 and rows[4]["cached_tokens"] > 0
    assert rows[2]["cached_tokens"] > 0  # shares hash ids 1, 2, 3 with the first request
    assert summary["hit_rate"] > 0
