"""``python -m loadtest.fairness``: does one flooding tenant starve another?

Starts ``prefixmesh up`` (tenant caps on the router and the replicas from ``--tenant-max-
concurrent`` / ``--tenant-max-queued-tokens``; 0 = no caps, the baseline), then measures the
time to first token of a calm tenant (``cache_salt`` "calm": a Poisson stream of short
requests) twice: alone, and while a flooding tenant ("flood": ``--flood-workers`` closed-loop
workers sending long prompts back to back, retrying at once when refused) runs beside it. It
reports the calm tenant's TTFT percentiles in both phases, their ratio (the issue's bar: p99
within 1.5x of running alone), what the flood got done and how often it was refused, and the
router's ``prefixmesh_tenant_rejections_total`` counters.

    python -m loadtest.fairness --tenant-max-concurrent 4 --tenant-max-queued-tokens 512
    python -m loadtest.fairness --tenant-max-concurrent 0 --tenant-max-queued-tokens 0  # baseline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from loadtest.tokens import DEFAULT_VOCAB_SIZE, TokenBlocks
from loadtest.upcluster import UpCluster
from prefixmesh.limits import retry_after
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc


@dataclass(slots=True)
class Phase:
    name: str
    calm_ok: int
    calm_failed: int
    calm_refused: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    flood_ok: int = 0
    flood_refused: int = 0
    flood_failed: int = 0
    ttfts_s: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "ttfts_s"}

    @classmethod
    def pooled(cls, name: str, phases: list[Phase]) -> Phase:
        """All rounds' calm requests as one sample (p99 of 40 is their maximum)."""
        ttfts = [t for p in phases for t in p.ttfts_s]
        return cls(
            name=name, calm_ok=len(ttfts), calm_failed=sum(p.calm_failed for p in phases),
            calm_refused=sum(p.calm_refused for p in phases),
            ttft_p50_s=round(_pct(ttfts, 0.5), 4), ttft_p90_s=round(_pct(ttfts, 0.9), 4),
            ttft_p99_s=round(_pct(ttfts, 0.99), 4),
            flood_ok=sum(p.flood_ok for p in phases),
            flood_refused=sum(p.flood_refused for p in phases),
            flood_failed=sum(p.flood_failed for p in phases), ttfts_s=ttfts,
        )  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _ttft(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest) -> float:
    started = time.perf_counter()
    first = None
    async for msg in stub.Generate(request, timeout=300):
        if msg.token_ids and first is None:
            first = time.perf_counter() - started
    return first if first is not None else float("nan")


async def measure(router: str, args: argparse.Namespace, flood: bool, seed: int) -> Phase:
    blocks = TokenBlocks(16, vocab_size=args.vocab_size)
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        stop = asyncio.Event()
        counts = {"ok": 0, "refused": 0, "failed": 0}

        async def flooder(w: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=blocks.random(args.flood_prompt, 1, seed, w, i)),
                    cache_salt="flood",
                    sampling=pb.SamplingParams(max_tokens=args.flood_output, temperature=0,
                                               ignore_eos=True),
                )  # fmt: skip
                try:
                    async for _ in stub.Generate(request, timeout=300):
                        pass
                    counts["ok"] += 1
                except grpc.aio.AioRpcError as exc:
                    key = (
                        "refused" if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"
                    )
                    counts[key] += 1
                    hint = retry_after(exc.trailing_metadata())
                    # A client that honours the retry-after hint, or (--flood-ignores-retry-
                    # after) one that comes straight back; on one machine the latter's refused
                    # calls compete with the servers for the same cores.
                    wait = 0.05 if args.flood_ignores_retry_after or hint is None else float(hint)
                    await asyncio.sleep(wait)

        workers = [
            asyncio.ensure_future(flooder(w)) for w in range(args.flood_workers if flood else 0)
        ]
        if flood:
            await asyncio.sleep(args.flood_head_start)
        ttfts: list[float] = []
        failed = refused = 0

        async def calm(i: int, at: float) -> None:
            nonlocal failed, refused
            await asyncio.sleep(at)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=blocks.random(args.calm_prompt, 2, seed, i)),
                cache_salt="calm",
                sampling=pb.SamplingParams(max_tokens=args.calm_output, temperature=0,
                                           ignore_eos=True),
            )  # fmt: skip
            try:
                ttfts.append(await _ttft(stub, request))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused += 1  # over its own cap: its rate is too high for the cap
                else:
                    failed += 1

        at, schedule = 0.0, []
        for i in range(args.calm_requests):
            at += rng.expovariate(args.calm_rate)
            schedule.append(calm(i, at))
        await asyncio.gather(*schedule)
        stop.set()
        await asyncio.gather(*workers)
    return Phase(
        name="with flood" if flood else "alone", calm_ok=len(ttfts), calm_failed=failed,
        calm_refused=refused,
        ttft_p50_s=round(_pct(ttfts, 0.5), 4), ttft_p90_s=round(_pct(ttfts, 0.9), 4),
        ttft_p99_s=round(_pct(ttfts, 0.99), 4), flood_ok=counts["ok"],
        flood_refused=counts["refused"], flood_failed=counts["failed"],
        ttfts_s=[round(t, 4) for t in ttfts],
    )  # fmt: skip


