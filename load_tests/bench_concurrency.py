"""Throughput and latency vs concurrency through the whole stack: gateway → swarm → batching workers.

    python load_tests/bench_concurrency.py --model medium --levels 1,2,4,8,16 --max-tokens 64
    python load_tests/bench_concurrency.py --model tiny --levels 1,2,4 --max-tokens 8   # a quick check

One run starts its own swarm (a DHT in this process, ``--workers`` worker processes splitting the model's
blocks evenly, as ``swarmserve up`` does) and an in-process gateway (``SwarmBackend`` + ``create_app`` +
``BackgroundServer``), then:

1. warms up, then records the *reference*: every built-in prompt of ``load_tests/loadgen.py`` decoded alone
   (concurrency 1, so every worker step is a batch of one);
2. for each concurrency level runs ``loadgen.run_load`` (``--requests-per-stream`` requests per stream, at
   least ``--min-requests`` per level; greedy, EOS banned with ``logit_bias`` so every request makes exactly
   ``--max-tokens`` tokens) and checks that every output equals the reference output of its prompt:
   continuous batching must not change a single greedy token. The gateway's prefix reuse (affinity) stays
   on, as deployed, unless ``--no-affinity``: requests may resume caches earlier ones left on the workers;
3. reads each worker's batching counters (info RPC: ``batches``, ``batched_steps``, ``max_batch_seen``)
   around each level, so the table shows how large the batches really were.

Writes ``<out-dir>/concurrency.json``, ``concurrency.md`` (concurrency, total tok/s, speed-up vs 1 stream,
TTFT and ITL p50/p95/p99, errors, output mismatches, mean and max batch) and, with matplotlib installed
(``pip install -e '.[bench]'``), ``concurrency.png`` (throughput vs concurrency). Exit code 1 on any error
or output mismatch. The swarm and gateway come from ``load_tests/served_swarm.py`` (as in ``soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from load_tests.concurrency_report import GOAL_CONCURRENCY, GOAL_SPEEDUP, markdown, write_outputs  # noqa: E402
from load_tests.loadgen import PROMPTS, run_load, run_load_sync  # noqa: E402
from load_tests.served_swarm import ServedSwarm, eos_logit_bias, gateway_overrides, resolve_model  # noqa: E402
from swarmserve.cli.gateway import pipeline_groups_arg  # noqa: E402

DEFAULT_LEVELS = (1, 2, 4, 8, 16)


# ---------------------------------------------------------------------------------------------- the sweep
def _batch_delta(before: Sequence[Mapping], after: Sequence[Mapping]) -> list[dict[str, Any]]:
    rows = []
    for b, a in zip(before, after, strict=True):
        batches = int(a["batches"]) - int(b["batches"])
        steps = int(a["batched_steps"]) - int(b["batched_steps"])
        rows.append(
            {
                "worker": a["name"],
                "span": a["span"],
                "batches": batches,
                "batched_steps": steps,
                "mean_batch": round(steps / batches, 3) if batches else None,
                "max_batch_seen": int(a["max_batch_seen"]),
                "compute_ms_median": a.get("compute_ms_median"),
                "batch_waits": int(a.get("batch_waits", 0)) - int(b.get("batch_waits", 0)),
                "wait_ms_per_batch": round(
                    1000 * (float(a.get("batch_wait_seconds", 0)) - float(b.get("batch_wait_seconds", 0))) / batches, 3
                )
                if batches
                else None,
            }
        )
    return rows


def check_outputs(result: Mapping[str, Any], reference: Mapping[int, Mapping[str, Any]]) -> list[dict]:
    """Requests whose text or token count differs from the single-stream output of the same prompt."""
    bad = []
    for d in result["requests_detail"]:
        if d["error"] is not None:
            continue  # counted as an error already
        ref = reference[d["prompt_index"]]
        if d["text"] != ref["text"] or d["completion_tokens"] != ref["completion_tokens"]:
            bad.append(
                {
                    "stream": d["stream"],
                    "index": d["index"],
                    "prompt_index": d["prompt_index"],
                    "got": d["text"][:200],
                    "expected": ref["text"][:200],
                }
            )
    return bad


def _slim(detail: Mapping[str, Any]) -> dict[str, Any]:
    """A request's record without its per-chunk gaps (they are in the percentiles)."""
    return {k: v for k, v in detail.items() if k != "itl_s"}


