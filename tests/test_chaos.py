"""The chaos benchmark as a test: `prefixmesh up` with its defaults (2 tiny replicas) keeps
every request through a kill -9 of a replica and of Redis during a trace replay, and every
replica's block pool is intact afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import chaos

pytestmark = pytest.mark.cluster


def test_schedule_parsing():
    assert chaos.parse_schedule("redis@6, replica-1@3") == [
        chaos.Kill("replica-1", 3.0),
        chaos.Kill("redis", 6.0),
    ]
    for bad in ("redis", "web@3", "redis@soon"):
        with pytest.raises(ValueError):
            chaos.parse_schedule(bad)


def test_kill9_of_a_replica_and_redis_under_up_defaults_loses_nothing(
    tiny_model_dir: Path, tiny_model_files
):
    vocab = tiny_model_files.config.vocab_size  # token ids must be real tokens of the model
    argv = [
        "--model", str(tiny_model_dir), "--replicas", "2", "--schedule", "replica-1@3,redis@6",
        "--limit", "80", "--speedup", "2", "--max-output-tokens", "16",
        "--vocab-size", str(vocab), "--request-timeout", "120",
    ]  # fmt: skip
    args = chaos.build_parser().parse_args(argv)
    report = chaos.run(args, argv)
    chaos.print_report(report)
    assert [k["target"] for k in report.kills] == ["replica-1", "redis"], report.kills
    assert report.sent == 80
    assert report.failed == 0, report.failure_details
    assert all(n >= 1 for n in report.restarts_seen.values()), report.restarts_seen
    assert report.integrity_ok, report.integrity
