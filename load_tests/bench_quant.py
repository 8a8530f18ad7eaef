"""Quantized servers (``--quant int8|nf4``) against float32: memory, decode speed, and how close the outputs stay.

    python load_tests/bench_quant.py                                   # SmolLM2 blocks 0:8 and the medium model
    python load_tests/bench_quant.py --models medium --tokens 32 --out bench_results/quant.json

Per model and quantization (``none`` = float32 on the panel kernel, what a CPU server runs by default):

- **span RSS**: a fresh child process loads the span as a server does (``worker.loading.load_blocks``) and
  reports how much its resident memory grew (and its peak during loading), as load_tests/bench_rss.py;
- **decode ms/token**: one stream, one thread, the span in process (``SpanRunner``, no network): a 16-token
  prefill, then ``--tokens`` single-token steps; the three quantizations are timed in interleaved rounds,
  so a noisy machine slows them alike; median over all steps;
- **8 sessions batched**: ms per step of 8 sessions decoded together (``inference_batch``), and the largest
  difference between their batched and unbatched outputs (0 when the kernel is batch-invariant);
- **agreement**: the whole model with every block's projections quantized (the same modules a server uses,
  put into the 🤗 model) vs float32, over ``--prompts`` prompts × ``--tokens`` greedy tokens: sequences
  identical, mean common prefix, top-1 agreement and max |Δlogits| with the float32 tokens fed to both.

Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from swarm_client.families import get_family  # noqa: E402
from swarm_client.kernels.quantized import quantize_linears  # noqa: E402
from worker.cache import CacheManager  # noqa: E402
from worker.compute import SpanRunner, StepItem  # noqa: E402
from worker.loading import load_blocks  # noqa: E402

QUANTS = ("none", "int8", "nf4")
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in one paragraph.",
    "def fibonacci(n):",
    "A list of three fruits:",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to French: The cat sleeps on the sofa.",
    "What is 17 times 23?",
    "Give me a recipe for pancakes.",
]

CHILD = r"""
import gc, sys, psutil, torch
from transformers import AutoConfig
from swarm_client.families import get_family
from worker.loading import load_blocks
path, a, b, quant = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
config = AutoConfig.from_pretrained(path)
# what loading needs besides the weights, loaded first so that only the weights count: the modeling code,
# both kernels, torch's first ops
from swarm_client.kernels import cpu_gemm, quant_gemm
from swarm_client.families import llama
import transformers.models.llama.modeling_llama
cpu_gemm.load(), quant_gemm.load()
float(torch.ones(64, 64).mul(2).sum())
get_family(config).build_block
gc.collect()
before = psutil.Process().memory_info().rss
blocks = load_blocks(path, config, get_family(config), a, b, torch.float32, torch.device("cpu"),
                     cpu_kernels="auto", quant=quant)
# the high-water mark of this process's own memory (getrusage's ru_maxrss would include the parent's: it
# survives fork and exec)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
# touch every float weight (safetensors maps files lazily: untouched pages are not resident yet); packed and
# quantized weights were written by us, so they are resident already
sum(float(p.sum()) for m in blocks for p in m.parameters())
gc.collect()
after = psutil.Process().memory_info().rss
print((after - before) // 2**20, (max(peak, before) - before) // 2**20)
"""


def span_rss_mb(path: str, start: int, end: int, quant: str) -> tuple[int, int]:
    """(resident growth, peak growth during loading) in MiB, in a fresh process."""
    cmd = [sys.executable, "-c", CHILD, path, str(start), str(end), quant]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    grown, peak = out.stdout.strip().splitlines()[-1].split()
    return int(grown), int(peak)


def runners(path: str, start: int, end: int) -> tuple[dict[str, SpanRunner], object, int]:
    config = AutoConfig.from_pretrained(path)
    family = get_family(config)
    out = {}
    for quant in QUANTS:
        blocks = load_blocks(path, config, family, start, end, torch.float32, torch.device("cpu"),
                             cpu_kernels="auto", quant=quant)  # fmt: skip
        out[quant] = SpanRunner(blocks, torch.float32, torch.device("cpu"))
    return out, family.cache_layout(config), config.hidden_size


def decode_times(runs: dict[str, SpanRunner], layout, hidden: int, tokens: int, rounds: int) -> dict[str, float]:
    """Median ms per single-token step of one session, the quantizations interleaved round by round."""
    samples: dict[str, list[float]] = {q: [] for q in runs}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 16, hidden, generator=gen)
    steps = [torch.randn(1, 1, hidden, generator=gen) for _ in range(tokens)]
    with torch.inference_mode():
        for _ in range(rounds):
            for quant, runner in runs.items():
                caches = CacheManager(10_000, len(runner.blocks), layout, torch.float32)
                cache = caches.open("s", 1, 16 + tokens)
                caches.ensure_capacity(cache, 16 + tokens)
                runner.inference_step(cache, prompt, 0)
                for x in steps:
                    t0 = time.perf_counter()
                    runner.inference_step(cache, x, cache.position)
                    samples[quant].append(time.perf_counter() - t0)
    return {q: 1000 * statistics.median(v) for q, v in samples.items()}


def batched(runner: SpanRunner, layout, hidden: int, sessions: int = 8, steps: int = 8) -> tuple[float, float]:
    """(ms per batched step of ``sessions`` decode rows, max |batched - unbatched|)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, 4 + i, hidden, generator=gen) for i in range(sessions)]
    inputs = [[torch.randn(1, 1, hidden, generator=gen) for _ in range(sessions)] for _ in range(steps)]

    def open_all():
        caches = CacheManager(100_000, len(runner.blocks), layout, torch.float32)
        out = []
        for i, p in enumerate(prompts):
            cache = caches.open(f"s{i}", 1, 64)
            caches.ensure_capacity(cache, 64)
            runner.inference_step(cache, p, 0)
            out.append(cache)
        return out

    times, worst = [], 0.0
    with torch.inference_mode():
        alone, together = open_all(), open_all()
        for xs in inputs:
            expected = [runner.inference_step(c, x, c.position) for c, x in zip(alone, xs, strict=True)]
            t0 = time.perf_counter()
            got = runner.inference_batch([StepItem(c, x, c.position) for c, x in zip(together, xs, strict=True)])
            times.append(time.perf_counter() - t0)
            worst = max(worst, *(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True)))
    return 1000 * statistics.median(times), worst


