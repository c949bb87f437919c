"""``python -m loadtest.chaos``: replay a trace through ``prefixmesh up`` while killing its parts.

Starts a cluster with ``prefixmesh up``'s defaults (plus ``--up-arg`` flags), replays a Mooncake
trace against the router at its own timestamps (``--speedup``), and on a schedule sends SIGKILL
to replicas, Redis or the router, as an operator's worst day would. ``up`` restarts what dies
(its default). Afterwards it reports requests sent / ok / failed / resumed (a stream that moved
to another replica mid-way: the router's failover), the failures by status, and the block-pool
integrity of every replica once idle (no block still referenced, no request in flight).

    python -m loadtest.chaos --replicas 3 --schedule replica-1@10,redis@20,replica-2@30 \\
        --limit 120 --speedup 2 --max-output-tokens 32 --out results/chaos.json

Schedule: comma-separated ``TARGET@SECONDS`` (seconds after the replay starts), TARGET one of
``replica-K``, ``redis``, ``router``. Clients do not retry (``--client-retries`` lets them retry
a failed request as a careful client does when the router itself restarts, resuming from the
tokens it already got with ``resume_token_ids``). Every request has a deadline (``--request-timeout``); the run is bounded by the
trace window and ``--limit``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from loadtest.tokens import DEFAULT_VOCAB_SIZE, TokenBlocks
from loadtest.trace import TraceOptions, read_trace, trace_requests
from loadtest.upcluster import UpCluster
from loadtest.workload import SAMPLE_TRACE
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

TARGETS = ("redis", "router")


@dataclass(frozen=True, slots=True)
class Kill:
    target: str
    at_s: float


def parse_schedule(text: str) -> list[Kill]:
    kills = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        target, sep, at = item.partition("@")
        if not sep or not (target in TARGETS or target.startswith("replica-")):
            raise ValueError(f"schedule item must be TARGET@SECONDS (got {item!r})")
        kills.append(Kill(target, float(at)))
    return sorted(kills, key=lambda k: k.at_s)


@dataclass(slots=True)
class Outcome:
    index: int
    status: str = "OK"
    replicas: list[str] = field(default_factory=list)  # in the order the stream used them
    tokens: int = 0
    client_retries: int = 0
    client_resumed: bool = False
    ttft_s: float | None = None
    detail: str = ""


@dataclass(slots=True)
class ChaosReport:
    sent: int
    ok: int
    failed: int
    resumed: int
    client_retried: int
    client_resumed: int
    failures: dict[str, int]
    failure_details: dict[str, int]
    kills: list[dict[str, object]]
    restarts_seen: dict[str, int]
    integrity: dict[str, dict[str, object]]
    wall_s: float
    command: str

    @property
    def integrity_ok(self) -> bool:
        return bool(self.integrity) and all(
            r["integrity_ok"] and r["used_blocks"] == 0 and r["inflight"] == 0
            for r in self.integrity.values()
        )


async def _one(
    stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest, out: Outcome, timeout_s: float,
    retries: int,
) -> None:  # fmt: skip
    """One request; with ``retries`` a failed attempt is sent again, and one that already
    streamed tokens resumes from them (``resume_token_ids`` + ``resume_text_chars``, the same
    contract the router uses for its own failover), so the client's text is never repeated."""
    started = time.perf_counter()
    received: list[int] = []
    chars = 0
    for attempt in range(retries + 1):
        out.client_retries = attempt
        sent = request
        if received:
            sent = pb.GenerateRequest()
            sent.CopyFrom(request)
            sent.resume_token_ids[:] = received
            sent.resume_text_chars = chars
            out.client_resumed = True
        try:
            async for msg in stub.Generate(sent, timeout=timeout_s):
                if msg.replica_id and (not out.replicas or out.replicas[-1] != msg.replica_id):
                    out.replicas.append(msg.replica_id)
                if msg.token_ids and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - started
                received.extend(msg.token_ids)
                chars += len(msg.text)
                out.tokens = len(received)
                if msg.finish_reason:
                    out.status = "OK"
                    return
            out.status = "INCOMPLETE"
            return
        except grpc.aio.AioRpcError as exc:
            out.status, out.detail = exc.code().name, exc.details() or ""
            if len(received) >= request.sampling.max_tokens:  # only the last message was lost
                out.status = "OK"
                return
            if attempt == retries:
                return
            await asyncio.sleep(0.5 * (attempt + 1))


async def replay(
    cluster: UpCluster, args: argparse.Namespace, kills: list[Kill]
) -> tuple[list[Outcome], list[dict[str, object]]]:
    rows = read_trace(args.trace)
    blocks = TokenBlocks(args.tokens_per_hash_id, vocab_size=args.vocab_size)
    opts = TraceOptions(
        tokens_per_hash_id=args.tokens_per_hash_id, max_output_tokens=args.max_output_tokens,
        max_input_tokens=args.max_input_tokens, limit=args.limit,
    )  # fmt: skip
    requests = trace_requests(rows, blocks, opts)
    outcomes = [Outcome(r.index) for r in requests]
    done: list[dict[str, object]] = []
    async with grpc.aio.insecure_channel(cluster.router) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        start = time.monotonic()

        async def killer() -> None:
            for kill in kills:
                await asyncio.sleep(max(0.0, start + kill.at_s - time.monotonic()))
                pid = cluster.kill(kill.target)
                at = round(time.monotonic() - start, 2)
                done.append({"target": kill.target, "pid": pid, "at_s": at})
                print(f"[{at:7.2f}s] kill -9 {kill.target} (pid {pid})", flush=True)

        async def send(r, out: Outcome) -> None:  # noqa: ANN001
            await asyncio.sleep(max(0.0, start + r.planned_time / args.speedup - time.monotonic()))
            request = pb.GenerateRequest(
                request_id=f"chaos-{r.index}", token_ids=pb.TokenIds(ids=r.token_ids),
                sampling=pb.SamplingParams(max_tokens=r.max_tokens, temperature=0,
                                           ignore_eos=True),
            )  # fmt: skip
            await _one(stub, request, out, args.request_timeout, args.client_retries)

        kill_task = asyncio.ensure_future(killer())
        await asyncio.gather(*(send(r, o) for r, o in zip(requests, outcomes, strict=True)))
        if not kill_task.done():  # the replay ended before the schedule did
            kill_task.cancel()
    return outcomes, done


