"""Bounded soak test: many concurrent streams for minutes, then proof that nothing was lost or leaked.

    python load_tests/soak.py                                   # tiny model, 16 streams, 5 minutes
    python load_tests/soak.py --model medium --duration 600 --concurrency 16
    python load_tests/soak.py --duration 30 --concurrency 4     # a quick check

Starts its own swarm and in-process gateway on loopback (``served_swarm.ServedSwarm``), records every
worker's idle cache level (``cache_tokens_used``, ``sessions_attached``, ``sessions_detached``) and RSS,
then keeps ``--concurrency`` streams sending greedy streaming chat requests (``loadgen.run_load`` with a
duration) while sampling the workers every ``--sample-every`` seconds. After the last stream ends it waits
up to ``--settle-timeout`` seconds for each worker's cache to come back to its idle level.

Passes (exit code 0) when no request failed, every worker's cache and session counts are back at their
idle level and the gateway holds no session. Writes ``<out>`` (JSON) and a Markdown summary next to it.
Everything is bounded: the run is cut off at duration + ``--request-timeout`` + 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from load_tests.loadgen import run_load  # noqa: E402
from load_tests.served_swarm import ServedSwarm, gateway_overrides, resolve_model  # noqa: E402

#: the worker counters that must come back to their idle values once every stream has ended
CACHE_KEYS = ("cache_tokens_used", "sessions_attached", "sessions_detached")


def _cache_view(infos: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keep = ("name", "span", *CACHE_KEYS, "cache_tokens_left", "active_streams", "tokens_processed")
    return [{k: info.get(k) for k in keep} for info in infos]


def grown(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]], keys: Sequence[str] = CACHE_KEYS
) -> list[str]:
    """What is above its idle level, as readable lines; empty when every worker is back."""
    out = []
    for b, a in zip(before, after, strict=True):
        for key in keys:
            if int(a.get(key) or 0) > int(b.get(key) or 0):
                out.append(f"{a['name']} ({a['span']}): {key} {b.get(key)} → {a.get(key)}")
    return out


async def _wait_idle(
    swarm: ServedSwarm, before: list[dict], timeout: float, keys: Sequence[str] = CACHE_KEYS
) -> tuple[list[dict], float]:
    """Poll until ``keys`` are back at ``before`` and the gateway holds no session (or ``timeout``);
    the last reading and the time taken. (The info RPC also runs the workers' TTL expiry.)"""
    t0 = time.monotonic()
    while True:
        infos = await asyncio.to_thread(swarm.worker_infos)
        back = not grown(before, infos, keys) and swarm.backend.open_sessions == 0
        if back or time.monotonic() - t0 > timeout:
            return infos, time.monotonic() - t0
        await asyncio.sleep(0.5)


async def soak(swarm: ServedSwarm, args: argparse.Namespace) -> dict[str, Any]:
    # the idle level: fresh workers, before any request (the warm-up's kept cache must expire too)
    idle = await asyncio.to_thread(swarm.worker_infos)
    warm = await run_load(swarm.url, 1, max_tokens=4, deadline_s=120, request_timeout_s=args.request_timeout)
    if warm["errors"]:
        raise RuntimeError(f"warm-up failed: {warm['error_samples']}")
    rss_before = swarm.worker_rss_mb()
    print(f"idle: {_cache_view(idle)}; RSS {rss_before} MB", flush=True)

    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()

    async def sample() -> None:
        while True:
            await asyncio.sleep(args.sample_every)
            try:
                infos = await asyncio.to_thread(swarm.worker_infos)
            except Exception as exc:  # a failed probe is reported, not fatal: the run's errors decide
                samples.append({"t_s": round(time.monotonic() - t0, 1), "error": repr(exc)[:200]})
                continue
            samples.append({"t_s": round(time.monotonic() - t0, 1), "workers": _cache_view(infos)})
            w = samples[-1]["workers"]
            print(f"  t={samples[-1]['t_s']:6.1f}s  cache used {[x['cache_tokens_used'] for x in w]}, "
                  f"sessions {[x['sessions_attached'] for x in w]}", flush=True)  # fmt: skip

    print(f"soak: {args.concurrency} streams for {args.duration:.0f}s ...", flush=True)
    sampler = asyncio.create_task(sample())
    try:
        result = await run_load(
            swarm.url,
            args.concurrency,
            duration_s=args.duration,
            deadline_s=args.duration + args.request_timeout + 60,
            max_tokens=args.max_tokens,
            request_timeout_s=args.request_timeout,
            include_requests=False,
        )
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    # live sessions end with their streams; kept (detached) caches go when their TTL runs out
    ended = time.monotonic()
    at_end = await asyncio.to_thread(swarm.worker_infos)
    _, attached_settle_s = await _wait_idle(swarm, idle, args.settle_timeout, keys=("sessions_attached",))
    after, _ = await _wait_idle(swarm, idle, max(0.0, args.settle_timeout - (time.monotonic() - ended)))
    settle_s = time.monotonic() - ended
    growth = grown(idle, after)
    readings = [s["workers"] for s in samples if "workers" in s]
    peak = [
        {key: max((int(r[n][key] or 0) for r in readings), default=None) for key in CACHE_KEYS}
        for n in range(len(idle))
    ]
    return {
        "load": result,
        "workers_before": _cache_view(idle),
        "workers_at_end": _cache_view(at_end),
        "workers_after": _cache_view(after),
        "rss_mb_before": rss_before,
        "rss_mb_after": swarm.worker_rss_mb(),
        "peak_during_run": peak,
        "samples": samples,
        "settle_s": round(settle_s, 2),
        "attached_settle_s": round(attached_settle_s, 2),
        "gateway_open_sessions_after": swarm.backend.open_sessions,
        "cache_growth": growth,
        "passed": result["errors"] == 0 and not growth and swarm.backend.open_sessions == 0,
    }


def markdown(report: Mapping[str, Any]) -> str:
    load, meta = report["load"], report["meta"]
    t, i = load["ttft"], load["itl"]
    verdict = "PASSED" if report["passed"] else "FAILED"
    reuse = "on" if meta["affinity"] else "off"
    lines = [
        f"# Soak: {meta['model']}, {meta['concurrency']} streams, {meta['duration_s']:.0f} s",
        "",
        f"**{verdict}** — {load['requests']} requests, {load['errors']} errors, "
        f"{load['completion_tokens']} tokens, {load['tokens_per_s']:.1f} tok/s; "
        f"TTFT p50/p95/p99 {t['p50_ms']}/{t['p95_ms']}/{t['p99_ms']} ms; "
        f"ITL p50/p95/p99 {i['p50_ms']}/{i['p95_ms']}/{i['p99_ms']} ms. "
        f"Prefix reuse {reuse}, kept caches expire after {meta['session_ttl_s']:g} s. "
        f"Load average {meta['loadavg_start']} at start, {meta['loadavg_end']} at end.",
        "",
        "| worker | span | cache tokens: idle / peak / at end / after "
        "| sessions attached: idle / peak / at end / after "
        "| detached: peak / at end / after | RSS MB before / after |",
        "|---|---|---|---|---|---|",
    ]
    keys = (
        "workers_before",
        "peak_during_run",
        "workers_at_end",
        "workers_after",
        "rss_mb_before",
        "rss_mb_after",
    )
    rows = zip(*(report[k] for k in keys), strict=True)
    for b, peak, e, a, rb, ra in rows:
        lines.append(
            f"| {a['name']} | {a['span']} "
            f"| {b['cache_tokens_used']} / {peak['cache_tokens_used']} / {e['cache_tokens_used']} / "
            f"{a['cache_tokens_used']} "
            f"| {b['sessions_attached']} / {peak['sessions_attached']} / {e['sessions_attached']} / "
            f"{a['sessions_attached']} "
            f"| {peak['sessions_detached']} / {e['sessions_detached']} / {a['sessions_detached']} "
            f"| {rb} / {ra} |"
        )
    lines += [
        "",
        f"Live sessions gone {report['attached_settle_s']} s after the last stream ended; caches back to "
        f"their idle level after {report['settle_s']} s. Peak: highest of the worker's readings during "
        "the run; at end: right after the last stream; after: once back at idle (or at the settle timeout).",
    ]
    if report["cache_growth"]:
        lines += ["", "Cache growth:", *(f"- {g}" for g in report["cache_growth"])]
    for e in load["error_samples"]:
        lines.append(f"- error ×{e['count']}: {e['error']}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | medium | smollm | local path (default: tiny)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default: 5 minutes)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--sample-every", type=float, default=15.0, help="seconds between worker probes")
    p.add_argument(
        "--session-ttl", type=float, default=30.0,
        help="how long workers keep a finished session's cache for prefix reuse (workers' --session-ttl and "
        "the gateway's affinity TTL); short, so the soak sees the caches drain",
    )  # fmt: skip
    p.add_argument("--no-affinity", dest="affinity", action="store_false", help="gateway prefix reuse off")
    p.add_argument(
        "--settle-timeout", type=float, default=None, help="wait this long for caches to drain (TTL + 60 s)"
    )
    p.add_argument("--worker-threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "soak.json")
    args = p.parse_args(argv)
    if args.settle_timeout is None:
        args.settle_timeout = args.session_ttl + 60.0

    workdir = Path(tempfile.mkdtemp(prefix="swarmserve-soak-"))
    loadavg_start = round(os.getloadavg()[0], 2)
    try:
        model_dir = resolve_model(args.model, workdir)
        overrides = gateway_overrides(affinity=args.affinity, affinity_ttl_s=args.session_ttl)
        with ServedSwarm(
            model_dir,
            args.workers,
            worker_threads=args.worker_threads,
            worker_args=["--session-ttl", str(args.session_ttl)],
            gateway_settings=overrides,
        ) as swarm:
            import torch

            torch.set_num_threads(1)
            report = asyncio.run(soak(swarm, args))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["meta"] = {
        "model": args.model,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "affinity": args.affinity,
        "session_ttl_s": args.session_ttl,
        "cpu_count": os.cpu_count(),
        "loadavg_start": loadavg_start,
        "loadavg_end": round(os.getloadavg()[0], 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    md = args.out.with_suffix(".md")
    md.write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out} and {md}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