async def sweep(swarm: ServedSwarm, args: argparse.Namespace) -> dict[str, Any]:
    if args.loadgen_in_process:
        load = run_load
    else:  # like real clients: the load generator's CPU work does not hold the gateway's GIL
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

        async def load(url: str, concurrency: int, **options: Any) -> dict[str, Any]:
            return await asyncio.get_running_loop().run_in_executor(pool, run_load_sync, url, concurrency, options)

    try:
        return await _sweep(swarm, args, load)
    finally:
        if not args.loadgen_in_process:
            pool.shutdown()


async def _sweep(swarm: ServedSwarm, args: argparse.Namespace, run_load) -> dict[str, Any]:
    extra = {"logit_bias": eos_logit_bias(swarm.backend)} if args.ban_eos else {}
    common = dict(
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        deadline_s=args.level_deadline,
        extra_body=extra,
    )
    print("warm-up ...", flush=True)
    warm = await run_load(swarm.url, 1, **{**common, "max_tokens": min(4, args.max_tokens)})
    if warm["errors"]:
        raise RuntimeError(f"warm-up failed: {warm['error_samples']}")

    print(f"reference: {len(PROMPTS)} prompts, one at a time ...", flush=True)
    ref_run = await run_load(swarm.url, 1, requests_per_stream=len(PROMPTS), **common)
    if ref_run["errors"]:
        raise RuntimeError(f"reference run failed: {ref_run['error_samples']}")
    reference = {d["prompt_index"]: d for d in ref_run["requests_detail"]}

    levels = []
    for c in args.levels:
        before = swarm.worker_infos()
        load_before = os.getloadavg()[0]
        per_stream = max(args.requests_per_stream, -(-args.min_requests // c))
        result = await run_load(swarm.url, c, requests_per_stream=per_stream, **common)
        after = swarm.worker_infos()
        result["mismatches"] = check_outputs(result, reference)
        result["workers"] = _batch_delta(before, after)
        result["max_batch_seen"] = max(w["max_batch_seen"] for w in result["workers"])
        means = [w["mean_batch"] for w in result["workers"] if w["mean_batch"] is not None]
        result["mean_batch"] = round(max(means), 3) if means else None
        result["loadavg_1m_before"] = round(load_before, 2)
        result["requests_detail"] = [_slim(d) for d in result["requests_detail"]]
        levels.append(result)
        print(
            f"  concurrency {c:>3}: {result['tokens_per_s']:8.1f} tok/s, {result['requests']} requests, "
            f"{result['errors']} errors, {len(result['mismatches'])} mismatches, "
            f"TTFT p50 {result['ttft']['p50_ms']} ms, ITL p50 {result['itl']['p50_ms']} ms, "
            f"mean batch {result['mean_batch']}, load {load_before:.1f}",
            flush=True,
        )
    base = next((lv["tokens_per_s"] for lv in levels if lv["concurrency"] == 1), None)
    for lv in levels:
        lv["speedup"] = round(lv["tokens_per_s"] / base, 3) if base else None
    return {
        "reference": {
            "tokens_per_s": ref_run["tokens_per_s"],
            "outputs": [
                {
                    "prompt_index": i,
                    "prompt": PROMPTS[i],
                    "text": reference[i]["text"],
                    "completion_tokens": reference[i]["completion_tokens"],
                }  # fmt: skip
                for i in sorted(reference)
            ],
        },
        "levels": levels,
    }


# ---------------------------------------------------------------------------------------------- main
def _levels(text: str) -> list[int]:
    levels = sorted({int(x) for x in text.split(",") if x.strip()})
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("levels: comma-separated positive integers")
    return levels


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="medium", help="tiny | medium | smollm | local path (default: medium)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--levels", type=_levels, default=list(DEFAULT_LEVELS), help="e.g. 1,2,4,8,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument(
        "--min-requests", type=int, default=8,
        help="each level sends at least this many requests (more per stream at low concurrency): a steadier "
        "single-stream baseline",
    )  # fmt: skip
    p.add_argument(
        "--loadgen-in-process",
        action="store_true",
        help="run the load generator in the gateway's process (default: its own process, like real clients)",
    )
    p.add_argument("--push", action="store_true", help="the gateway's client asks servers to push to each other")
    p.add_argument(
        "--pipeline-groups", type=pipeline_groups_arg, default="auto", metavar="auto|N",
        help="the gateway's client deals sessions into groups that servers batch apart (default auto: one per "
        "server of a session's route, as swarmserve gateway and up do; 1: off)",
    )  # fmt: skip
    p.add_argument(
        "--no-batch-decode", dest="batch_decode", action="store_false",
        help="each choice steps in a thread of its own (default: the gateway gathers concurrent decode steps)",
    )  # fmt: skip
    p.add_argument(
        "--step-bundles", action="store_true",
        help="the gateway's client bundles its sessions' steps: one message per server and hop",
    )  # fmt: skip
    p.add_argument("--no-ban-eos", dest="ban_eos", action="store_false", help="let requests stop at EOS")
    p.add_argument(
        "--no-affinity", dest="affinity", action="store_false",
        help="turn the gateway's prefix reuse off (every request prefills afresh)",
    )  # fmt: skip
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (CPUs/workers)")
    p.add_argument(
        "--cpu-kernels", default="auto", choices=["auto", "panels", "onednn", "torch"],
        help="the workers' projection kernels (swarmserve worker --cpu-kernels)",
    )  # fmt: skip
    p.add_argument("--gateway-threads", type=int, default=1, help="torch threads of this (gateway) process")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--level-deadline", type=float, default=900.0, help="hard limit of one level (seconds)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="swarmserve-bench-conc-"))
    started = time.time()
    loadavg_start = round(os.getloadavg()[0], 2)
    try:
        model_dir = resolve_model(args.model, workdir)
        worker_threads = args.worker_threads or max(1, (os.cpu_count() or 1) // args.workers)
        gateway_settings = gateway_overrides(affinity=args.affinity, batch_decode=args.batch_decode)
        with ServedSwarm(
            model_dir,
            args.workers,
            worker_threads=worker_threads,
            gateway_settings=gateway_settings,
            client_options={
                "push": args.push,
                "pipeline_groups": args.pipeline_groups,
                "step_bundles": args.step_bundles,
            },
            worker_args=["--cpu-kernels", args.cpu_kernels],
        ) as swarm:
            import torch

            torch.set_num_threads(args.gateway_threads)
            results = asyncio.run(sweep(swarm, args))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    levels = results["levels"]
    at_goal = next((lv for lv in levels if lv["concurrency"] == GOAL_CONCURRENCY), None)
    errors = sum(lv["errors"] for lv in levels)
    mismatches = sum(len(lv["mismatches"]) for lv in levels)
    speedup = at_goal["speedup"] if at_goal else None
    report = {
        "meta": {
            "model": args.model,
            "model_dir": str(model_dir) if args.model not in ("tiny", "medium") else None,
            "workers": args.workers,
            "worker_threads": worker_threads,
            "cpu_kernels": args.cpu_kernels,
            "gateway_threads": args.gateway_threads,
            "max_tokens": args.max_tokens,
            "requests_per_stream": args.requests_per_stream,
            "min_requests": args.min_requests,
            "ban_eos": args.ban_eos,
            "affinity": args.affinity,
            "push": args.push,
            "pipeline_groups": args.pipeline_groups,
            "step_bundles": args.step_bundles,
            "batch_decode": args.batch_decode,
            "loadgen_in_process": args.loadgen_in_process,
            "levels": args.levels,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": loadavg_start,
            "loadavg_end": round(os.getloadavg()[0], 2),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "duration_s": round(time.time() - started, 1),
        },
        "goal": {
            "concurrency": GOAL_CONCURRENCY,
            "min_speedup": GOAL_SPEEDUP,
            "speedup": speedup,
            "errors": errors,
            "mismatches": mismatches,
            "met": bool(speedup is not None and speedup >= GOAL_SPEEDUP and not errors and not mismatches),
        },
        **results,
    }
    for path in write_outputs(report, args.out_dir):
        print(f"wrote {path}")
    print(markdown(report))
    return 1 if errors or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
