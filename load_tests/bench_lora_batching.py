"""Serving LoRA adapters: one mixed batch vs one batch per adapter, and what an adapter costs a step.

In process, on SmolLM2-135M-Instruct's first ``--blocks`` blocks (a worker's span), float32 CPU, the worker's
default kernels: ``SpanRunner.inference_batch`` over ``--sessions`` decode sessions (one token each, after a
``--prompt``-token prefill). Modes, each timed over ``--rounds`` decode rounds (median ms per round):

- ``base``: no adapter loaded at all (the plain server);
- ``base+loaded``: adapters loaded, every session on the base model (what loading adapters costs the others);
- ``one-adapter``: every session on adapter a1;
- ``mixed``: half a1, half a2, all in one batch (PEFT's mixed-batch LoRA: each row its own adapter);
- ``by-adapter``: the same sessions as two batches, one per adapter (what a batcher grouping by adapter does).

Random rank-8 adapters on every projection (``swarm_client.tiny_lora``). Writes JSON + Markdown.

    .venv/bin/python -m load_tests.bench_lora_batching [--blocks 10] [--sessions 8] [--rounds 40]
        [--out-prefix load_tests/results/lora-batching-2026-12-07]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from load_tests.bench_wan import git
from swarm_client.families import get_family
from swarm_client.lora import AdapterSpec
from swarm_client.model_source import SMOLLM2_ID, resolve_model_path
from swarm_client.tiny_lora import make_random_lora
from worker.cache import CacheManager
from worker.compute import SpanRunner, StepItem
from worker.loading import load_blocks

MODES = ["base", "base+loaded", "one-adapter", "mixed", "by-adapter"]


def _sessions(runner: SpanRunner, layout, count: int, prompt: int, adapters: list[str | None], hidden: int):
    caches = CacheManager(1_000_000, len(runner.blocks), layout, torch.float32)
    out = []
    for n in range(count):
        cache = caches.open(f"s{n}", 1, prompt + 4096)
        cache.adapter = adapters[n]
        caches.ensure_capacity(cache, prompt + 1024)
        runner.inference_step(cache, torch.randn(1, prompt, hidden), 0)
        out.append(cache)
    return out


def _time_rounds(runner: SpanRunner, batches: list[list], rounds: int, hidden: int) -> float:
    """Median ms of one decode round: every batch in ``batches`` stepped once, one after the other."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for sessions in batches:
            runner.inference_batch([StepItem(c, torch.randn(1, 1, hidden), c.position) for c in sessions])
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out-prefix", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = str(resolve_model_path(SMOLLM2_ID))
    config = AutoConfig.from_pretrained(model_dir)
    family, hidden = get_family(config), config.hidden_size
    layout = family.cache_layout(config)
    where = (model_dir, config, family, 0, args.blocks, torch.float32, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        specs = [
            AdapterSpec(name, str(make_random_lora(model_dir, Path(tmp) / name, seed=seed, rank=args.rank)))
            for name, seed in (("a1", 1), ("a2", 2))
        ]
        plain = SpanRunner(load_blocks(*where), torch.float32, torch.device("cpu"))
        served = SpanRunner(load_blocks(*where, adapters=specs), torch.float32, torch.device("cpu"))
    n, half = args.sessions, args.sessions // 2
    split = ["a1"] * half + ["a2"] * (n - half)
    setups = {
        "base": (plain, [None] * n, None),
        "base+loaded": (served, [None] * n, None),
        "one-adapter": (served, ["a1"] * n, None),
        "mixed": (served, split, None),
        "by-adapter": (served, split, half),
    }
    results = {}
    for mode in MODES:
        runner, names, cut = setups[mode]
        sessions = _sessions(runner, layout, n, args.prompt, names, hidden)
        batches = [sessions] if cut is None else [sessions[:cut], sessions[cut:]]
        _time_rounds(runner, batches, 3, hidden)  # warm-up
        results[mode] = _time_rounds(runner, batches, args.rounds, hidden)
        print(f"{mode:12s} {results[mode]:8.2f} ms per round of {n} decode steps", flush=True)
    report = {
        "meta": {
            "command": "python -m load_tests.bench_lora_batching "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
            "git": git("rev-parse", "HEAD").strip()[:12],
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread",
            "model": SMOLLM2_ID,
            "args": vars(args),
        },
        "ms_per_round": results,
        "ratios": {mode: results[mode] / results["base"] for mode in MODES},
        "mixed_over_by_adapter": results["mixed"] / results["by-adapter"],
    }
    print(json.dumps(report["ratios"], indent=1), f"mixed / by-adapter = {report['mixed_over_by_adapter']:.3f}")
    if args.out_prefix:
        Path(args.out_prefix + ".json").write_text(json.dumps(report, indent=1) + "\n")
        rows = "\n".join(f"| {m} | {results[m]:.2f} | {report['ratios'][m]:.2f} |" for m in MODES)
        Path(args.out_prefix + ".md").write_text(
            f"# LoRA batching, {time.strftime('%Y-%m-%d %H:%M')}: {SMOLLM2_ID}, blocks 0:{args.blocks}\n\n"
            f"`{report['meta']['command']}` at `{report['meta']['git']}`; {report['meta']['machine']}, CPU float32. "
            f"{n} decode sessions after a {args.prompt}-token prefill, median of {args.rounds} rounds; random "
            f"rank-{args.rank} adapters on every projection.\n\n"
            "| mode | ms per round | × base |\n|---|---|---|\n" + rows + "\n\n"
            f"Mixed batch / one batch per adapter: **{report['mixed_over_by_adapter']:.2f}×** the time.\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