def greedy(model, ids: torch.Tensor, tokens: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return out[0, ids.shape[1] :].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def agreement(path: str, prompts: list[str], tokens: int) -> dict[str, dict]:
    """Every quantization of the whole model vs float32 (see the module docstring)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [greedy(reference, ids, tokens) for ids in inputs]
        sequences = [torch.cat([ids, torch.tensor([w])], 1) for ids, w in zip(inputs, want, strict=True)]
        pairs = list(zip(sequences, inputs, strict=True))
        ref_logits = [reference(seq).logits[0, ids.shape[1] - 1 : -1] for seq, ids in pairs]
    result = {}
    for quant in QUANTS[1:]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for layer in model.model.layers:
            quantize_linears(layer, quant)
        with torch.inference_mode():
            got = [greedy(model, ids, tokens) for ids in inputs]
            logits = [model(seq).logits[0, ids.shape[1] - 1 : -1] for seq, ids in pairs]
        prefixes = [common_prefix(g, w) for g, w in zip(got, want, strict=True)]
        top1 = sum(int((q.argmax(-1) == r.argmax(-1)).sum()) for q, r in zip(logits, ref_logits, strict=True))
        result[quant] = {
            "identical_sequences": sum(p == tokens for p in prefixes),
            "mean_common_prefix": statistics.fmean(prefixes),
            "top1_agreement": top1 / (len(prompts) * tokens),
            "max_abs_dlogits": max(float((q - r).abs().max()) for q, r in zip(logits, ref_logits, strict=True)),
            "logits_abs_max": max(float(r.abs().max()) for r in ref_logits),
        }
    return result


def bench_model(name: str, path: str, span: tuple[int, int], args: argparse.Namespace) -> dict:
    start, end = span
    print(f"[{name}] span {start}:{end}: RSS", flush=True)
    rss = {q: span_rss_mb(path, start, end, q) for q in QUANTS}
    print(f"[{name}] decode timing", flush=True)
    runs, layout, hidden = runners(path, start, end)
    decode = decode_times(runs, layout, hidden, args.tokens, args.rounds)
    batch = {q: batched(r, layout, hidden) for q, r in runs.items()}
    del runs
    print(f"[{name}] agreement", flush=True)
    agree = agreement(path, PROMPTS[: args.prompts], args.tokens)
    return {
        "model": name,
        "span": f"{start}:{end}",
        "rss_mb": {q: rss[q][0] for q in QUANTS},
        "peak_load_mb": {q: rss[q][1] for q in QUANTS},
        "rss_ratio": {q: rss[q][0] / rss["none"][0] for q in QUANTS},
        "decode_ms": decode,
        "speedup_vs_float32": {q: decode["none"] / decode[q] for q in QUANTS},
        "batched8_ms": {q: batch[q][0] for q in QUANTS},
        "batched_vs_unbatched_max_diff": {q: batch[q][1] for q in QUANTS},
        "agreement": agree,
    }


def markdown(report: dict) -> str:
    lines = [
        f"Quantized spans vs float32 (panel kernel), {report['cpu']}, torch threads 1; "
        f"{report['prompts']} prompts × {report['tokens']} greedy tokens; {report['when']}",
        "",
        "| model (span) | quant | span RSS MB (× f32) | peak load MB | decode ms/token (speed-up) | 8 sessions ms/step "
        "| batched − unbatched | identical seqs | mean common prefix | top-1 agree | max abs Δlogits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in report["models"]:
        for q in QUANTS:
            a = m["agreement"].get(q)
            agree = (
                f"{a['identical_sequences']}/{report['prompts']} | {a['mean_common_prefix']:.1f} | "
                f"{100 * a['top1_agreement']:.1f}% | {a['max_abs_dlogits']:.3f} (of {a['logits_abs_max']:.1f})"
                if a else "— | — | — | —"
            )  # fmt: skip
            lines.append(
                f"| {m['model']} ({m['span']}) | {q} | {m['rss_mb'][q]} ({m['rss_ratio'][q]:.2f}×) | "
                f"{m['peak_load_mb'][q]} | {m['decode_ms'][q]:.2f} ({m['speedup_vs_float32'][q]:.2f}×) | "
                f"{m['batched8_ms'][q]:.2f} | {m['batched_vs_unbatched_max_diff'][q]:.1e} | {agree} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm,medium", help="comma-separated: smollm, medium, tiny or a path")
    p.add_argument("--span", default="0:8", help="blocks measured for RSS and decode (clipped to the model)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="interleaved decode timing rounds")
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "quant.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from load_tests.bench_decode import resolve_model

    report = {
        "cpu": f"{torch.backends.cpu.get_cpu_capability()} CPU",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tokens": args.tokens,
        "prompts": args.prompts,
        "models": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        for name in args.models.split(","):
            path = resolve_model(name, Path(tmp))
            layers = AutoConfig.from_pretrained(path).num_hidden_layers
            a, b = (int(x) for x in args.span.split(":"))
            report["models"].append(bench_model(name, path, (min(a, layers - 1), min(b, layers)), args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