def summarize(
    outcomes: list[Outcome], kills: list[dict[str, object]], cluster: UpCluster, wall_s: float,
    command: str,
) -> ChaosReport:  # fmt: skip
    failures = collections.Counter(o.status for o in outcomes if o.status != "OK")
    details = collections.Counter(f"{o.status}: {o.detail[:120]}" for o in outcomes if o.detail)
    log = cluster.log()
    restarts = {k["target"]: log.count(f"restarting {k['target']} in") for k in kills}
    states = cluster.cache_states()
    integrity = {
        rid: {
            "integrity_ok": s.integrity_ok, "integrity_error": s.integrity_error,
            "used_blocks": s.used_blocks, "free_blocks": s.free_blocks,
            "num_blocks": s.num_blocks, "inflight": s.inflight_requests,
        }
        for rid, s in sorted(states.items())
    }  # fmt: skip
    return ChaosReport(
        sent=len(outcomes),
        ok=sum(o.status == "OK" for o in outcomes),
        failed=sum(o.status != "OK" for o in outcomes),
        resumed=sum(len(o.replicas) > 1 for o in outcomes),
        client_retried=sum(o.client_retries > 0 for o in outcomes),
        client_resumed=sum(o.client_resumed for o in outcomes),
        failures=dict(failures),
        failure_details=dict(details.most_common(5)),
        kills=kills,
        restarts_seen={str(k): v for k, v in restarts.items()},
        integrity=integrity,
        wall_s=round(wall_s, 1),
        command=command,
    )


def print_report(report: ChaosReport) -> None:
    print(
        f"sent {report.sent}  ok {report.ok}  failed {report.failed}  resumed {report.resumed}  "
        f"client-retried {report.client_retried} (resumed {report.client_resumed})  "
        f"({report.wall_s}s)"
    )
    if report.failures:
        print("failures: " + ", ".join(f"{k} {v}" for k, v in sorted(report.failures.items())))
        for detail, count in report.failure_details.items():
            print(f"  {count} x {detail}")
    for kill in report.kills:
        print(f"killed {kill['target']} at {kill['at_s']}s")
    print("restarts seen in up's log: "
          + ", ".join(f"{k} {v}" for k, v in report.restarts_seen.items()))  # fmt: skip
    for rid, r in report.integrity.items():
        print(f"{rid}: integrity {'ok' if r['integrity_ok'] else r['integrity_error']}, "
              f"{r['used_blocks']} blocks used, {r['inflight']} in flight")  # fmt: skip
    print("block integrity on every replica:", "OK" if report.integrity_ok else "FAILED")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.chaos",
        description="Replay a trace through a `prefixmesh up` cluster (its defaults) while "
        "killing replicas, Redis and the router on a schedule; report what survived.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="model of every replica")
    p.add_argument("--replicas", type=int, default=3, help="replicas `up` starts")
    p.add_argument(
        "--schedule",
        default="replica-1@10,redis@20,replica-2@30",
        help="comma-separated TARGET@SECONDS kills (replica-K, redis, router)",
    )
    p.add_argument(
        "--up-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for `prefixmesh up` (repeat; e.g. --up-arg=--no-restart)",
    )
    p.add_argument("--trace", default=str(SAMPLE_TRACE), help="Mooncake trace (JSONL)")
    p.add_argument("--limit", type=int, default=120, help="requests replayed")
    p.add_argument("--speedup", type=float, default=2.0, help="trace time / replay time")
    p.add_argument(
        "--tokens-per-hash-id",
        type=int,
        default=16,
        help="tokens per trace block (shrinks 512-token Mooncake blocks)",
    )
    p.add_argument("--max-input-tokens", type=int, default=1024, help="prompt length cap")
    p.add_argument("--max-output-tokens", type=int, default=32, help="output length cap")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="token ids are drawn below this (the model's vocabulary)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline per request")
    p.add_argument(
        "--client-retries",
        type=int,
        default=0,
        help="retries of a request that failed before its first token",
    )
    p.add_argument("--out", default="", help="write the report as JSON here")
    return p  # fmt: skip


def run(args: argparse.Namespace, argv: list[str]) -> ChaosReport:
    kills = parse_schedule(args.schedule)
    cluster = UpCluster(args.model, args.replicas, tuple(args.up_arg))
    print(f"starting prefixmesh up ({args.replicas} replicas of {args.model}) ...", flush=True)
    cluster.start()
    try:
        started = time.monotonic()
        outcomes, done = asyncio.run(replay(cluster, args, kills))
        wall = time.monotonic() - started
        command = "python -m loadtest.chaos " + " ".join(argv)
        report = summarize(outcomes, done, cluster, wall, command)
    finally:
        code = cluster.stop()
        print(f"prefixmesh up exited with {code}; its log: {cluster.log_path}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        parse_schedule(args.schedule)
    except ValueError as exc:
        print(f"loadtest.chaos: {exc}", file=sys.stderr)
        return 2
    report = run(args, argv)
    print_report(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.failed == 0 and report.integrity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
