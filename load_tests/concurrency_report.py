"""The report of ``bench_concurrency.py``: a Markdown table and, with matplotlib, a throughput plot."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the brief's bar: aggregate tok/s at this many streams at least this many times the single stream's
GOAL_CONCURRENCY, GOAL_SPEEDUP = 8, 4.0


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(report: Mapping[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# Concurrency sweep: {meta['model']} ({meta['workers']} workers)",
        "",
        f"{meta['max_tokens']} tokens per request (EOS banned: {meta['ban_eos']}; prefix reuse: "
        f"{meta['affinity']}; server-to-server push: {meta.get('push', False)}; "
        f"pipeline groups: {meta.get('pipeline_groups', 1)}; step bundles: {meta.get('step_bundles', False)}; "
        f"gateway batch decode: {meta.get('batch_decode', False)}; "
        f"load generator in the gateway's "
        f"process: {meta.get('loadgen_in_process', True)}), "
        f"{meta['requests_per_stream']} request(s) per stream (at least {meta['min_requests']} per level), "
        "greedy, streaming chat; "
        f"{meta['cpu_count']} CPU(s), {meta['worker_threads']} torch thread(s) per worker; "
        f"load average {meta['loadavg_start']} at start.",
        "",
        "| concurrency | total tok/s | speed-up vs 1 | TTFT p50 | TTFT p95 | TTFT p99 | ITL p50 | ITL p95 "
        "| ITL p99 | errors | mismatches | mean batch | max batch seen |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in report["levels"]:
        t, i = lv["ttft"], lv["itl"]
        lines.append(
            f"| {lv['concurrency']} | {_f(lv['tokens_per_s'])} | {_f(lv['speedup'], 2)}× "
            f"| {_f(t['p50_ms'])} | {_f(t['p95_ms'])} | {_f(t['p99_ms'])} "
            f"| {_f(i['p50_ms'])} | {_f(i['p95_ms'])} | {_f(i['p99_ms'])} "
            f"| {lv['errors']} | {len(lv['mismatches'])} | {_f(lv['mean_batch'], 2)} "
            f"| {lv['max_batch_seen']} |"
        )
    goal = report["goal"]
    lines += [
        "",
        "Latencies in ms. TTFT: request sent → first content chunk; ITL: gap between content chunks. "
        "Mismatches: outputs that differ from the same prompt decoded alone (unbatched). Mean batch: "
        "steps per batch on the busiest worker during the level; max batch seen: since the worker started.",
        "",
        f"Goal: ≥ {GOAL_SPEEDUP:g}× single-stream tok/s at {GOAL_CONCURRENCY} streams, no errors, outputs "
        f"identical to unbatched greedy — speed-up {_f(goal['speedup'], 2)}×, errors {goal['errors']}, "
        f"mismatches {goal['mismatches']}: **{'met' if goal['met'] else 'not met'}**.",
        "",
    ]
    return "\n".join(lines)


def plot(report: Mapping[str, Any], out: Path) -> Path | None:
    """Throughput vs concurrency with the linear-scaling line; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return None
    levels = report["levels"]
    xs = [lv["concurrency"] for lv in levels]
    ys = [lv["tokens_per_s"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot(xs, ys, marker="o", label="swarmserve (gateway + 2-span swarm)")
    base = next((lv["tokens_per_s"] for lv in levels if lv["concurrency"] == 1), None)
    if base:
        ax.plot(xs, [base * x for x in xs], linestyle="--", color="grey", label="linear scaling")
        for lv in levels:
            ax.annotate(f"{lv['speedup']:.1f}×", (lv["concurrency"], lv["tokens_per_s"]),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(bottom=0, top=max(ys + [1.0]) * 1.25)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("total completion tokens/s")
    ax.set_title(f"{report['meta']['model']}: throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def write_outputs(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "concurrency.json", out_dir / "concurrency.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    png = plot(report, out_dir / "concurrency.png")
    return paths + ([png] if png else [])
