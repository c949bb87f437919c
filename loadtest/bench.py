"""One measured run (warm-up, cluster snapshot, open- or closed-loop phase, snapshot, summary)
and the ``--compare`` loop over router policies."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.ceilings import add_ceilings
from loadtest.client import GenerateClient
from loadtest.cluster import ClusterClient, cluster_delta
from loadtest.plots import write_plots
from loadtest.report import cluster_hit_rate, pct
from loadtest.request import LoadRequest, RequestResult
from loadtest.results import write_requests, write_summary
from loadtest.runner import RunLimits, run_phase
from loadtest.slo import Slo
from loadtest.summary import summarize

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What every run of a benchmark shares (one per ``prefixmesh loadtest`` invocation)."""

    limits: RunLimits = RunLimits()
    warmup: int = 0
    slo: Slo | None = None
    block_size: int | None = None  # None: the replicas' block size from the router, else 16
    capacity_blocks: int | None = None  # None: the replicas' KV pools together, from the router
    progress: bool = True
    plots: bool = True
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # recorded in summaries


def split_warmup(
    requests: list[LoadRequest], warmup: int, cache_salt: str
) -> tuple[list[LoadRequest], list[LoadRequest]]:
    """Warm-up requests (closed loop, sent first) and measured ones (times start at 0)."""
    reqs = [dataclasses.replace(r, cache_salt=cache_salt) for r in requests]
    warm = [dataclasses.replace(r, planned_time=None) for r in reqs[:warmup]]
    measured = reqs[warmup:]
    times = [r.planned_time for r in measured if r.planned_time is not None]
    if times:
        t0 = min(times)
        for r in measured:
            r.planned_time = r.planned_time - t0 if r.planned_time is not None else None
    return warm, measured


def _progress(enabled: bool, console: Console) -> Progress | nullcontext[None]:
    if not enabled:
        return nullcontext()
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[errors]} errors"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


async def run_once(
    name: str,
    client: GenerateClient,
    cluster: ClusterClient | None,
    requests: list[LoadRequest],
    opts: BenchOptions,
    cache_salt: str = "",
    console: Console | None = None,
) -> tuple[list[RequestResult], dict[str, Any]]:
    console = console or Console(stderr=True)
    warm, measured = split_warmup(requests, opts.warmup, cache_salt)
    results: list[RequestResult] = []
    if warm:
        limits = dataclasses.replace(
            opts.limits, concurrency=min(len(warm), opts.limits.concurrency)
        )
        results += (await run_phase(client, warm, limits, warmup=True)).results
    before = await cluster.snapshot() if cluster else None
    with _progress(opts.progress, console) as progress:
        on_done = None
        if progress is not None:
            task = progress.add_task(name, total=len(measured), errors=0)
            errors = 0

            def on_done(r: RequestResult) -> None:
                nonlocal errors
                errors += not r.ok
                progress.update(task, advance=1, errors=errors)

        phase = await run_phase(client, measured, opts.limits, on_done=on_done)
    results += phase.results
    if cluster is not None:
        await asyncio.sleep(0.2)  # let the router account for the last responses
    after = await cluster.snapshot() if cluster else None
    summary = summarize(results, opts.slo, phase.not_sent)
    summary["name"] = name
    summary["cache_salt"] = cache_salt
    summary["settings"] = opts.settings
    if before is not None and after is not None:
        summary["cluster"] = cluster_delta(before, after)
    block_size = opts.block_size or (after.block_size if after else None)
    if block_size is None and cluster is not None and after is None:
        block_size = await cluster.replica_block_size()
    block_size = block_size or DEFAULT_BLOCK_SIZE
    capacity = opts.capacity_blocks or (after.capacity_blocks if after else None)
    if capacity is None and cluster is not None and after is None:
        capacity = await cluster.replica_num_blocks()
    # Over the requests that were served: a rejected one (too long, queue full ...) left nothing
    # in any cache and is not in the achieved rate either.
    served = {r.index for r in results if r.ok}
    add_ceilings(
        summary,
        [r for r in measured if r.index in served],
        block_size,
        capacity,
        [r for r in warm if r.index in served],
    )
    return results, summary


def save_run(
    results: list[RequestResult], summary: dict[str, Any], out_dir: Path, plots: bool
) -> None:
    write_requests(results, out_dir / "requests.jsonl")
    if plots:
        summary["plots"] = [
            p.name
            for p in write_plots({summary["name"]: results}, {summary["name"]: summary}, out_dir)
        ]
    write_summary(summary, out_dir / "summary.json")


async def compare_policies(
    policies: list[str],
    client: GenerateClient,
    cluster: ClusterClient,
    requests: list[LoadRequest],
    opts: BenchOptions,
    out_dir: Path,
    console: Console,
) -> dict[str, dict[str, Any]]:
    """The same workload against each router policy in turn; the router's policy is restored.

    The router has no cache-flush RPC, so every policy run uses a fresh ``cache_salt``: different
    salts never share cached blocks, so one run cannot warm the next one's cache.
    """
    runs: dict[str, list[RequestResult]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    run_id = uuid.uuid4().hex[:8]
    initial = await cluster.snapshot()
    try:
        for policy in policies:
            await cluster.set_policy(policy)
            await cluster.reset_stats()
            salt = f"loadtest-{run_id}-{policy}"
            results, summary = await run_once(
                policy, client, cluster, requests, opts, salt, console
            )
            save_run(results, summary, out_dir / policy, opts.plots)
            runs[policy], summaries[policy] = results, summary
            ttft = summary["latency_ms"]["ttft"]["p50"]
            console.print(
                f"[bold]{policy}[/bold]: hit rate {pct(cluster_hit_rate(summary))}, "
                f"TTFT p50 {'-' if ttft is None else f'{ttft:.1f}'} ms, "
                f"{summary['requests']['ok']}/{summary['requests']['sent']} ok"
            )
    finally:  # leave the router as we found it
        if initial is not None and initial.policy:
            await cluster.set_policy(initial.policy)
    write_summary({"policies": summaries}, out_dir / "compare.json")
    if opts.plots:
        write_plots(runs, summaries, out_dir)
    return summaries
