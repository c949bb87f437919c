"""Measure the load tester's own overhead against the instant echo server.

Starts an echo replica (``loadtest/echo_replica.py``, stand-alone) in a subprocess (its own process, so the server does not share
the client's event loop), then sends Poisson arrivals at each requested rate through the same
scheduler, client and measurement code as ``prefixmesh loadtest``, and prints the achieved
request rate and how late requests left compared with their planned times (p50/p99/max).

    python -m loadtest.overhead --rates 250,500,1000 --requests 3000
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.arrivals import ArrivalSpec, schedule
from loadtest.clients import make_client
from loadtest.runner import RunLimits, run_phase
from loadtest.summary import summarize
from loadtest.synthetic import RandomSpec, random_requests
from loadtest.tokens import TokenBlocks
from prefixmesh import event_loop


def start_echo_subprocess(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loadtest.echo_replica",
            "--tokens-per-message",
            str(args.tokens_per_message),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "127.0.0.1:PORT" once it serves
    if not line.startswith("127.0.0.1:"):
        proc.kill()
        raise RuntimeError(f"echo server did not start: {line!r}")
    return proc, line.strip()


async def measure_rate(target: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    blocks = TokenBlocks(1)
    requests = random_requests(
        RandomSpec(args.requests, args.input_len, args.output_len, 0.0, seed=int(rate)), blocks
    )
    schedule(requests, ArrivalSpec("poisson", rate=rate, seed=int(rate)))
    gc.collect()
    gc.freeze()
    client = make_client("grpc", target, args.channels)
    try:
        await client.wait_ready(10.0)
        warm = random_requests(RandomSpec(50, args.input_len, args.output_len), blocks)
        await run_phase(client, warm, RunLimits(concurrency=8), warmup=True)
        limits = RunLimits(max_duration=args.requests / rate + 5, drain_timeout=30)
        cpu0 = time.process_time()
        phase = await run_phase(client, requests, limits)
        cpu_s = time.process_time() - cpu0
    finally:
        await client.close()
    s = summarize(phase.results)
    sends = [r.send_time for r in phase.results]
    return {
        "offered_rate": rate,
        "requests": len(phase.results),
        "ok": s["requests"]["ok"],
        "errors": s["requests"]["error_samples"],
        "planned_rate": (len(requests) - 1) / requests[-1].planned_time,
        "send_rate": (len(sends) - 1) / (max(sends) - min(sends)),
        "completed_rate": s["throughput"]["requests_per_s"],
        # CPU time of this process per request: the load tester's cost, whatever else runs on
        # the machine (the echo server is another process).
        "client_cpu_ms_per_request": cpu_s * 1e3 / len(phase.results),
        "send_lag_ms": s["send_lag_ms"],
        "ttft_ms": s["latency_ms"]["ttft"],
        "e2e_ms": s["latency_ms"]["e2e"],
    }


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    proc, target = start_echo_subprocess(args)
    try:
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            rows.append(await measure_rate(target, rate, args))
            time.sleep(0.5)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rates", default="250,500,1000", help="offered request rates (req/s)")
    p.add_argument("--requests", type=int, default=3000, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--tokens-per-message", type=int, default=1)
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)

    rows = event_loop.run(_main(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(
        title=f"load tester overhead vs instant echo server ({args.requests} requests per rate, "
        f"{args.input_len} in, {args.output_len} out); rates in req/s, times in ms"
    )
    for col in (
        "offered",
        "planned",
        "sent",
        "completed",
        "ok",
        "lag p50",
        "lag p99",
        "lag max",
        "TTFT p50",
        "TTFT p99",
        "client CPU ms/req",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        lag, ttft = r["send_lag_ms"], r["ttft_ms"]
        table.add_row(
            f"{r['offered_rate']:.0f}",
            f"{r['planned_rate']:.1f}",
            f"{r['send_rate']:.1f}",
            f"{r['completed_rate']:.1f}",
            f"{r['ok']}/{r['requests']}",
            *(f"{v:.2f}" for v in (lag["p50"], lag["p99"], lag["max"], ttft["p50"], ttft["p99"])),
            f"{r['client_cpu_ms_per_request']:.3f}",
        )
    for r in rows:
        for status, message in r["errors"].items():
            print(f"{r['offered_rate']:.0f} req/s: {status}: {message}")
    Console(width=max(130, Console().width)).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