def _raise_control_plane(cluster: UpCluster) -> list[str]:
    """Under ``chrt -f``: Redis and the router one real-time priority above the replica (every
    thread). Every child inherits SCHED_FIFO, and a replica's forward keeps its core until it
    blocks, so the light processes on each request's path waited behind it, as did anything
    else on a shared machine running at the same priority: Redis timed out and requests stalled
    for seconds (loadtest/sglang_side_by_side.py does the same)."""
    if os.sched_getscheduler(0) != os.SCHED_FIFO:
        return []
    param = os.sched_param(os.sched_getparam(0).sched_priority + 1)
    raised = []
    for name in ("redis", "router"):
        pid = cluster.pid(name)
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setscheduler(int(tid), os.SCHED_FIFO, param)
        raised.append(name)
    return raised


def _rejections(http_port: int) -> list[str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return []
    return [line for line in text.splitlines()
            if line.startswith("prefixmesh_tenant_rejections_total{")]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.fairness",
        description="Calm tenant's TTFT alone vs beside a flooding tenant, through prefixmesh up.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument(
        "--tenant-max-concurrent",
        type=int,
        default=4,
        help="cap per tenant on router and replicas (0 = none: the baseline)",
    )
    p.add_argument(
        "--tenant-max-queued-tokens",
        type=int,
        default=512,
        help="queued prompt tokens cap per tenant (0 = none)",
    )
    p.add_argument("--calm-requests", type=int, default=40)
    p.add_argument("--calm-rate", type=float, default=1.0, help="calm requests per second")
    p.add_argument("--calm-prompt", type=int, default=64)
    p.add_argument("--calm-output", type=int, default=4)
    p.add_argument("--flood-workers", type=int, default=16)
    p.add_argument("--flood-prompt", type=int, default=384)
    p.add_argument("--flood-output", type=int, default=32)
    p.add_argument(
        "--flood-head-start",
        type=float,
        default=3.0,
        help="seconds the flood runs before the calm tenant starts",
    )
    p.add_argument(
        "--flood-ignores-retry-after",
        action="store_true",
        help="the flood retries after 50 ms instead of the server's retry-after",
    )
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alone / with-flood pairs in one cluster; more than one: percentiles pooled",
    )
    p.add_argument("--up-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--out", default="")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    caps = []
    for flag in ("tenant-max-concurrent", "tenant-max-queued-tokens"):
        value = getattr(args, flag.replace("-", "_"))
        caps += [f"--replica-arg=--{flag}={value}", f"--router-arg=--{flag}={value}"]
    cluster = UpCluster(args.model, args.replicas, (*caps, *args.up_arg))
    print(f"starting prefixmesh up ({args.replicas} x {args.model}), caps: "
          f"concurrent {args.tenant_max_concurrent}, queued tokens "
          f"{args.tenant_max_queued_tokens} ...", flush=True)  # fmt: skip
    cluster.start()
    if raised := _raise_control_plane(cluster):
        print(f"{' and '.join(raised)}: real-time priority {os.sched_getparam(0).sched_priority + 1}"
              " (the replica's forward no longer holds them back)", flush=True)  # fmt: skip
    alones: list[Phase] = []
    crowds: list[Phase] = []
    try:
        # Rounds alternate alone / with flood in one cluster, so noise from the machine falls on
        # both phases alike; every round's prompts are new (no prefix-cache hits across rounds).
        for r in range(args.rounds):
            seed = args.seed + 2 * r
            alones.append(asyncio.run(measure(cluster.router, args, flood=False, seed=seed)))
            print(f"round {r + 1} alone:      {alones[-1].summary()}", flush=True)
            crowds.append(asyncio.run(measure(cluster.router, args, flood=True, seed=seed + 1)))
            print(f"round {r + 1} with flood: {crowds[-1].summary()}", flush=True)
        rejections = _rejections(cluster.http_port)
    finally:
        cluster.stop()
    alone = Phase.pooled("alone", alones) if len(alones) > 1 else alones[0]
    crowded = Phase.pooled("with flood", crowds) if len(crowds) > 1 else crowds[0]
    ratio = crowded.ttft_p99_s / alone.ttft_p99_s if alone.ttft_p99_s else float("nan")
    p50_ratio = crowded.ttft_p50_s / alone.ttft_p50_s if alone.ttft_p50_s else float("nan")
    if args.rounds > 1:
        for a, c in zip(alones, crowds):
            print(f"  round p99 {a.ttft_p99_s * 1000:.0f} -> {c.ttft_p99_s * 1000:.0f} ms: "
                  f"{c.ttft_p99_s / a.ttft_p99_s:.2f}x")  # fmt: skip
        print(f"pooled over {args.rounds} rounds ({alone.calm_ok} and {crowded.calm_ok} calm "
              f"requests):")  # fmt: skip
    print(f"calm tenant TTFT p99: alone {alone.ttft_p99_s * 1000:.0f} ms, with flood "
          f"{crowded.ttft_p99_s * 1000:.0f} ms: {ratio:.2f}x (p50 {p50_ratio:.2f}x; the bar is "
          f"p99 <= 1.5x)")  # fmt: skip
    print(
        f"flood: {crowded.flood_ok} done, {crowded.flood_refused} refused "
        f"(RESOURCE_EXHAUSTED), {crowded.flood_failed} failed otherwise"
    )
    for line in rejections:
        print(f"router {line}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "command": "python -m loadtest.fairness " + " ".join(argv),
            "alone": asdict(alone), "with_flood": asdict(crowded), "p99_ratio": ratio,
            "rounds": [{"alone": asdict(a), "with_flood": asdict(c)}
                       for a, c in zip(alones, crowds)],
            "p50_ratio": p50_ratio, "router_rejections": rejections,
        }, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
